"""The I/O threads, and the hand-offs that give them work.

Handing a task to a thread costs the compute thread a lock, a queue put and later a wait, and
on a busy machine a wake-up that may come late. So the schedule queues all of one step's loads
and stores inside `group()`, and they reach the I/O threads as one hand-off: one lock and one
notification for the whole group, whose tasks the threads then take oldest first. A task still gets
its own Pending: waiting for a cache load does not wait for a weight load queued after it. When
everything is already where compute needs it, no task is queued and no thread is ever started.

Loads and stores run on threads of their own (as many of each): a store blocks its thread until
the step it stores has been computed, and on threads shared with loads it held back the loads
queued behind it (decode with the cache in CPU memory on an H200: both threads blocked in stores
nearly a quarter of the time, the copy engine idle a quarter of it for want of the next load). A
load may wait for a store (a cache home's last write-back); a store never waits for a load.

A task that fails raises IOTaskError (naming what it was doing) to whoever waits for it; the run
then abandons the rest: the tasks not started are cancelled and the running ones finish, so
nothing is left writing into buffers or files the run is about to free.
"""

import threading
import weakref
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager


EXIT_JOIN_SECONDS = 10.0  # at interpreter exit, how long a running task may take to finish
LOAD, STORE = "load", "store"  # the lanes: a task runs on a thread of its lane


class IOTaskError(RuntimeError):
    """An I/O task failed: `what` it was doing, and why."""

    def __init__(self, what: str, cause: BaseException):
        if isinstance(cause, OSError) and cause.strerror:
            reason = cause.strerror + (f" ({cause.filename})" if cause.filename else "")
        else:
            reason = str(cause) or type(cause).__name__
        super().__init__(f"{what} failed: {reason}")
        self.what, self.cause = what, cause


class Pending:
    """A value that an I/O thread may still be filling; wait() returns it once it is ready. `then`,
    if given, finishes it on the waiting thread, once, after the I/O thread's part. A task may
    return copies still in flight on CUDA (cuda_io.Landed): wait() makes the waiting thread's
    stream wait for them, so the value is ready for the work that thread queues next."""

    def __init__(self, value, future=None, then=None, landed=None):
        self.value, self.future, self.then, self.landed = value, future, then, landed

    def wait(self):
        if self.future is not None:
            self.landed = self.future.result()
            self.future = None
        if self.landed is not None:
            landed, self.landed = self.landed, None
            landed.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return self.value


class IOThreads:
    def __init__(self, threads: int):
        self.threads = threads  # threads that load, and as many that store
        self.workers = []     # started by the first hand-off
        self.handoffs = 0     # groups of tasks handed to the threads
        self._group = None    # [(fn, future, lane)] queued inside group(), not yet handed off
        self._queues = {LOAD: deque(), STORE: deque()}  # handed off, not yet taken by a thread
        self._ready = threading.Condition()
        self._state = _State()
        # An engine never closed (or one whose close was cut short) still stops its threads: when it
        # is collected, or before the interpreter shuts down (a thread running then could end the
        # process in a fatal-error dump). The threads and the finalizer hold the queues and the
        # state, never this object, so that dropping it is what collects it.
        weakref.finalize(self, _stop, self._ready, self._queues, self._state, self.workers, EXIT_JOIN_SECONDS)

    def submit(self, fn, store: bool = False) -> Future:
        """Queues fn, a load or a store (inside group(): with the group's other tasks), and returns
        its future."""
        future = Future()
        task = (fn, future, STORE if store else LOAD)
        if self._group is not None:
            self._group.append(task)
        else:
            self._hand_off([task])
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
        # Each thread is listed once started: a signal's exception between the two would otherwise
        # leave close() joining a thread never started (a RuntimeError instead of a clean exit).
        lanes = [LOAD] * self.threads + [STORE] * self.threads
        for n in range(len(self.workers), len(lanes)):
            worker = threading.Thread(target=_work, args=(self._ready, self._queues[lanes[n]], self._state),
                                      name=f"flexh2o-io-{n}", daemon=True)
            worker.start()
            self.workers.append(worker)
        with self._ready:
            self.handoffs += 1
            for fn, future, lane in tasks:
                self._queues[lane].append((fn, future))
            self._ready.notify_all()

    def abandon(self):
        """Cancels the tasks not started (their wait() raises) and waits for the running ones;
        the threads stay for a later run."""
        with self._ready:
            left = _take_queued(self._queues)
        for _, future in left:
            future.cancel()
        with self._ready:
            while self._state.running:
                self._ready.wait()

    def close(self, timeout: float | None = None):
        """Waits for the running tasks (at most `timeout` seconds per thread); those not started are
        cancelled (their wait() raises)."""
        _stop(self._ready, self._queues, self._state, self.workers, timeout)


class _State:
    running = 0     # tasks taken by a thread and not yet finished
    closed = False


def _take_queued(queues: dict) -> list:
    """Empties the queues (the caller holds the lock): the tasks not started."""
    left = [task for queue in queues.values() for task in queue]
    for queue in queues.values():
        queue.clear()
    return left


def _stop(ready, queues: dict, state: _State, workers: list, timeout: float | None):
    with ready:
        left = _take_queued(queues)
        state.closed = True
        ready.notify_all()
    for _, future in left:
        future.cancel()
    for worker in workers:
        if worker is not threading.current_thread():  # (collected on a worker thread: it ends once this returns)
            worker.join(timeout)


def _work(ready, queue, state: _State):
    """A thread takes its lane's queued tasks one at a time, oldest first: the loads of one group
    run on the load threads at once (two disk reads in flight read faster than one), and a task
    only ever waits for one queued before it in its lane, which has been taken already, or (a
    load) for a store, which the store threads run."""
    while True:
        with ready:
            while not queue and not state.closed:
                ready.wait()
            if not queue:
                return
            fn, future = queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            state.running += 1
        try:
            result = fn()
        except BaseException as e:  # the waiter gets it, as from a task of its own
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            with ready:
                state.running -= 1
                ready.notify_all()

