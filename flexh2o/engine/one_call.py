"""One call at a time on an engine: its runs own the caches, the pool and the I/O threads. A call
waits for the one another thread is running; a call from inside a running call, on that call's own
thread (a progress, on_done or stop callback), is refused, since it would wait for itself forever;
and no call runs once the engine is closed."""

import functools
import threading
from contextlib import contextmanager

from flexh2o.common.errors import UsageError


class OneCall:
    def __init__(self):
        self._lock = threading.Lock()
        self._caller = None  # the thread running a call under _lock
        self.closed = False

    def inside(self) -> bool:
        """Whether this thread is inside a running call (in one of its callbacks)."""
        return self._caller == threading.get_ident()

    def check_not_inside(self, name: str):
        if self.inside():
            raise UsageError(name, "called from inside a running call of the same engine (from one of its "
                             "callbacks), where it would wait for itself forever: call it once that call returned")

    @contextmanager
    def running(self, name: str):
        """The call `name`, once no other runs; refused from inside one, or once closed."""
        self.check_not_inside(name)
        with self._lock:
            if self.closed:
                raise UsageError(name, "the engine was closed; load the model again (Engine.from_pretrained)")
            self._caller = threading.get_ident()
            try:
                yield
            finally:
                self._caller = None

    def close(self, finish):
        """Runs finish() once no call runs, and refuses every call from then on."""
        self.check_not_inside("close")
        with self._lock:
            self.closed = True
            finish()


def one_call_at_a_time(method):
    """An engine method run under its engine's OneCall (engine.calls)."""
    @functools.wraps(method)
    def call(engine, *args, **kwargs):
        with engine.calls.running(method.__name__):
            return method(engine, *args, **kwargs)
    return call
