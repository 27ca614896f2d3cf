"""4-bit compression: (A) decode with compressed weights where decode is I/O-bound, (B) the largest
batch a memory cap admits with the KV cache compressed.

    python scripts/bench_compression.py   # A: OPT-350M dummy, 8 x (32+12), cap 0.6GB; B: OPT-125M, cap 1.5GB

A. The weights --w-gpu% (default 0) on the compute tier, the rest on disk read with O_DIRECT
(bypass_page_cache), cache and activations on the compute tier: uncompressed vs compress_weight,
interleaved, one warm-up each, medians of --runs. On CUDA also the weights in CPU memory (on a CPU
compute device they are used in place: nothing to move). Then each mode at its own best placement
under the same enforced caps (placement.fitted_placement, from everything on the compute tier down),
which is what a user sees. With the CPU as the compute device its "gpu" and "cpu" tiers are the
same RAM, so --cpu-mem defaults to 0.1 GB there (what loading holds beyond the run's own memory:
its tensors as read, and their groups): --gpu-mem caps the run's memory as a whole (uncapped, both
modes would hold every weight in RAM and nothing would be I/O-bound).
B. Everything on the compute tier under --cache-cap-mem: the largest gpu_batch_size the engine's
pre-flight admits (placement.largest + placement.fits) with compress_cache off and on, in the
compute dtype and in the other width (projected only), for --cache-prompt-len + --cache-gen-len
and for the short run layout --run-prompt-len + --run-gen-len, whose compute-dtype batches then
run under the same cap (tracked peaks beside it). Plus the batches at other caps (pre-flight only).
Writes results/compression.{json,md}; about 6 minutes on 2 cores.
"""

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.offload.disk import DIRECT, MEMORY  # noqa: E402
from flexh2o.host.devices import default_device, default_dtype, parse_device, parse_dtype  # noqa: E402
from flexh2o.common.errors import UsageError  # noqa: E402
from flexh2o.kv import cache_bytes  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.engine.preflight import capacities, growth_bytes, layer_bytes, parse_size, run_need  # noqa: E402
from flexh2o.models import resolve_model  # noqa: E402
from flexh2o.common.output_files import rewrite_markdown, write_results  # noqa: E402
from flexh2o.planning.placement import WeightNeeds, describe, fits, fitted_placement, largest  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from flexh2o.runs.report import build_report  # noqa: E402

GB = 1 << 30
med = statistics.median
MODES = {False: "uncompressed", True: "compressed"}
CPU_DEVICE_CPU_MEM = int(0.1e9)  # --cpu-mem's default where the CPU computes: loading's transient (memory.load_transient)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")

# -- A ------------------------------------------------------------------------------------------
def a_policies(args, spec, caps, device, dtype) -> list:
    """(comparison, compressed, policy): the same placement(s) both ways, then each mode's best."""
    base, out = Policy(gpu_batch_size=args.batch), []
    same = {"disk": (args.w_gpu, 0)} | ({"CPU memory": (args.w_gpu, 100 - args.w_gpu)} if device.type == "cuda" else {})
    for where, (w_gpu, w_cpu) in same.items():
        for cw in MODES:
            p = dataclasses.replace(base, w_gpu_percent=w_gpu, w_cpu_percent=w_cpu, compress_weight=cw)
            if not fits(spec, p, dtype.itemsize, args.prompt_len, args.gen_len, caps, device):
                raise UsageError("--gpu-mem/--cpu-mem", f"{describe(p)} ({MODES[cw]}) does not fit the caps")
            out.append((f"same placement, rest on {where}", cw, p))
    for cw in MODES:
        p = fitted_placement(spec, dataclasses.replace(base, compress_weight=cw), dtype.itemsize, args.prompt_len,
                             args.gen_len, caps, device)
        if p is None:
            raise UsageError("--gpu-mem/--cpu-mem", f"no placement of the {MODES[cw]} weights fits the caps")
        out.append(("each at its best placement", cw, p))
    return out


