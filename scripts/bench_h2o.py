"""H2O against the full KV cache under the same memory caps, each at its best placement and largest batch.

    python scripts/bench_h2o.py                       # OPT-1.3B dummy weights, bf16, 512+512, caps 3 GB + 1 GB
    python scripts/bench_h2o.py --gen-lens 512 1024   # also 512+1024

Caps: --gpu-mem stands for the accelerator's memory (a T4's 16 GB in the H2O paper) and --cpu-mem
for the host memory a run may use besides it. Both KV policies get both caps, and the engine
enforces them: Engine.from_pretrained(gpu_mem=, cpu_mem=, prompt_len=, gen_len=) refuses a policy
whose projected need exceeds a cap (and, as the CPU computes here, gpu + cpu above the free RAM
less the engine's reserve). The H2O paper's baseline is FlexGen, which moves the cache to CPU
memory when it does not fit the accelerator; so for each policy and length the same search runs:
over the cache on the capped tier or in CPU memory, 1 to --max-gpu-batches gpu-batches (the
waiting gpu-batches' hidden states on either tier) and the weights split between the two tiers in
5% steps (never on disk: they fit in memory), the largest gpu_batch_size the engine's pre-flight
(flexh2o.planning.placement.fits) admits. Per policy the configuration with the largest batch runs (ties:
the cache on the capped tier, weights on it first, fewer gpu-batches); with the CPU as the compute
device both tiers are the same RAM, so placements differ in what they admit, hardly in speed, and
the batch is what amortizes each step's pass over the weights.

Rows, on this machine's CPU as the compute device: for each length, the full cache and H2O at
their largest batches (total throughput = tokens generated / (prefill + decode) time, as FlexGen
and the H2O paper count), and at the first length H2O at the full cache's batch and placement (the
decode step at equal batch, and the share of H2O's decode time spent scoring and evicting: time
inside the policy's decode hook). The markdown also lists, from the pre-flight alone, the largest
batch of each policy for each cache placement and for a range of --cpu-mem values (not run).

Duration: about 15 minutes for the default (3 runs) where bfloat16 matrix products are fast (the
AVX-512/AMX machine behind the README's figures: about 130 prompt tok/s and 0.27 s per decode
step at small batches for OPT-1.3B); 512+1024 adds about 20. On a CPU without bfloat16
instructions (AVX2 only, about 6 GFLOP/s) OPT-1.3B takes hours; check there with e.g.
`--model opt-125m --gpu-mem 0.35GB --cpu-mem 0.1GB --prompt-len 64 --gen-lens 32`.
Writes results/h2o.{json,md}.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.kv.eviction import Evicting  # noqa: E402
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.engine.preflight import capacities, parse_size  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.planning.placement import WeightNeeds, describe, fits, largest  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402

GB = 1 << 30
CACHE = {"gpu": (100, 0), "cpu": (0, 100)}  # cache on the capped tier / in CPU memory
DTYPE = cpu_compute_dtype()  # bfloat16 where the CPU multiplies it natively, else float32
TREND_CPU_MEMS = ["0.5GB", "1GB", "1.5GB", "3GB", "6GB", "12GB"]


class PolicyTimer:
    """Adds up the time spent inside every evicting policy's decode hook (scoring, choosing the
    victim, writing the new token into its slot)."""

    def __init__(self):
        self.seconds = 0.0
        self.original = Evicting.decode

    def __enter__(self):
        timer = self

        def timed(policy, *args):
            start = time.perf_counter()
            timer.original(policy, *args)
            timer.seconds += time.perf_counter() - start
        Evicting.decode = timed
        return self

    def __exit__(self, *exc):
        Evicting.decode = self.original


def search(spec, caps, prompt_len, gen_len, hh_ratio, max_gpu_batches, weights: WeightNeeds, limit=4096) -> dict:
    """Per cache placement ("gpu": the capped tier, "cpu"), the admitted policy with the largest batch, or None."""
    device, dtype_bytes, best = torch.device("cpu"), DTYPE.itemsize, {}
    for place, (cache_gpu, cache_cpu) in CACHE.items():
        best[place] = None
        for w_gpu in range(100, -1, -5):
            for nb in range(1, max_gpu_batches + 1):
                for act_gpu in ((100, 0) if nb > 1 else (100,)):
                    def make(b):
                        return Policy(gpu_batch_size=b, num_gpu_batches=nb, w_gpu_percent=w_gpu,
                                      w_cpu_percent=100 - w_gpu, cache_gpu_percent=cache_gpu,
                                      cache_cpu_percent=cache_cpu, act_gpu_percent=act_gpu,
                                      act_cpu_percent=100 - act_gpu, hh_ratio=hh_ratio)
                    b = largest(lambda b: fits(spec, make(b), dtype_bytes, prompt_len, gen_len, caps, device,
                                               weights=weights.of(make(b))), limit // nb)
                    if b and (best[place] is None or b * nb > best[place].batch_size):
                        best[place] = make(b)
    return best


def pick(found: dict):
    """The placement with the largest batch; a tie goes to the cache on the capped tier."""
    admitted = [p for p in (found["gpu"], found["cpu"]) if p is not None]
    return max(admitted, key=lambda p: p.batch_size) if admitted else None


def run(model, policy, prompt_len, gen_len, caps):
    with Engine.from_pretrained(model, policy=policy, device="cpu", dtype=DTYPE, dummy=True, gpu_mem=caps["gpu"],
                                cpu_mem=caps["cpu"], prompt_len=prompt_len, gen_len=gen_len) as engine:
        ids, _ = synthetic_prompts(policy.batch_size, prompt_len, engine.spec.vocab_size, seed=0)
        with PolicyTimer() as timer:
            engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        s = engine.last_stats
        total = s.prefill_seconds + s.decode_seconds
        return {"kv": policy.kv_policy if policy.hh_ratio is None else f"{policy.kv_policy}-{policy.hh_ratio:g}",
                "batch": policy.batch_size, "gpu_batch_size": policy.gpu_batch_size,
                "num_gpu_batches": policy.num_gpu_batches, "placement": describe(policy),
                "cache_tier": "gpu" if policy.cache_gpu_percent == 100 else "cpu",
                "prompt_len": prompt_len, "gen_len": gen_len, "prefill_s": s.prefill_seconds,
                "decode_s": s.decode_seconds, "decode_step_s": s.decode_seconds / (s.steps_done - 1),
                "policy_decode_s": timer.seconds, "total_s": total, "total_tok_s": policy.batch_size * gen_len / total,
                "peak_gpu_tier_bytes": engine.tiers.peak["gpu"], "peak_cpu_tier_bytes": engine.tiers.peak["cpu"]}


def summary(p) -> dict | None:
    return None if p is None else {"batch": p.batch_size, "gpu_batch_size": p.gpu_batch_size,
                                   "num_gpu_batches": p.num_gpu_batches, "placement": describe(p)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--gpu-mem", default="3GB", help="cap of the compute tier (standing for the accelerator)")
    ap.add_argument("--cpu-mem", default="1GB", help="cap of the CPU-memory tier (host memory for the run)")
    ap.add_argument("--max-gpu-batches", type=int, default=2, help="num_gpu_batches searched: 1..this")
    ap.add_argument("--hh-ratio", type=float, default=0.2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-lens", type=int, nargs="+", default=[512])
    ap.add_argument("--trend-cpu-mems", nargs="*", default=TREND_CPU_MEMS,
                    help="--cpu-mem values for the pre-flight-only table of largest batches")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "h2o"))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite OUT.md from an existing OUT.json")
    args = ap.parse_args()
    if args.markdown_only:
        with open(args.out + ".json") as f:
            write_text_atomic(args.out + ".md", markdown(json.load(f)))
        return
    started = time.perf_counter()
    spec = PRESETS[args.model]
    gpu_mem, cpu_mem = parse_size(args.gpu_mem, "--gpu-mem"), parse_size(args.cpu_mem, "--cpu-mem")
    caps = capacities(torch.device("cpu"), None, gpu_mem, cpu_mem)  # what the engine will check against
    torch.set_grad_enabled(False)
    policies = {"full": None, f"h2o-{args.hh_ratio:g}": args.hh_ratio}
    weights = WeightNeeds(spec, DTYPE.itemsize, torch.device("cpu"))  # the same for every search

    runs, searches, pairs, equal = [], [], [], None
    for n, gen_len in enumerate(args.gen_lens):
        chosen = {}
        for kv, hh in policies.items():
            found = search(spec, caps, args.prompt_len, gen_len, hh, args.max_gpu_batches, weights)
            chosen[kv] = pick(found)
            searches.append({"kv": kv, "gen_len": gen_len, **{f"cache_{t}": summary(p) for t, p in found.items()}})
            if chosen[kv] is None:
                raise SystemExit(f"error: --gpu-mem/--cpu-mem: {kv} fits no batch for {args.prompt_len}+{gen_len}")
        row = {}
        for kv in policies:
            row[kv] = run(args.model, chosen[kv], args.prompt_len, gen_len, caps) | {"row": "largest admitted"}
            print(row[kv], flush=True)
            runs.append(row[kv])
        full, h2o = row.values()
        pairs.append((full, h2o))
        if n == 0:  # H2O at the full cache's batch and placement: the decode step at equal batch
            same = dataclasses.replace(chosen["full"], kv_policy="h2o", hh_ratio=args.hh_ratio)
            equal = {"full": full, "h2o": run(args.model, same, args.prompt_len, gen_len, caps) | {"row": "equal batch"}}
            print(equal["h2o"], flush=True)
            runs.append(equal["h2o"])

    trend = []
    for text in args.trend_cpu_mems:
        c = capacities(torch.device("cpu"), None, gpu_mem, parse_size(text, "--trend-cpu-mems"))
        for gen_len in args.gen_lens:
            trend.append({"cpu_mem": text, "gen_len": gen_len, **{
                kv: summary(pick(search(spec, c, args.prompt_len, gen_len, hh, args.max_gpu_batches, weights)))
                for kv, hh in policies.items()}})

    eh = equal["h2o"]
    result = {"command": "python " + " ".join(sys.argv), "model": args.model,
              "dtype": str(DTYPE).removeprefix("torch."), "hh_ratio": args.hh_ratio,
              "prompt_len": args.prompt_len,
              "gpu_mem_bytes": gpu_mem, "cpu_mem_bytes": cpu_mem, "free_ram_bytes": caps["ram"],
              "max_gpu_batches": args.max_gpu_batches, "runs": runs, "searches": searches, "trend": trend,
              "throughput_ratios": {f"{f['prompt_len']}+{f['gen_len']}": h["total_tok_s"] / f["total_tok_s"]
                                    for f, h in pairs},
              "equal_batch": {"batch": eh["batch"], "gen_len": eh["gen_len"], "full_step_s": equal["full"]["decode_step_s"],
                              "h2o_step_s": eh["decode_step_s"], "h2o_policy_share": eh["policy_decode_s"] / eh["decode_s"]},
              "machine": describe_machine(), "elapsed_s": time.perf_counter() - started}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result))
    print(markdown(result))


def markdown(r) -> str:
    m, eq, gpu, cpu = r["machine"], r["equal_batch"], r["gpu_mem_bytes"] / GB, r["cpu_mem_bytes"] / GB
    prompt = r["prompt_len"]
    hh = f"h2o-{r['hh_ratio']:g}"
    lines = [f"# H2O-{r['hh_ratio']:g} vs full KV cache: {r['model']} dummy weights, {r['dtype']}, caps gpu {gpu:.2f} GB "
             f"+ cpu {cpu:.2f} GB for both", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}; the CPU is the compute device, so "
             f"the capped \"gpu\" tier (standing for the accelerator) and the CPU-memory tier are the same RAM "
             f"({r['free_ram_bytes'] / GB:.1f} GB free at the start). Command: `{r['command']}` "
             f"({r['elapsed_s'] / 60:.0f} min in all). One run per row.", "",
             f"Both KV policies ran under the same two caps, gpu_mem {gpu:.2f} GB and cpu_mem {cpu:.2f} GB, enforced by "
             "the engine (its pre-flight refuses a policy that exceeds either). For each, the same search over the cache's "
             f"tier (capped tier or CPU memory), 1 to {r['max_gpu_batches']} gpu-batches and the weights' split between "
             "the tiers picked the largest batch the pre-flight admits; the tracked peaks below stay under the caps.", "",
             "| kv cache | prompt+gen | batch | placement | prefill s | decode s | decode step s | scoring+eviction share "
             "| total tok/s | tracked peak GB gpu / cpu |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        share = f"{x['policy_decode_s'] / x['decode_s']:.1%}" if x["kv"] != "full" else "-"
        lines.append(f"| {x['kv']} | {x['prompt_len']}+{x['gen_len']} | {x['batch']} ({x['gpu_batch_size']} x "
                     f"{x['num_gpu_batches']}, {x['row']}) | `{x['placement']}` | {x['prefill_s']:.1f} | {x['decode_s']:.1f} | "
                     f"{x['decode_step_s']:.3f} | {share} | {x['total_tok_s']:.2f} | "
                     f"{x['peak_gpu_tier_bytes'] / GB:.2f} / {x['peak_cpu_tier_bytes'] / GB:.2f} |")
    lines += ["", "Largest admitted batch each, H2O / full total throughput: "
              + ", ".join(f"{k}: **{v:.2f}x**" for k, v in r["throughput_ratios"].items()) + " (target >= 2.5x).",
              f"Equal batch {eq['batch']} (the full cache's, same placement), {prompt}+{eq['gen_len']}: decode step H2O "
              f"{eq['h2o_step_s']:.3f} s vs full {eq['full_step_s']:.3f} s ({eq['h2o_step_s'] / eq['full_step_s']:.2f}x, "
              f"target <= 1); scoring and eviction take {eq['h2o_policy_share']:.1%} of H2O's decode time (target < 10%).",
              "", "## The search (pre-flight only)", "",
              "Largest admitted batch per cache placement under the caps above; the larger of each pair ran. "
              "\"capped tier\" is the cap-only setting (the cache held to the accelerator's memory), shown for "
              "comparison, not run.", "",
              "| kv cache | prompt+gen | cache on the capped tier | cache in CPU memory |", "|---|---|---|---|"]
    for s in r["searches"]:
        cell = [("does not fit" if p is None else f"{p['batch']} ({p['gpu_batch_size']} x {p['num_gpu_batches']}), "
                 f"`{p['placement']}`") for p in (s["cache_gpu"], s["cache_cpu"])]
        lines.append(f"| {s['kv']} | {prompt}+{s['gen_len']} | {cell[0]} | {cell[1]} |")
    lines += ["", f"How the largest batches move with the CPU-memory cap (gpu_mem {gpu:.2f} GB; pre-flight only, not run):",
              "", "| cpu_mem | prompt+gen | full | " + hh + " | batch ratio |", "|---|---|---|---|---|"]
    for t in r["trend"]:
        f, h = t["full"], t[hh]
        ratio = f"{h['batch'] / f['batch']:.1f}x" if f and h else "-"
        lines.append(f"| {t['cpu_mem']} | {prompt}+{t['gen_len']} | {f['batch'] if f else '-'} | {h['batch'] if h else '-'} "
                     f"| {ratio} |")
    lines += ["", "## What would make this unfair, and why it does not apply", "",
              "- The full cache held to the accelerator's cap while H2O's fits there: both may put the cache in CPU "
              "memory, and each runs at the placement where the pre-flight admits its largest batch (table above).",
              "- Different or script-computed budgets: both get the same gpu_mem and cpu_mem, passed to "
              "Engine.from_pretrained, which refuses what its projection does not fit; the tracked peaks show "
              "what each run held on each tier.",
              "- A CPU-memory cache that is slow for the baseline: here the CPU computes, so a cache in CPU memory is "
              "attended in place at no transfer cost; on a GPU it would cross PCIe every step. The full cache's best "
              "placement is thus cheaper here than in the H2O paper's setting, not dearer.",
              f"- The ratio depends on cpu_mem: the full cache's batch grows with it, while H2O's soon stops at what "
              f"{r['max_gpu_batches']} gpu-batches' working sets admit on the capped tier (table above); with enough "
              "host memory both reach the same batch and only the per-step difference remains (the equal-batch line). "
              "The default cpu_mem keeps the run short; the table gives the batches other caps admit.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
