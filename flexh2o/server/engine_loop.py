"""The engine's loop: every sequence the server generates, a choice of an online request or a record
of a batch, joins one pool of refilled slots (engine/slot_pool.py). run() drives it on the thread
that calls it, the one that loaded the model (service.py says why).

The pool's source hands it, whenever a row is free, the next online sequence of a bounded queue
(`max_queued`: beyond it a request is refused with 429, never kept), and while none waits the
next record of a running batch (a feed, batches.py), so batch records fill the rows the online
requests leave. When nothing runs and nothing waits the pool waits for work, its caches kept.

Each sequence is a slot_request.Request whose tag (a Tag) says where its tokens go. The tags'
methods run on the engine's thread; what they hand to an asyncio loop (the HTTP side) is posted (post())
and delivered once per token step, in one wake-up of that loop for all its sequences: one
wake-up per token of every stream would take the CPU from the engine's threads far more often.

stop_taking() ends the intake: new requests are refused (503), the batches pause (their records
in flight are cancelled: a batch resumes them when the server starts again), the queued and
running online sequences finish, then run() returns. cancel_all() cuts that short.
"""

import collections
import threading
import time

import torch

from flexh2o.server.errors import bad_request, queue_full, unavailable


class Tag:
    """Where a sequence's tokens go: token(request, token) as each is chosen, done(request, tokens,
    reason) at its end ("stop", "length" or "cancelled"), fail(message) where the engine failed;
    and when it was queued and got its tokens (metrics.py)."""

    is_batch = False  # a batch's record (its sequence is cancelled, not finished, when the server stops)
    post = None       # post(asyncio loop, function, *args): set by the engine loop that runs it

    def __init__(self):
        self.queued_at = time.monotonic()
        self.first_token_at = self.last_token_at = None

    def token(self, request, token: int):
        pass

    def done(self, request, tokens: list, reason: str):
        pass

    def fail(self, message: str):
        pass


