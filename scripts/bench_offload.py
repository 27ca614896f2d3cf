"""Offloading benchmarks: overlap and the disk roofline, in one run.

    python scripts/bench_offload.py     # OPT-1.3B dummy, bf16, 80% of the weights on disk, --gpu-mem 1.25GB

The model's weights (2.6 GB) do not fit the compute-tier cap, so each token streams the disk
share of every layer. Disk reads bypass the page cache (posix_fadvise DONTNEED).
- overlap: the same job with overlap off gives the I/O time and the compute time; with overlap
  on, the total should be at most 1.15 x max(I/O, compute).
- roofline: the disk bandwidth is measured in the same run by reading the offloaded weight files
  with the engine's own reader and thread count; the decode I/O bound is
  batch / (bytes read per decode step / bandwidth); decode throughput should reach 0.8 of it.
Writes results/offload.{json,md}.
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.machine import describe_machine  # noqa: E402
from flexh2o.memory import parse_size  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.report import write_json_atomic, write_text_atomic  # noqa: E402


def disk_bandwidth(engine, threads=2) -> float:
    """Bytes/s reading every offloaded file once, in placement order, page cache bypassed, with
    as many readers as the engine has I/O threads, each into one reused buffer (as the engine does)."""
    disk = engine.tiers.disk
    files = list(disk.files)
    size = max(f.nbytes for f in files)
    buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(threads)]  # touched before timing
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: [disk.read(f, 0, buffers[n][: f.nbytes]) for f in files[n::threads]],
                      range(threads)))
    return sum(f.nbytes for f in files) / (time.perf_counter() - start)


def runs(args, overlap: bool, ids):
    policy = Policy(gpu_batch_size=args.batch, w_gpu_percent=args.w_gpu, w_cpu_percent=0, overlap=overlap)
    with Engine.from_pretrained(args.model, policy=policy, device="cpu", dtype=torch.bfloat16, dummy=True,
                                offload_dir=args.offload_dir, bypass_page_cache=True,
                                gpu_mem=parse_size(args.gpu_mem, "--gpu-mem")) as engine:
        engine.generate(ids, max_new_tokens=2, eos_token_id=None)  # warm-up
        out, bandwidths = [], []
        for r in range(args.runs):
            bandwidths.append(disk_bandwidth(engine))
            engine.generate(ids, max_new_tokens=args.gen_len, eos_token_id=None)
            s = engine.last_stats
            out.append(s)
            print(f"overlap={overlap} run {r}: prefill {s.prefill_seconds:.2f} s, decode {s.decode_seconds:.2f} s, "
                  f"compute {s.compute_seconds:.2f} s, io {s.io_seconds:.2f} s, read {s.disk_bytes_read / 1e9:.2f} GB, "
                  f"disk {bandwidths[-1] / 1e9:.2f} GB/s", flush=True)
        disk_bytes = engine.tiers.peak["disk"]
    return out, bandwidths, disk_bytes


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

    seq, bw_seq, disk_bytes = runs(args, False, ids)
    ovl, bw_ovl, _ = runs(args, True, ids)
    med = statistics.median
    total_off = med(s.prefill_seconds + s.decode_seconds for s in seq)
    io_off, compute_off = med(s.io_seconds for s in seq), med(s.compute_seconds for s in seq)
    total_on = med(s.prefill_seconds + s.decode_seconds for s in ovl)
    overlap_ratio = total_on / max(io_off, compute_off)

    steps = args.gen_len - 1
    decode_bytes = med(s.disk_bytes_read / args.gen_len for s in ovl)  # every token step reads the same
    bandwidth = med(bw_seq + bw_ovl)
    decode_tps = med(args.batch * steps / s.decode_seconds for s in ovl)
    bound_tps = args.batch * bandwidth / decode_bytes
    roofline_ratio = decode_tps / bound_tps

    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "batch": args.batch,
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "w_gpu_percent": args.w_gpu,
              "gpu_mem": args.gpu_mem, "weights_on_disk_bytes": disk_bytes, "page_cache": "bypassed",
              "overlap_off": {"total_s": total_off, "io_s": io_off, "compute_s": compute_off},
              "overlap_on": {"total_s": total_on, "decode_tok_s": decode_tps},
              "overlap_ratio": overlap_ratio, "disk_bandwidth_Bps": bandwidth, "disk_bandwidth_samples": bw_seq + bw_ovl,
              "decode_bytes_per_step": decode_bytes, "io_bound_decode_tok_s": bound_tps,
              "roofline_ratio": roofline_ratio, "runs": {"off": [vars(s) for s in seq], "on": [vars(s) for s in ovl]},
              "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    m = result["machine"]
    lines = [f"# Offloading: {args.model} dummy weights, bfloat16, {100 - args.w_gpu:g}% of the weights on disk",
             "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}. Command: `{result['command']}`. "
             f"Batch {args.batch}, {args.prompt_len}+{args.gen_len}, compute-tier cap {args.gpu_mem} "
             f"(weights {disk_bytes / 1e9:.2f} GB on disk), page cache bypassed, medians of {args.runs} runs.",
             "",
             "| figure | value |", "|---|---|",
             f"| overlap off: total / I/O / compute | {total_off:.2f} s / {io_off:.2f} s / {compute_off:.2f} s |",
             f"| overlap on: total | {total_on:.2f} s |",
             f"| overlap on total / max(I/O, compute) | **{overlap_ratio:.3f}** (target <= 1.15) |",
             f"| disk bandwidth measured in the run | {bandwidth / 1e9:.3f} GB/s |",
             f"| bytes read per decode step | {decode_bytes / 1e9:.3f} GB |",
             f"| decode I/O bound | {bound_tps:.2f} token/s |",
             f"| decode throughput, overlap on | {decode_tps:.2f} token/s |",
             f"| decode / I/O bound | **{roofline_ratio:.3f}** (target >= 0.8) |", ""]
    write_text_atomic(args.out + ".md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
