"""Validates a CUDA machine (`make gpu-check` runs it after tests/test_cuda.py): allocator checks
and GPU benchmarks, written to results/gpu.{json,md} with the device's name. Under 10 minutes on
one H100.

1. Allocator: a matrix of placements (weights and cache on gpu / cpu / disk / mixed, activations on
   gpu and cpu, 1 and 3 gpu-batches, full and H2O) of OPT-1.3B dummy fp16 at batches where a
   miscount matters, each under --gpu-mem: torch's allocator peak must stay under the cap, and the
   pre-flight projection must be within 10% of it.
2. Decode with the cache in CPU memory, and with the weights streamed from CPU memory: tokens/s
   against the bound = bytes moved per decode step / pinned host-to-device bandwidth measured in
   the same run (target >= 0.7 of the bound).
3. Prefill with the cache in CPU memory (and with --cpu-cache-compute) against the all-on-GPU
   prefill of the same batch (target <= 1.3x).
4. --cpu-cache-compute: the CPU's decode attention reads the cache at >= 0.5 of a CPU memcpy
   (scripts/bench_cpu_attention.py's measurement, on this machine's CPU).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu_attention import measure as cpu_attention  # noqa: E402
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.kv import budget  # noqa: E402
from flexh2o.kv.home import cpu_attention_dtype  # noqa: E402
from flexh2o.machine import describe_machine  # noqa: E402
from flexh2o.memory import CUDA_HEADROOM  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.output import write_json_atomic, write_text_atomic  # noqa: E402

GB = 1 << 30
MODEL = "opt-1.3b"

# (name, weights gpu/cpu, cache gpu/cpu, act, gpu-batch size, gpu-batches, hh_ratio, cpu_cache_compute[, compress])
MATRIX = [
    ("all on gpu", (100, 0), (100, 0), "gpu", 48, 1, None, False),
    ("all on gpu, h2o", (100, 0), (100, 0), "gpu", 96, 1, 0.1, False),
    ("cache cpu, act cpu, 3 batches", (100, 0), (0, 100), "cpu", 32, 3, None, False),
    ("weights cpu, h2o", (0, 100), (100, 0), "gpu", 64, 1, 0.1, False),
    ("weights disk, cache disk, 3 batches", (0, 0), (0, 0), "cpu", 16, 3, 0.1, False),
    ("mixed weights, mixed cache, 3 batches", (50, 30), (34, 33), "cpu", 24, 3, None, False),
    ("cache cpu, cpu_cache_compute", (100, 0), (0, 100), "gpu", 48, 1, None, True),
    ("weights cpu+disk, cache cpu+gpu, h2o, 3 batches", (20, 60), (50, 50), "cpu", 32, 3, 0.2, False),
    ("compressed: weights cpu, cache cpu, h2o, 3 batches", (0, 100), (0, 100), "cpu", 64, 3, 0.1, False, True),
    ("compressed: weights disk, cache gpu", (0, 0), (100, 0), "gpu", 64, 1, None, False, True),
]


def pinned_bandwidth(nbytes=1 << 30) -> float:
    """Host-to-device bytes/s from pinned memory, as the engine copies (one stream, non-blocking)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        best = max(best, nbytes / (time.perf_counter() - start))
    return best


def run(policy, prompt_len, gen_len, offload_dir, gpu_mem=None):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with Engine.from_pretrained(MODEL, policy=policy, device="cuda", dtype=torch.float16, dummy=True,
                                offload_dir=offload_dir, gpu_mem=gpu_mem, prompt_len=prompt_len,
                                gen_len=gen_len) as engine:
        ids, _ = synthetic_prompts(policy.batch_size, prompt_len, engine.spec.vocab_size, seed=0)
        engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        s = engine.last_stats
        return {"prefill_s": s.prefill_seconds, "decode_s": s.decode_seconds,
                "decode_tok_s": policy.batch_size * (s.steps_done - 1) / s.decode_seconds,
                "allocator_peak": torch.cuda.max_memory_allocated(), "projected_gpu": engine.projected["gpu"],
                "tracked_gpu": engine.tiers.peak["gpu"], "pinned": engine.tiers.pinned_bytes(),
                "spec": engine.spec}


def policy_of(w, c, act, b, nb, hh, ccc, compress=False):
    return Policy(gpu_batch_size=b, num_gpu_batches=nb, w_gpu_percent=w[0], w_cpu_percent=w[1],
                  cache_gpu_percent=c[0], cache_cpu_percent=c[1], act_gpu_percent=100 if act == "gpu" else 0,
                  act_cpu_percent=100 if act == "cpu" else 0, hh_ratio=hh, cpu_cache_compute=ccc,
                  compress_weight=compress, compress_cache=compress)


def allocator_matrix(offload_dir, cap) -> list:
    rows = []
    for name, *config in MATRIX:
        r = run(policy_of(*config), 512, 4, offload_dir, cap)
        # The projection also holds CUDA_HEADROOM for the CUDA context, which the allocator never sees.
        projected = r["projected_gpu"] - CUDA_HEADROOM
        ok = r["allocator_peak"] < cap and abs(projected - r["allocator_peak"]) <= 0.10 * r["allocator_peak"]
        rows.append({"name": name, "allocator_peak": r["allocator_peak"], "projected_gpu": r["projected_gpu"],
                     "tracked_gpu": r["tracked_gpu"], "pinned": r["pinned"], "ok": ok})
        print(rows[-1], flush=True)
    return rows