def part_a(args, device, dtype) -> dict:
    spec, _ = resolve_model(args.model)
    cap = parse_size(args.gpu_mem, "--gpu-mem")
    cpu_cap = parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None else (CPU_DEVICE_CPU_MEM if device.type == "cpu" else None)
    caps = capacities(device, args.offload_dir, gpu_mem=cap, cpu_mem=cpu_cap)
    rows = a_policies(args, spec, caps, device, dtype)
    ids, _ = synthetic_prompts(args.batch, args.prompt_len, spec.vocab_size, seed=0)
    with contextlib.ExitStack() as stack:
        engines = {}  # one engine per distinct policy (a best placement may equal the same placement)
        for _, _, p in rows:
            if p not in engines:
                engines[p] = stack.enter_context(Engine.from_pretrained(
                    args.model, policy=p, device=device, dtype=dtype, dummy=True, offload_dir=args.offload_dir,
                    bypass_page_cache=True, gpu_mem=cap, cpu_mem=cpu_cap, prompt_len=args.prompt_len,
                    gen_len=args.gen_len))
        for e in engines.values():
            e.generate(ids, max_new_tokens=2, eos_token_id=None)  # warm-up
        runs, order = {p: [] for p in engines}, list(engines)
        for r in range(args.runs):  # interleaved, the order rotated each round
            for p in order[r % len(order):] + order[:r % len(order)]:
                e = engines[p]
                e.generate(ids, max_new_tokens=args.gen_len, eos_token_id=None)
                s, rep = e.last_stats, build_report(e, e.last_stats, p)
                runs[p].append({"prefill_s": s.prefill_seconds, "decode_s": s.decode_seconds,
                                "decode_tok_s": rep["decode_throughput"], "total_tok_s": rep["total_throughput"],
                                "dequant_share": sum(s.step_dequant_seconds[1:]) / s.decode_seconds,
                                "disk_read_bytes": s.disk_bytes_read, "io_s": s.io_seconds,
                                "compute_s": s.compute_seconds})
                print(f"A round {r} {describe(p)} compress_weight={p.compress_weight}: decode "
                      f"{runs[p][-1]['decode_tok_s']:.2f} tok/s, dequant share {runs[p][-1]['dequant_share']:.1%}",
                      flush=True)
        disk = {p: e.tiers.disk.page_cache if e.tiers.disk else None for p, e in engines.items()}
        modes = [{"comparison": c, "compressed": cw, "placement": describe(p), "policy": p.to_dict(),
                  "weights_bytes": sum(layer_bytes(engines[p].layers, dtype.itemsize, p)), "page_cache": disk[p],
                  "peak_gpu_bytes": engines[p].tiers.peak["gpu"], "peak_cpu_bytes": engines[p].tiers.peak["cpu"],
                  "projected_gpu_bytes": engines[p].projected["gpu"], "runs": runs[p],
                  **{k: med(x[k] for x in runs[p]) for k in runs[p][0]}} for c, cw, p in rows]
    ratios = {}
    for c in dict.fromkeys(m["comparison"] for m in modes):
        u, z = (next(m for m in modes if m["comparison"] == c and m["compressed"] == cw) for cw in MODES)
        ratios[c] = {"decode": z["decode_tok_s"] / u["decode_tok_s"], "total": z["total_tok_s"] / u["total_tok_s"]}
    modes_seen = {m["page_cache"] for m in modes} - {None}
    return {"model": spec.name, "batch": args.batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "runs": args.runs, "gpu_mem_bytes": cap, "cpu_mem_bytes": caps["cpu"], "cpu_mem_given": args.cpu_mem is not None,
            "w_gpu_percent": args.w_gpu, "page_cache": sorted(modes_seen), "modes": modes, "ratios": ratios}


