"""Decode attention on the CPU over a CPU-resident KV cache (what --cpu-cache-compute runs), against
a CPU memcpy of the same bytes measured in the same run.

    python scripts/bench_cpu_attention.py            # OPT-6.7B's attention shape, batch 32, 512+32 slots

A float16 run holds such a cache in bfloat16 or float32, whichever the CPU computes faster
(kv/home.py); both are measured. The attention is flexh2o's own decode_attention on all of torch's
threads; the figure is the K and V bytes read per second, and the bound is torch's copy of a tensor
of that size (read + write, so the copy moves twice the bytes: both rates are given). Writes results/cpu_attention.{json,md}.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.kv.cache import KVCache  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.models.attention import decode_attention  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402


def timed(fn, runs: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(batch, heads, head_dim, slots, dtype, runs) -> dict:
    k, v = (torch.randn(batch, heads, slots, head_dim).to(dtype) for _ in range(2))
    cache = KVCache(k, v, torch.arange(slots, dtype=torch.int32).expand(batch, heads, slots).contiguous())
    q, k_new, v_new = (torch.randn(batch, heads, 1, head_dim).to(dtype) for _ in range(3))
    scale = head_dim ** -0.5
    kv_bytes = 2 * k.numel() * k.element_size()
    attention_s = timed(lambda: decode_attention(q, cache, k_new, v_new, scale), runs)
    src = torch.cat([k.flatten(), v.flatten()])
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), runs)
    return {"batch": batch, "heads": heads, "head_dim": head_dim, "slots": slots, "dtype": str(dtype),
            "kv_bytes": kv_bytes, "attention_s": attention_s, "attention_read_Bps": kv_bytes / attention_s,
            "memcpy_s": copy_s, "memcpy_read_Bps": kv_bytes / copy_s, "ratio": copy_s / attention_s}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--slots", type=int, default=544)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "cpu_attention"))
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = [measure(args.batch, args.heads, args.head_dim, args.slots, dtype, args.runs)
            for dtype in (torch.bfloat16, torch.float32)]
    result = {"command": "python " + " ".join(sys.argv), "rows": rows, "threads": torch.get_num_threads(),
              "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result))
    print(markdown(result))
    return result


def markdown(r) -> str:
    m = r["machine"]
    lines = ["# Decode attention on the CPU against a CPU memcpy", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']} ({r['threads']} threads). "
             f"Command: `{r['command']}`. Medians of the runs.", "",
             "| cache dtype | batch x heads x slots x head_dim | K+V GB | attention s | K+V read GB/s "
             "| memcpy s (same bytes) | memcpy read GB/s | attention / memcpy |", "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['dtype'].removeprefix('torch.')} | {x['batch']} x {x['heads']} x {x['slots']} x "
                     f"{x['head_dim']} | {x['kv_bytes'] / 1e9:.3f} | {x['attention_s']:.4f} | "
                     f"{x['attention_read_Bps'] / 1e9:.2f} | {x['memcpy_s']:.4f} | {x['memcpy_read_Bps'] / 1e9:.2f} | "
                     f"**{x['ratio']:.2f}** (target >= 0.5) |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
