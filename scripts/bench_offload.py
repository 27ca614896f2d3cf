"""Offloading benchmark: how well disk I/O overlaps compute, and decode against the disk's bound.

    python scripts/bench_offload.py     # OPT-1.3B dummy (bfloat16 or float32: the CPU's fast one), 80% of the weights on disk, --gpu-mem 1.25GB

The weights do not fit the compute-tier cap, so every token streams the disk share of every layer.
Reads miss the page cache: O_DIRECT where the offload dir's filesystem allows it, else each read's
pages are evicted after it with readahead off; the output names the mode the run got.

The disk bandwidth is measured in the overlap-on run itself, before each generate and after the
last: the engine's own reader (DiskStore.read) on as many threads as the engine's I/O pool reads
every disk segment of the weights, one task per tensor in layer order, into the engine's pooled
buffers, which is what one token step reads; the fastest of three such passes counts. Each run is
held to the larger of the measurements just before and just after it, so its bounds are the
generous ones.
- overlap = total time (overlap on) / max(I/O time, compute time) of the same run, I/O time being
  the bytes it read / the bandwidth, compute time its forward passes (as they ran, beside the I/O
  threads). It cannot be below 1; the target is at most 1.15. The overlap-off runs (I/O inline,
  one thread) are shown beside it.
- decode bound = batch / (bytes read per token step / bandwidth) tokens/s. Decode throughput
  cannot exceed it; the target is 0.8 of it.
A figure on the wrong side of its bound means the bound misses something; it is printed as a
WARNING and kept in the results. Writes results/offload.{json,md}.
"""

import argparse
import inspect
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.offload.disk import DIRECT, MEMORY  # noqa: E402
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.engine.preflight import parse_size  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402
from flexh2o.offload.tiers import Tiers  # noqa: E402

DTYPE = cpu_compute_dtype()  # bfloat16 where the CPU multiplies it natively, else float32
IO_THREADS = inspect.signature(Tiers).parameters["io_threads"].default  # the engine keeps the default
med = statistics.median


def weight_reads(engine) -> list:
    """(placed tensor, disk segment) for every weight with rows on disk, in the order a token step loads them."""
    return [(placed, seg) for layer in engine.layers for placed in layer.home
            for seg in placed.segments if seg.tier == "disk"]


def disk_bandwidth(engine, pool, repeats=3) -> float:
    """Bytes/s of one token step's weight reads, made as the engine makes them (see the module note);
    the fastest of `repeats` passes, since a shared or virtual disk's speed drifts from second to second."""
    tiers, reads = engine.tiers, weight_reads(engine)

    def read(placed, seg):
        buf = tiers.buffer(placed.shape, placed.dtype)
        try:
            tiers.disk.read(seg.file, 0, buf[seg.start: seg.stop])
        finally:
            tiers.release(buf)
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for done in [pool.submit(read, placed, seg) for placed, seg in reads]:
            done.result()
        fastest = min(fastest, time.perf_counter() - start)
    return sum(seg.file.nbytes for _, seg in reads) / fastest