def cache_bytes_per_decode(spec, policy, prompt_len, gen_len) -> float:
    """Mean bytes one decode step moves host-to-device for a cache held in CPU memory: K and V of the
    slots in use, and the per-slot positions (and scores) of every slot, every layer and sequence."""
    capacity, _ = budget(policy, prompt_len, gen_len)
    state = 4 + (4 if policy.kv_policy != "full" else 0)
    per_slot = spec.num_kv_heads * spec.head_dim * 2 * 2
    steps = range(1, gen_len)
    used = [min(capacity, prompt_len + i - 1) for i in steps]
    mean_used = sum(used) / len(used)
    return spec.num_layers * policy.batch_size * (mean_used * per_slot + capacity * spec.num_kv_heads * state)


def bandwidth_rows(offload_dir, bandwidth) -> list:
    prompt_len, gen_len = 512, 8
    rows = []
    cache_cpu = policy_of((100, 0), (0, 100), "gpu", 32, 2, None, False)
    r = run(cache_cpu, prompt_len, gen_len, offload_dir)
    moved = cache_bytes_per_decode(r["spec"], cache_cpu, prompt_len, gen_len)
    bound = cache_cpu.batch_size * bandwidth / moved
    rows.append({"name": "decode, cache in CPU memory (32 x 2 gpu-batches, 512+8)", "bytes_per_step": moved,
                 "bound_tok_s": bound, "measured_tok_s": r["decode_tok_s"], "ratio": r["decode_tok_s"] / bound})
    weights_cpu = policy_of((0, 100), (100, 0), "gpu", 32, 2, None, False)
    r = run(weights_cpu, prompt_len, gen_len, offload_dir)
    moved = r["spec"].param_count() * 2
    bound = weights_cpu.batch_size * bandwidth / moved
    rows.append({"name": "decode, weights streamed from CPU memory (32 x 2 gpu-batches, 512+8)",
                 "bytes_per_step": moved, "bound_tok_s": bound, "measured_tok_s": r["decode_tok_s"],
                 "ratio": r["decode_tok_s"] / bound})
    for row in rows:
        print(row, flush=True)
    return rows


def prefill_rows(offload_dir) -> list:
    base = run(policy_of((100, 0), (100, 0), "gpu", 64, 1, None, False), 512, 2, offload_dir)["prefill_s"]
    rows = []
    for name, ccc in (("cache in CPU memory", False), ("cache in CPU memory, cpu_cache_compute", True)):
        s = run(policy_of((100, 0), (0, 100), "gpu", 64, 1, None, ccc), 512, 2, offload_dir)["prefill_s"]
        rows.append({"name": name, "prefill_s": s, "all_on_gpu_s": base, "ratio": s / base})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-mem", default="16GB", help="the cap of the allocator matrix (a T4's memory)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "gpu"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    torch.set_grad_enabled(False)
    cap = int(float(args.gpu_mem.removesuffix("GB")) * GB)
    with tempfile.TemporaryDirectory(prefix="flexh2o-gpu-check-") as offload_dir:
        bandwidth = pinned_bandwidth()
        result = {"device": torch.cuda.get_device_name(), "gpu_mem_cap": cap, "pinned_h2d_Bps": bandwidth,
                  "allocator": allocator_matrix(offload_dir, cap), "bandwidth": bandwidth_rows(offload_dir, bandwidth),
                  "prefill": prefill_rows(offload_dir),
                  "cpu_attention": cpu_attention(32, 32, 128, 544, cpu_attention_dtype(torch.float16), 5),
                  "command": "make gpu-check", "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result))
    print(markdown(result))


def markdown(r) -> str:
    m, a = r["machine"], r["cpu_attention"]
    lines = [f"# GPU check on {r['device']}", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}, CUDA {m['cuda']}. "
             f"Command: `{r['command']}`. Model: {MODEL} dummy weights, float16. Pinned host-to-device "
             f"bandwidth measured in the run: {r['pinned_h2d_Bps'] / 1e9:.1f} GB/s.", "",
             f"## Allocator peak against the pre-flight projection (cap {r['gpu_mem_cap'] / GB:.0f} GB, 512+4)", "",
             "| placement | allocator peak GB | projected GB (less the context headroom) | tracked GB | pinned host GB | ok |", "|---|---|---|---|---|---|"]
    lines += [f"| {x['name']} | {x['allocator_peak'] / GB:.2f} | {(x['projected_gpu'] - CUDA_HEADROOM) / GB:.2f} | "
              f"{x['tracked_gpu'] / GB:.2f} | {x['pinned'] / GB:.2f} | {'yes' if x['ok'] else '**no**'} |"
              for x in r["allocator"]]
    lines += ["", "## Decode against the pinned-copy bound (target >= 0.7)", "",
              "| run | GB moved per step | bound tok/s | measured tok/s | measured / bound |", "|---|---|---|---|---|"]
    lines += [f"| {x['name']} | {x['bytes_per_step'] / 1e9:.2f} | {x['bound_tok_s']:.1f} | {x['measured_tok_s']:.1f} | "
              f"**{x['ratio']:.2f}** |" for x in r["bandwidth"]]
    lines += ["", "## Prefill with the cache in CPU memory (batch 64, 512 tokens; target <= 1.3x)", "",
              "| run | prefill s | all-on-GPU prefill s | ratio |", "|---|---|---|---|"]
    lines += [f"| {x['name']} | {x['prefill_s']:.2f} | {x['all_on_gpu_s']:.2f} | **{x['ratio']:.2f}** |"
              for x in r["prefill"]]
    lines += ["", f"## CPU decode attention (cpu_cache_compute), cache in {a['dtype']}", "",
              f"K+V read at {a['attention_read_Bps'] / 1e9:.1f} GB/s against a CPU memcpy's "
              f"{a['memcpy_read_Bps'] / 1e9:.1f} GB/s: **{a['ratio']:.2f}** (target >= 0.5).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