# -- B ------------------------------------------------------------------------------------------
def largest_batches(spec, dtype_bytes, prompt_len, gen_len, cap, device, limit=16384, as_if_ram=False) -> dict:
    """compressed -> (largest admitted gpu_batch_size, projected bytes per added sequence, of which cache).
    as_if_ram: as on a machine whose free memory is the cap (plus the process reserve), not this one's."""
    caps, out = capacities(device, None, gpu_mem=cap), {}
    if as_if_ram:
        caps["ram"] = cap + growth_bytes(caps)
    for cc in MODES:
        weights = WeightNeeds(spec, dtype_bytes, device)
        make = lambda b: Policy(gpu_batch_size=b, compress_cache=cc)  # noqa: E731
        b = largest(lambda b: fits(spec, make(b), dtype_bytes, prompt_len, gen_len, caps, device,
                                   weights=weights.of(make(b))), limit)
        per_seq = (run_need(spec, make(max(b, 1) + 1), dtype_bytes, prompt_len, gen_len, device)["gpu"]
                   - run_need(spec, make(max(b, 1)), dtype_bytes, prompt_len, gen_len, device)["gpu"])
        out[cc] = (b, per_seq, cache_bytes(spec, make(1), 1, prompt_len, gen_len, dtype_bytes))
    return out


def part_b(args, device, dtype) -> dict:
    spec, _ = resolve_model(args.cache_model)
    cap = parse_size(args.cache_cap_mem, "--cache-cap-mem")
    other = torch.float32 if dtype.itemsize == 2 else torch.float16 if device.type == "cuda" else torch.bfloat16
    rows = []
    for prompt_len, gen_len, layout in ((args.cache_prompt_len, args.cache_gen_len, "main"),
                                        (args.run_prompt_len, args.run_gen_len, "run")):
        for dt in (dtype, other):
            found = largest_batches(spec, dt.itemsize, prompt_len, gen_len, cap, device)
            rows.append({"layout": layout, "prompt_len": prompt_len, "gen_len": gen_len, "dtype": dtype_name(dt),
                         "run": layout == "run" and dt == dtype, **{MODES[cc]: {
                             "batch": b, "need_per_seq_bytes": per, "cache_per_seq_bytes": c}
                             for cc, (b, per, c) in found.items()}})
    runs, run_row = [], next(r for r in rows if r["run"])
    for cc in MODES:
        if (b := run_row[MODES[cc]]["batch"]) == 0:
            raise UsageError("--cache-cap-mem", f"the {MODES[cc]} cache admits no batch under {args.cache_cap_mem}")
        p = Policy(gpu_batch_size=b, compress_cache=cc)
        with Engine.from_pretrained(args.cache_model, policy=p, device=device, dtype=dtype, dummy=True, gpu_mem=cap,
                                    prompt_len=args.run_prompt_len, gen_len=args.run_gen_len) as e:
            ids, _ = synthetic_prompts(b, args.run_prompt_len, spec.vocab_size, seed=0)
            start = time.perf_counter()
            e.generate(ids, max_new_tokens=args.run_gen_len, eos_token_id=None)
            runs.append({"cache": MODES[cc], "batch": b, "wall_s": time.perf_counter() - start,
                         "prefill_s": e.last_stats.prefill_seconds, "decode_s": e.last_stats.decode_seconds,
                         "peak_gpu_bytes": e.tiers.peak["gpu"], "projected_gpu_bytes": e.projected["gpu"],
                         "peak_cpu_bytes": e.tiers.peak["cpu"], "peak_disk_bytes": e.tiers.peak["disk"]})
        print(f"B run {runs[-1]}", flush=True)
    trend = [{"cap": text, **{dtype_name(dt): {MODES[cc]: v[0] for cc, v in largest_batches(
        spec, dt.itemsize, args.cache_prompt_len, args.cache_gen_len, parse_size(text, "--trend-caps"), device).items()}
        for dt in (dtype, other)}} for text in args.trend_caps]
    deeper = []  # the per-sequence costs besides the cache weigh less in deeper, wider models
    for item in args.deeper:
        name, _, cap_text = item.partition(":")
        other_spec = resolve_model(name)[0]
        deeper.append({"model": name, "cap": cap_text, **{dtype_name(dt): {MODES[cc]: v[0] for cc, v in largest_batches(
            other_spec, dt.itemsize, args.cache_prompt_len, args.cache_gen_len, parse_size(cap_text, "--deeper"),
            device, as_if_ram=True).items()} for dt in (dtype, other)}})
    return {"model": spec.name, "cap_bytes": cap, "cap": args.cache_cap_mem, "rows": rows, "runs": runs, "trend": trend,
            "deeper": deeper}