def runs(args, overlap: bool, ids):
    """Stats of args.runs generate calls; with overlap on also the bandwidth before each and after the last."""
    policy = Policy(gpu_batch_size=args.batch, w_gpu_percent=args.w_gpu, w_cpu_percent=0, overlap=overlap)
    with Engine.from_pretrained(args.model, policy=policy, device="cpu", dtype=DTYPE, dummy=True,
                                offload_dir=args.offload_dir, bypass_page_cache=True,
                                gpu_mem=parse_size(args.gpu_mem, "--gpu-mem")) as engine, \
            ThreadPoolExecutor(IO_THREADS) as pool:
        engine.generate(ids, max_new_tokens=2, eos_token_id=None)  # warm-up
        stats, bandwidths = [], []
        for r in range(args.runs):
            if overlap:
                bandwidths.append(disk_bandwidth(engine, pool))
            engine.generate(ids, max_new_tokens=args.gen_len, eos_token_id=None)
            s = engine.last_stats
            stats.append(s)
            print(f"overlap={overlap} run {r}: prefill {s.prefill_seconds:.2f} s, decode {s.decode_seconds:.2f} s, "
                  f"compute {s.compute_seconds:.2f} s, io tasks {s.io_seconds:.2f} s, "
                  f"read {s.disk_bytes_read / 1e9:.3f} GB" +
                  (f", disk before it {bandwidths[-1] / 1e9:.3f} GB/s" if overlap else ""), flush=True)
        if overlap:
            bandwidths.append(disk_bandwidth(engine, pool))
            print(f"disk after the last run {bandwidths[-1] / 1e9:.3f} GB/s", flush=True)
        step_bytes = sum(seg.file.nbytes for _, seg in weight_reads(engine))
        return stats, bandwidths, step_bytes, engine.tiers.peak["disk"], engine.tiers.disk.page_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--w-gpu", type=float, default=20, help="percent of the weights on the compute tier; rest on disk")
    ap.add_argument("--gpu-mem", default="1.25GB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offload-dir", default="/tmp/flexh2o_bench_offload")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "offload"))
    args = ap.parse_args()
    ids, _ = synthetic_prompts(args.batch, args.prompt_len, 50272, seed=0)

    off, _, _, _, _ = runs(args, False, ids)
    on, bw, step_bytes, disk_bytes, page_cache = runs(args, True, ids)
    run_bw = [max(a, b) for a, b in zip(bw, bw[1:])]  # each run against the faster of its two neighbours
    total_off = med(s.prefill_seconds + s.decode_seconds for s in off)
    io_inline, compute_off = med(s.io_seconds for s in off), med(s.compute_seconds for s in off)
    totals_on = [s.prefill_seconds + s.decode_seconds for s in on]
    io_on = [s.disk_bytes_read / b for s, b in zip(on, run_bw)]
    overlap = [t / max(io, s.compute_seconds) for t, io, s in zip(totals_on, io_on, on)]
    decode_tps = [args.batch * (s.steps_done - 1) / s.decode_seconds for s in on]
    bound_tps = [args.batch * b / step_bytes for b in run_bw]
    roofline = [t / b for t, b in zip(decode_tps, bound_tps)]

    warnings = []
    for r, s in enumerate(on):
        if s.disk_bytes_read != s.steps_done * step_bytes:
            warnings.append(f"run {r} read {s.disk_bytes_read} bytes, not {s.steps_done} steps x {step_bytes}: "
                            "the bandwidth measurement does not read what the run reads")
        if overlap[r] < 1:
            warnings.append(f"run {r}: overlap {overlap[r]:.3f} < 1, faster than max(I/O, compute)")
        if roofline[r] > 1:
            warnings.append(f"run {r}: decode {decode_tps[r]:.2f} token/s beats its I/O bound {bound_tps[r]:.2f}")
    warnings = [f"WARNING: {w}; the bound misses something" for w in warnings]
    if page_cache == MEMORY:
        warnings.append("WARNING: the offload dir is in memory (tmpfs): no disk was measured")

    mode = "O_DIRECT reads" if page_cache == DIRECT else page_cache
    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "batch": args.batch,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "w_gpu_percent": args.w_gpu,
              "gpu_mem": args.gpu_mem, "weights_on_disk_bytes": disk_bytes, "page_cache": page_cache,
              "io_threads": IO_THREADS,
              "overlap_off": {"total_s": total_off, "io_inline_one_thread_s": io_inline, "compute_s": compute_off},
              "overlap_on": {"total_s": med(totals_on), "io_s_at_bandwidth": med(io_on),
                             "compute_s": med(s.compute_seconds for s in on), "decode_tok_s": med(decode_tps)},
              "overlap_ratio": med(overlap), "overlap_ratio_per_run": overlap,
              "disk_bandwidth_Bps": med(run_bw), "disk_bandwidth_samples": bw,
              "bytes_per_step": step_bytes, "io_bound_decode_tok_s": med(bound_tps),
              "roofline_ratio": med(roofline), "roofline_ratio_per_run": roofline, "warnings": warnings,
              "runs": {"off": [vars(s) for s in off], "on": [vars(s) for s in on]}, "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    m = result["machine"]
    lines = [f"# Offloading: {args.model} dummy weights, {str(DTYPE).removeprefix('torch.')}, {100 - args.w_gpu:g}% of the weights on disk",
             "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}. Command: `{result['command']}`. "
             f"Batch {args.batch}, {args.prompt_len}+{args.gen_len}, compute-tier cap {args.gpu_mem} "
             f"(weights {disk_bytes / 1e9:.2f} GB on disk), disk reads: {mode}, medians of {args.runs} runs. "
             f"Disk bandwidth measured in the overlap-on run with the engine's reader and its {IO_THREADS} I/O "
             "threads, reading what one token step reads.",
             "",
             "| figure | value |", "|---|---|",
             f"| overlap off: total / I/O inline (1 thread) / compute | "
             f"{total_off:.2f} s / {io_inline:.2f} s / {compute_off:.2f} s |",
             f"| overlap on: total / I/O at the measured bandwidth / compute | {med(totals_on):.2f} s / "
             f"{med(io_on):.2f} s / {med(s.compute_seconds for s in on):.2f} s |",
             f"| overlap on total / max(I/O, compute) | **{med(overlap):.3f}** (below 1 would beat the bound; target <= 1.15) |",
             f"| disk bandwidth, {IO_THREADS} threads ({mode}), each run's faster neighbour | "
             f"{med(run_bw) / 1e9:.3f} GB/s (samples in order: {', '.join(f'{b / 1e9:.3f}' for b in bw)}) |",
             f"| bytes read per token step | {step_bytes / 1e9:.3f} GB |",
             f"| decode I/O bound | {med(bound_tps):.2f} token/s |",
             f"| decode throughput, overlap on | {med(decode_tps):.2f} token/s |",
             f"| decode / I/O bound | **{med(roofline):.3f}** (above 1 would beat the bound; target >= 0.8) |", ""]
    lines += [f"**{w}**" for w in warnings] + ([""] if warnings else [])
    write_text_atomic(args.out + ".md", "\n".join(lines))
    print("\n".join(lines))
    for w in warnings:
        print(w, file=sys.stderr)


if __name__ == "__main__":
    main()
