"""Reads a profiler trace from scripts/gpu_diagnose.py (any machine, no GPU needed) and says where
a CUDA step's time went:

    python scripts/analyze_trace.py trace_decode-cache-cpu.json.gz

- per stream: kernel and copy time, and the window from its first to its last event;
- the copy engine: host-to-device and device-to-host bytes, busy time over the window and the rate;
- the gaps in each stream longer than --gap-ms, summed, and for the gaps before a copy how late
  the copy was queued (a copy queued after its stream went idle: the thread that queues it was late);
- per CPU thread: the time spent in CUDA synchronizations (an I/O thread blocked there queues nothing).
"""

import argparse
import collections
import gzip
import json

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summarize(events: list, gap_us: float) -> dict:
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    streams = collections.defaultdict(list)
    for e in device:
        streams[e["args"].get("stream")].append(e)
    out = {"streams": {}, "copies": {}, "syncs_ms": {}}
    for stream, evs in streams.items():
        start, end = evs[0]["ts"], max(e["ts"] + e["dur"] for e in evs)
        gaps, late, previous_end = [], [], None
        for e in evs:
            if previous_end is not None and e["ts"] - previous_end > gap_us:
                gaps.append(e["ts"] - previous_end)
                launch = launches.get(e["args"].get("correlation"))
                if e["cat"] == "gpu_memcpy" and launch is not None:
                    late.append(max(0.0, launch["ts"] - previous_end))
            previous_end = max(previous_end or 0, e["ts"] + e["dur"])
        out["streams"][str(stream)] = {
            "window_ms": (end - start) / 1e3,
            "kernels_ms": sum(e["dur"] for e in evs if e["cat"] == "kernel") / 1e3,
            "copies_ms": sum(e["dur"] for e in evs if e["cat"] == "gpu_memcpy") / 1e3,
            "gaps": len(gaps), "gaps_ms": sum(gaps) / 1e3,
            "copies_queued_late": len(late), "copies_queued_late_by_ms": sum(late) / 1e3}
    for direction in ("HtoD", "DtoH"):
        copies = [e for e in device if e["cat"] == "gpu_memcpy" and direction in e["name"]]
        if not copies:
            continue
        window = max(e["ts"] + e["dur"] for e in copies) - copies[0]["ts"]
        busy = sum(e["dur"] for e in copies)
        moved = sum(e["args"].get("bytes", 0) for e in copies)
        out["copies"][direction] = {"count": len(copies), "gb": moved / 1e9, "busy_ms": busy / 1e3,
                                    "window_ms": window / 1e3, "busy_share": busy / window if window else 0.0,
                                    "gb_per_s_while_busy": moved / busy / 1e3 if busy else 0.0}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "ynchronize" in e["name"]:
            key = f"thread {e['tid']}: {e['name']}"
            out["syncs_ms"][key] = out["syncs_ms"].get(key, 0.0) + e["dur"] / 1e3
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gap-ms", type=float, default=0.2, help="idle time in a stream counted as a gap")
    args = ap.parse_args()
    for path in args.traces:
        s = summarize(load(path), args.gap_ms * 1e3)
        print(f"# {path}")
        for stream, v in s["streams"].items():
            print(f"stream {stream}: window {v['window_ms']:.1f} ms, kernels {v['kernels_ms']:.1f}, copies "
                  f"{v['copies_ms']:.1f}, {v['gaps']} gaps {v['gaps_ms']:.1f} ms; {v['copies_queued_late']} copies "
                  f"queued after their stream went idle, late by {v['copies_queued_late_by_ms']:.1f} ms in all")
        for direction, v in s["copies"].items():
            print(f"{direction}: {v['count']} copies, {v['gb']:.2f} GB, busy {v['busy_ms']:.1f} of {v['window_ms']:.1f} ms "
                  f"({v['busy_share']:.2f}), {v['gb_per_s_while_busy']:.1f} GB/s while busy")
        for key, ms in sorted(s["syncs_ms"].items(), key=lambda x: -x[1])[:8]:
            print(f"{key}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
