"""What the server counts, in Prometheus' text format at GET /metrics (prometheus_client, with a
registry of the server's own, so that several servers in one process, as in tests, count apart).

Requests by route and status; prompt and generated tokens; the online sequences queued, the rows
busy and the rows there are; generated tokens per second over the last WINDOW seconds; and
histograms of an online sequence's time to its first token and of the time between its tokens.
"""

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

WINDOW = 10.0  # seconds of the generated-tokens rate
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, rows: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flexh2o_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("flexh2o_prompt_tokens", "prompt tokens of the requests taken", registry=r)
        self.generated_tokens = Counter("flexh2o_generated_tokens", "tokens generated (online and batches)",
                                        registry=r)
        self.queue_depth = Gauge("flexh2o_queue_depth", "online sequences waiting for a row", registry=r)
        self.rows_busy = Gauge("flexh2o_rows_busy", "rows (slots of the batch) running a sequence", registry=r)
        Gauge("flexh2o_rows", "rows (slots of the batch) the engine runs", registry=r).set(rows)
        self.rate = Gauge("flexh2o_generated_tokens_per_second", f"tokens generated per second over the last "
                          f"{WINDOW:g} s", registry=r)
        self.rate.set_function(self._rate)
        self.first_token = Histogram("flexh2o_time_to_first_token_seconds", "from an online sequence's arrival to "
                                     "its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.between_tokens = Histogram("flexh2o_inter_token_latency_seconds", "between an online sequence's "
                                        "tokens", buckets=LATENCY_BUCKETS, registry=r)
        self._recent = collections.deque()  # (second, tokens) of the last WINDOW seconds
        self._lock = threading.Lock()

    def token(self, tag, now: float, busy: int):
        """A sequence (its Tag) got a token at `now` (time.monotonic()); `busy` rows run."""
        self.generated_tokens.inc()
        self.rows_busy.set(busy)
        if not tag.is_batch:
            if tag.last_token_at is None:
                self.first_token.observe(now - tag.queued_at)
            else:
                self.between_tokens.observe(now - tag.last_token_at)
        second = int(now)
        with self._lock:
            if self._recent and self._recent[-1][0] == second:
                self._recent[-1][1] += 1
            else:
                self._recent.append([second, 1])
            self._trim(now)

    def _trim(self, now: float):
        while self._recent and self._recent[0][0] <= now - WINDOW - 1:
            self._recent.popleft()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for second, n in self._recent if second > now - WINDOW - 1) / WINDOW

    def answered(self, route: str, status: int):
        self.requests.labels(route, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
