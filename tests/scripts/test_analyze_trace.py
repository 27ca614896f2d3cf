"""scripts/analyze_trace.py on a made-up trace: the copy engine's busy share, a stream's gaps, a copy
queued late, and the time a thread spent synchronizing."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from analyze_trace import summarize  # noqa: E402


def event(cat, name, ts, dur, stream=None, correlation=None, tid=1, nbytes=None):
    args = {"stream": stream, "correlation": correlation}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_busy_share_gaps_late_copies_and_syncs():
    events = [
        event("cuda_runtime", "cudaMemcpyAsync", 0, 5, correlation=1),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 1000, stream=13, correlation=1, nbytes=10 ** 9),
        event("cuda_runtime", "cudaMemcpyAsync", 1500, 5, correlation=2),  # queued 490 us after the stream went idle
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1510, 1000, stream=13, correlation=2, nbytes=10 ** 9),
        event("kernel", "gemm", 20, 2000, stream=7),
        event("cuda_runtime", "cudaEventSynchronize", 100, 700, tid=9),
    ]
    s = summarize(events, gap_us=200)
    h2d = s["copies"]["HtoD"]
    assert h2d["count"] == 2 and h2d["busy_ms"] == 2.0 and h2d["window_ms"] == 2.5
    assert abs(h2d["busy_share"] - 0.8) < 1e-9 and abs(h2d["gb_per_s_while_busy"] - 1000.0) < 1e-6
    copies = s["streams"]["13"]
    assert copies["gaps"] == 1 and copies["gaps_ms"] == 0.5
    assert copies["copies_queued_late"] == 1 and copies["copies_queued_late_by_ms"] == 0.49
    assert s["streams"]["7"]["kernels_ms"] == 2.0 and s["streams"]["7"]["gaps"] == 0
    assert s["syncs_ms"] == {"thread 9: cudaEventSynchronize": 0.7}
