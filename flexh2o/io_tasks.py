"""The I/O threads, and the hand-offs that give them work.

Handing a task to a thread costs the compute thread a lock, a queue put and later a wait, and
on a busy machine a wake-up that may come late. So the schedule queues all of one step's loads
and stores inside `group()`, and they reach the I/O threads as one hand-off that runs them in
the order they were queued. A task still gets its own Pending: waiting for a cache load does not
wait for a weight load queued after it. When everything is already where compute needs it, no
task is queued and no thread is ever started.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager


class Pending:
    """A value that an I/O thread may still be filling; wait() returns it once it is ready."""

    def __init__(self, value, future=None):
        self.value, self.future = value, future

    def wait(self):
        if self.future is not None:
            self.future.result()
            self.future = None
        return self.value


class IOThreads:
    def __init__(self, threads: int):
        self.threads = threads
        self.pool = None      # started by the first hand-off
        self.handoffs = 0     # groups of tasks handed to the threads
        self._group = None    # [(fn, future)] queued inside group(), not yet handed off
        self._outstanding = []  # handed-off groups not yet run (cancelled by close)
        self._lock = threading.Lock()

    def submit(self, fn) -> Future:
        """Queues fn (inside group(): with the group's other tasks) and returns its future."""
        future = Future()
        if self._group is not None:
            self._group.append((fn, future))
        else:
            self._hand_off([(fn, future)])
        return future

    @contextmanager
    def group(self):
        """Tasks submitted inside go to the threads together, as one hand-off (none if empty)."""
        if self._group is not None:  # already inside a group: it takes these too
            yield
            return
        self._group = []
        try:
            yield
        finally:
            tasks, self._group = self._group, None
            if tasks:  # handed off even when queuing failed midway: their waiters must not hang
                self._hand_off(tasks)

    def _hand_off(self, tasks):
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flexh2o-io")
        with self._lock:
            self.handoffs += 1
            self._outstanding.append(tasks)
        self.pool.submit(self._run, tasks)

    def _run(self, tasks):
        with self._lock:
            self._outstanding.remove(tasks)
        for fn, future in tasks:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn()
            except BaseException as e:  # the waiter gets it, as from a task of its own
                future.set_exception(e)
            else:
                future.set_result(None)

    def close(self):
        """Waits for the running tasks; those not started are cancelled (their wait() raises)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left, self._outstanding = self._outstanding, []
        for tasks in left:
            for _, future in tasks:
                future.cancel()