# -- report -------------------------------------------------------------------------------------
def markdown(r) -> str:
    lines = [f"# 4-bit compression on {r['device']} ({r['dtype']})", "",
             f"Machine: {r['machine']['cpu']}, {r['machine']['logical_cores']} cores, torch {r['machine']['torch']}"
             + (f", GPUs {[g['name'] for g in r['machine']['gpus']]}" if r["machine"]["gpus"] else "")
             + f". Command: `{r['command']}` ({r['elapsed_s'] / 60:.1f} min in all). Dummy weights.", ""]
    if r.get("a"):
        a = r["a"]
        mode = ", ".join("O_DIRECT reads" if x == DIRECT else x for x in a["page_cache"]) or "no disk"
        cpu = (f"cpu_mem {a['cpu_mem_bytes'] / GB:.2f} GB" if a["cpu_mem_given"] or r["device"] != "cpu" else
               f"cpu_mem {a['cpu_mem_bytes'] / GB:.2f} GB, what loading holds beyond the run: the CPU computes, so its "
               "\"gpu\" and \"cpu\" tiers are the same RAM and the gpu cap bounds the run (uncapped, both modes would "
               "hold every weight in RAM and nothing would be I/O-bound)")
        lines += ["## A. Decode with 4-bit weights where decode is I/O-bound", "",
                  f"{a['model']}, batch {a['batch']}, {a['prompt_len']}+{a['gen_len']}, caps enforced by the engine for "
                  f"every run: gpu_mem {a['gpu_mem_bytes'] / GB:.2f} GB, {cpu}. Disk reads: {mode}. Cache and activations "
                  f"on the compute tier. Medians of {a['runs']} runs, interleaved (order rotated each round), after one "
                  "warm-up each. Decode throughput = batch x (gen_len - 1) / decode time (flexh2o/report.py). Dequant "
                  "share = seconds the I/O threads spent dequantizing during the decode steps (thread time, summed over "
                  "threads) / decode wall time"
                  + ("; on CUDA only the queueing of the kernels is timed." if r["device"] != "cpu" else ".")
                  + (" Weights in CPU memory are I/O-bound only on CUDA (a CPU compute device uses them in place), "
                     "so that placement is measured only there: not here." if r["device"] == "cpu" else
                     " The weights-in-CPU-memory placement (I/O-bound over PCIe) is measured too."), "",
                  "| comparison | weights | placement | weights stored | prefill s | decode s | decode tok/s | total tok/s "
                  "| dequant share | disk read / run | tracked peak gpu / cpu, projected gpu |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in a["modes"]:
            lines.append(f"| {x['comparison']} | {MODES[x['compressed']]} | `{x['placement']}` | "
                         f"{x['weights_bytes'] / GB:.3f} GB | {x['prefill_s']:.2f} | {x['decode_s']:.2f} | "
                         f"{x['decode_tok_s']:.2f} | {x['total_tok_s']:.2f} | "
                         + (f"{x['dequant_share']:.1%}" if x["compressed"] else "-")
                         + f" | {x['disk_read_bytes'] / GB:.3f} GB | {x['peak_gpu_bytes'] / GB:.3f} / "
                         f"{x['peak_cpu_bytes'] / GB:.3f}, {x['projected_gpu_bytes'] / GB:.3f} GB |")
        lines.append("")
        for c, v in a["ratios"].items():
            share = next(x["dequant_share"] for x in a["modes"] if x["comparison"] == c and x["compressed"])
            lines.append(f"- {c}: compressed / uncompressed decode throughput **{v['decode']:.2f}x** "
                         f"(target >= 2.5x; total throughput {v['total']:.2f}x); dequantization {share:.1%} of the "
                         "compressed decode time (I/O-thread time over wall time).")
        lines += [f"\n**WARNING: {x['comparison']}, {MODES[x['compressed']]}: tracked gpu peak {x['peak_gpu_bytes']} "
                  f"bytes, above the engine's projection {x['projected_gpu_bytes']:.0f} (cap {a['gpu_mem_bytes']}).**"
                  for x in a["modes"] if x["peak_gpu_bytes"] > min(x["projected_gpu_bytes"], a["gpu_mem_bytes"])]
        lines += ["", "**WARNING: the offload dir is in memory (tmpfs): no disk was measured.**"] * (MEMORY in a["page_cache"])
        lines += ["", "The best placements come from placement.fitted_placement under the same caps dict for both "
                  "modes, starting from everything on the compute tier; where the compressed weights fit whole in "
                  "memory and the uncompressed ones do not, that row is the comparison a user sees.", ""]
    if r.get("b"):
        b = r["b"]
        lines += ["## B. Largest batch under one memory cap, the KV cache compressed", "",
                  f"{b['model']}, full KV cache, weights, cache and activations 100% on the compute tier, cap "
                  f"{b['cap']} for both modes: caps = capacities(device, None, gpu_mem=cap), the batch the largest "
                  "gpu_batch_size that placement.fits (the engine's own pre-flight) admits. Need per added sequence: "
                  "the pre-flight's growth from that batch to one more (cache as stored, and, the same in both modes, the "
                  "prompt's working set, hidden state and mask; a compressed cache on the compute device is attended "
                  "in place, a block at a time, with no dequantized copy).", "",
                  "| dtype | prompt+gen | batch uncompressed / compressed | ratio | need per added sequence (of which "
                  "cache) uncompressed / compressed | status |", "|---|---|---|---|---|---|"]
        for x in b["rows"]:
            u, z = x["uncompressed"], x["compressed"]
            ratio = f"**{z['batch'] / u['batch']:.2f}x**" if u["batch"] else "-"
            status = "run below" if x["run"] else ("pre-flight" if x["dtype"] == r["dtype"] else "projected, not run")
            lines.append(f"| {x['dtype']} | {x['prompt_len']}+{x['gen_len']} | {u['batch']} / {z['batch']} | {ratio} | "
                         + " / ".join(f"{y['need_per_seq_bytes'] / 2**20:.1f} MB ({y['cache_per_seq_bytes'] / 2**20:.1f})"
                                      for y in (u, z)) + f" | {status} |")
        lines += ["", "Target: compressed / uncompressed batch >= 3x. Rows \"projected, not run\" are pre-flight "
                  "arithmetic only" + (" (bfloat16 matrix products on this CPU, without bf16 instructions, run ~300x "
                                       "slower than float32)." if r["dtype"] == "float32" and r["device"] == "cpu" else "."),
                  "", f"Runs of the run layout's {r['dtype']} batches (a short layout, so that each run takes under a "
                  f"minute), through Engine.from_pretrained(gpu_mem={b['cap']}, prompt_len=, gen_len=), one generate each:",
                  "", "| cache | batch | prefill s | decode s | tracked peak gpu (cpu, disk) | projected gpu | cap | "
                  "tracked peak within the cap |", "|---|---|---|---|---|---|---|---|"]
        for x in b["runs"]:
            lines.append(f"| {x['cache']} | {x['batch']} | {x['prefill_s']:.1f} | {x['decode_s']:.1f} | "
                         f"{x['peak_gpu_bytes'] / GB:.3f} GB ({x['peak_cpu_bytes'] / GB:.3f}, {x['peak_disk_bytes'] / GB:.3f}) | "
                         f"{x['projected_gpu_bytes'] / GB:.3f} GB | "
                         f"{b['cap_bytes'] / GB:.3f} GB | {'yes' if x['peak_gpu_bytes'] <= b['cap_bytes'] else '**no**'} |")
        lines += ["", "The tracked peak counts what flexh2o allocates (weights, cache, pooled buffers), not torch's "
                  "temporaries inside a forward pass (the prompt's working set, quantize's float32 copies), which the "
                  "projection, the figure the engine holds to the cap, includes: hence the gap between the two."]
        main = b["rows"][0]
        dts = [x["dtype"] for x in b["rows"][:2]]
        lines += ["", f"Other caps, {main['prompt_len']}+{main['gen_len']} (pre-flight only, not run):", "",
                  "| cap | " + " | ".join(f"{d} uncompressed / compressed (ratio)" for d in dts) + " |", "|---|---|---|"]
        for t in b["trend"]:
            lines.append(f"| {t['cap']} | " + " | ".join(
                f"{t[d]['uncompressed']} / {t[d]['compressed']} ("
                + (f"{t[d]['compressed'] / t[d]['uncompressed']:.2f}x)" if t[d]["uncompressed"] else "-)")
                for d in dts) + " |")
        if b.get("deeper"):
            lines += ["", f"Deeper and wider models, {main['prompt_len']}+{main['gen_len']}, full cache, everything on the "
                      "compute tier (pre-flight only, not run, as on a machine whose free memory is the cap; the costs per "
                      "sequence besides the cache, the prompt's working set and hidden states, weigh less there):", "",
                      "| model | cap | " + " | ".join(f"{d} uncompressed / compressed (ratio)" for d in dts) + " |",
                      "|---|---|---|---|"]
            for t in b["deeper"]:
                lines.append(f"| {t['model']} | {t['cap']} | " + " | ".join(
                    f"{t[d]['uncompressed']} / {t[d]['compressed']} ("
                    + (f"{t[d]['compressed'] / t[d]['uncompressed']:.2f}x)" if t[d]["uncompressed"] else
                       "-: the weights alone do not fit)") for d in dts) + " |")
        lines += ["", "What would make B unfair, and why it does not apply:",
                  "- Letting the uncompressed cache spill off the capped tier (cache_gpu_percent < 100: to CPU memory, "
                  "which is the same RAM here, or to disk): both modes keep weights and cache 100% on the capped tier.",
                  "- A different cap, dtype or KV policy per mode, or compressed weights freeing room for one mode: "
                  "both use the same caps dict, dtype and full cache, and compress_weight is off in both.",
                  "- A batch the engine would refuse: the runs go through Engine.from_pretrained with the cap, whose own "
                  "pre-flight admits them, and their tracked peaks are shown against the cap.", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", choices=["A", "B"], default=["A", "B"])
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the device's own")
    ap.add_argument("--model", default="opt-350m", help="A: the model")
    ap.add_argument("--gpu-mem", default="0.6GB", help="A: cap of the compute tier")
    ap.add_argument("--cpu-mem", default=None, help="A: cap of the CPU-memory tier (default: 0.1GB on a CPU device, else detected)")
    ap.add_argument("--w-gpu", type=float, default=0, help="A: percent of the weights on the compute tier in the same placement")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offload-dir", default="/tmp/flexh2o_bench_compression")
    ap.add_argument("--cache-model", default="opt-125m", help="B: the model")
    ap.add_argument("--cache-cap-mem", default="1.5GB", help="B: cap of the compute tier")
    ap.add_argument("--cache-prompt-len", type=int, default=512)
    ap.add_argument("--cache-gen-len", type=int, default=32)
    ap.add_argument("--run-prompt-len", type=int, default=64, help="B: prompt of the runs")
    ap.add_argument("--run-gen-len", type=int, default=2, help="B: tokens generated in the runs")
    ap.add_argument("--trend-caps", nargs="*", default=["1GB", "2GB", "4GB", "8GB"])
    ap.add_argument("--deeper", nargs="*", default=["opt-1.3b:12GB", "opt-6.7b:16GB", "opt-30b:80GB"],
                    metavar="MODEL:CAP", help="B: other models and caps, pre-flight only")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "compression"))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite OUT.md from an existing OUT.json")
    args = ap.parse_args()
    if args.markdown_only:
        rewrite_markdown(args.out, markdown)
        return
    started = time.perf_counter()
    torch.set_grad_enabled(False)
    try:
        device = parse_device(args.device)
        dtype = parse_dtype(args.dtype) if args.dtype else default_dtype(device)
        a = part_a(args, device, dtype) if "A" in args.parts else None
        b = part_b(args, device, dtype) if "B" in args.parts else None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    result = {"command": "python " + " ".join(sys.argv), "device": str(device), "dtype": dtype_name(dtype),
              "a": a, "b": b, "machine": describe_machine(), "elapsed_s": time.perf_counter() - started}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