class EngineLoop:
    def __init__(self, engine, prompt_len: int, gen_len: int, eos, max_queued: int, join_every: int = 1,
                 prompt_chunk: int | None = None, metrics=None, on_failure=None):
        """prompt_len, gen_len: the shape every row's cache is sized for (the longest prompt and the
        most new tokens of any sequence); eos: the ids that end a sequence; on_failure(error): called
        on the engine's thread if the engine fails (the server then stops)."""
        self.engine, self.shape, self.eos = engine, (prompt_len, gen_len), eos
        self.max_queued, self.join_every, self.prompt_chunk = max_queued, join_every, prompt_chunk
        self.metrics, self.on_failure = metrics, on_failure
        self.queue = collections.deque()  # online sequences waiting for a row
        self.feeds = []                   # running batches (batches.py)
        self.in_pool = set()              # sequences handed to the pool and not ended
        self.busy = 0                     # of which with a row (their first token chosen)
        self.cond = threading.Condition()
        self.outbox: dict = {}            # asyncio loop -> [(function, args)] posted during this token step
        self.taking = True
        self.failure = None
        self.ended = threading.Event()  # run() has returned

    # -- from any thread ----------------------------------------------------------------------------
    def submit(self, requests: list):
        """Queues an online request's sequences (all or none): 503 once the intake stopped, 429 where
        the queue would hold more than max_queued."""
        with self.cond:
            if self.failure is not None or not self.taking:
                raise unavailable("the server is shutting down" if self.failure is None else "the engine failed")
            if len(requests) > self.max_queued:
                raise bad_request(f"the request makes {len(requests)} sequences (prompts x n), more than this "
                                  f"server queues ({self.max_queued}, --max-queued)", "n")
            if len(self.queue) + len(requests) > self.max_queued:
                raise queue_full(len(self.queue))
            for request in requests:
                request.on_token, request.tag.post = self._token, self.post
            self.queue.extend(requests)
            self._changed()

    def add_feed(self, feed):
        with self.cond:
            self.feeds.append(feed)
            self._changed()

    def remove_feed(self, feed):
        with self.cond:
            if feed in self.feeds:
                self.feeds.remove(feed)

    def wake(self):
        """A feed has work again (a batch resumed), or a request was cancelled."""
        with self.cond:
            self._changed()

    def waiting(self) -> int:
        return len(self.queue)

    def stop_taking(self):
        """No new request from now on; the batches' sequences in the pool are cancelled."""
        with self.cond:
            self.taking = False
            for request in self.in_pool:
                if request.tag.is_batch:
                    request.cancelled = True
            self._changed()

    def cancel_all(self):
        with self.cond:
            for request in list(self.queue) + list(self.in_pool):
                request.cancelled = True
            self._changed()

    def idle(self) -> bool:
        """Nothing queued and nothing in the pool."""
        with self.cond:
            return not self.queue and not self.in_pool

    def _changed(self):
        self.cond.notify_all()
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.queue))

    # -- on the engine's thread ---------------------------------------------------------------------
    def run(self):
        """Generates until the intake stopped and nothing is left, or the engine failed."""
        try:
            self._run()
        finally:
            self.ended.set()

    def _run(self):
        try:
            with torch.no_grad():
                self.engine.generate_refilled(self._source(), self._done, *self.shape, eos_token_id=self.eos,
                                              join_every=self.join_every, prompt_chunk=self.prompt_chunk,
                                              wait_for_work=self._wait_for_work, on_step=self.deliver)
        except BaseException as error:  # noqa: BLE001 - every sequence is told, then the server stops
            with self.cond:
                self.failure = error
                lost = list(self.queue) + list(self.in_pool)
                self.queue.clear()
                self.in_pool.clear()
            message = f"the engine failed: {type(error).__name__}: {error}"
            for request in lost:
                request.tag.fail(message)
            self.deliver()
            if self.on_failure is not None:
                self.on_failure(error)

    def _source(self):
        while True:
            yield self._next()

    def _next(self):
        """The next sequence for a free row: an online one, else (while taking) a batch's record."""
        with self.cond:
            request = self.queue.popleft() if self.queue else None
            if request is None and self.taking:
                for feed in list(self.feeds):
                    request = feed.next_request()
                    if request is not None:
                        request.on_token = self._token
                        break
            if request is not None:
                self.in_pool.add(request)
            self._changed()
            return request

    def _wait_for_work(self) -> bool:
        """Nothing runs and nothing waits: until something may (True), or the intake stopped (False)."""
        with self.cond:
            while not self.queue and not (self.taking and any(feed.has_work() for feed in self.feeds)):
                if not self.taking:
                    return False
                self.cond.wait()
            return True

    def post(self, loop, function, *args):
        """function(*args) to run on asyncio `loop`, once this token step ends (deliver)."""
        self.outbox.setdefault(loop, []).append((function, args))

    def deliver(self):
        """What this token step posted, to each asyncio loop in one call."""
        posted, self.outbox = self.outbox, {}
        for loop, calls in posted.items():
            try:
                loop.call_soon_threadsafe(run_all, calls)
            except RuntimeError:  # that loop is closed: the server stopped
                pass

    def _token(self, request, token: int):
        tag, now = request.tag, time.monotonic()
        if tag.first_token_at is None:
            tag.first_token_at = now
            with self.cond:
                self.busy += 1
        if self.metrics is not None:
            self.metrics.token(tag, now, self.busy)
        tag.last_token_at = now
        tag.token(request, token)

    def _done(self, request, tokens: list, reason: str):
        with self.cond:
            self.in_pool.discard(request)
            if request.tag.first_token_at is not None:
                self.busy -= 1
            self._changed()
        if self.metrics is not None:
            self.metrics.rows_busy.set(self.busy)
        request.tag.done(request, tokens, reason)


def run_all(calls: list):
    for function, args in calls:
        function(*args)
