"""H2O against the full KV cache: decode step at equal batch, and throughput at a fixed memory cap.

    python scripts/bench_h2o.py              # OPT-1.3B dummy weights, bf16, cap 3 GB (about 20 minutes)

The cap stands for the accelerator's memory (a T4's 16 GB in the H2O paper) and holds the weights,
the KV cache and the working set; the engine's own pre-flight projection picks the largest batch
that fits it, for each KV policy and length. Runs, on this machine's CPU as the compute device:
- 512+512 and 512+1024: full cache at its largest batch, H2O-20% at its largest batch; total
  throughput (tokens generated / (prefill + decode) time, as FlexGen and the H2O paper count);
- 512+512 at equal batch (--equal-batch, without the cap): full against H2O-20%, to compare the
  mean decode step, and the share of each decode step spent scoring and evicting (time inside the
  policy's decode hook).
Writes results/h2o.{json,md}.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.kv.eviction import Evicting  # noqa: E402
from flexh2o.machine import describe_machine  # noqa: E402
from flexh2o.memory import parse_size  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.placement import fits  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.output import write_json_atomic, write_text_atomic  # noqa: E402

GB = 1 << 30


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


def largest_batch(spec, cap, prompt_len, gen_len, hh_ratio, limit=4096) -> int:
    """The largest gpu_batch_size the engine's pre-flight admits under the cap (all tensors on the capped tier)."""
    device, layers, caps = torch.device("cpu"), spec.build_layers(), {"gpu": cap, "cpu": cap, "disk": 0}
    best = 0
    for b in range(1, limit + 1):
        if not fits(spec, Policy(gpu_batch_size=b, hh_ratio=hh_ratio), 2, prompt_len, gen_len, caps, device, layers):
            break
        best = b
    return best


def run(model, batch, prompt_len, gen_len, hh_ratio, cap):
    policy = Policy(gpu_batch_size=batch, hh_ratio=hh_ratio)
    with Engine.from_pretrained(model, policy=policy, device="cpu", dtype=torch.bfloat16, dummy=True, gpu_mem=cap,
                                prompt_len=prompt_len, gen_len=gen_len) as engine:
        ids, _ = synthetic_prompts(batch, prompt_len, engine.spec.vocab_size, seed=0)
        with PolicyTimer() as timer:
            engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        s = engine.last_stats
        total = s.prefill_seconds + s.decode_seconds
        return {"kv": "full" if hh_ratio is None else f"h2o-{hh_ratio:g}", "batch": batch,
                "prompt_len": prompt_len, "gen_len": gen_len, "prefill_s": s.prefill_seconds,
                "decode_s": s.decode_seconds, "decode_step_s": s.decode_seconds / (s.steps_done - 1),
                "policy_decode_s": timer.seconds, "total_s": total, "total_tok_s": batch * gen_len / total,
                "peak_tracked_bytes": engine.tiers.peak["gpu"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--cap", default="3GB", help="memory cap for weights, cache and working set")
    ap.add_argument("--equal-batch", type=int, default=8, help="batch of the equal-batch decode step comparison")
    ap.add_argument("--hh-ratio", type=float, default=0.2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-lens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "h2o"))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite OUT.md from an existing OUT.json")
    args = ap.parse_args()
    if args.markdown_only:
        with open(args.out + ".json") as f:
            write_text_atomic(args.out + ".md", markdown(json.load(f), args))
        return
    spec, cap = PRESETS[args.model], parse_size(args.cap, "--cap")
    torch.set_grad_enabled(False)

    runs, pairs = [], []
    for gen_len in args.gen_lens:
        b_full = largest_batch(spec, cap, args.prompt_len, gen_len, None)
        b_h2o = largest_batch(spec, cap, args.prompt_len, gen_len, args.hh_ratio)
        if b_full < 1:
            raise SystemExit(f"--cap {args.cap} does not fit the full cache at batch 1 for {args.prompt_len}+{gen_len}")
        full = run(args.model, b_full, args.prompt_len, gen_len, None, cap)
        print(full, flush=True)
        h2o = run(args.model, b_h2o, args.prompt_len, gen_len, args.hh_ratio, cap)
        print(h2o, flush=True)
        runs += [full, h2o]
        pairs.append((full, h2o))
    # Equal batch, at the first length (512+512), without the cap (the full cache would not fit it).
    full_eq = run(args.model, args.equal_batch, args.prompt_len, args.gen_lens[0], None, None)
    print(full_eq, flush=True)
    h2o_eq = run(args.model, args.equal_batch, args.prompt_len, args.gen_lens[0], args.hh_ratio, None)
    print(h2o_eq, flush=True)
    runs += [full_eq, h2o_eq]

    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "cap_bytes": cap, "runs": runs,
              "throughput_ratios": {f"{f['prompt_len']}+{f['gen_len']}": h["total_tok_s"] / f["total_tok_s"]
                                    for f, h in pairs},
              "equal_batch": {"batch": full_eq["batch"], "full_step_s": full_eq["decode_step_s"],
                              "h2o_step_s": h2o_eq["decode_step_s"],
                              "h2o_policy_share": h2o_eq["policy_decode_s"] / h2o_eq["decode_s"]},
              "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result, args))
    print(markdown(result, args))


def markdown(r, args) -> str:
    m, eq = r["machine"], r["equal_batch"]
    lines = [f"# H2O-{args.hh_ratio:g} vs full KV cache: {r['model']} dummy weights, bfloat16, cap {args.cap}", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}; the CPU is the compute device "
             f"and the cap holds weights, cache and working set (the engine's pre-flight picks each batch). "
             f"One run per row (each takes minutes). Command: `{r['command']}`.", "",
             "| kv cache | prompt+gen | batch | prefill s | decode s | decode step s | scoring+eviction share "
             "| total tok/s | tracked peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    for i, x in enumerate(r["runs"]):
        share = f"{x['policy_decode_s'] / x['decode_s']:.1%}" if x["kv"] != "full" else "-"
        batch = f"{x['batch']} (equal, no cap)" if i >= len(r["runs"]) - 2 else f"{x['batch']} (largest under the cap)"
        lines.append(f"| {x['kv']} | {x['prompt_len']}+{x['gen_len']} | {batch} | {x['prefill_s']:.1f} | "
                     f"{x['decode_s']:.1f} | {x['decode_step_s']:.3f} | {share} | {x['total_tok_s']:.2f} | "
                     f"{x['peak_tracked_bytes'] / GB:.2f} |")
    lines += ["", "Largest batch that fits, H2O / full total throughput: "
              + ", ".join(f"{k}: **{v:.2f}x**" for k, v in r["throughput_ratios"].items()) + " (target >= 2.5x).",
              f"Equal batch {eq['batch']}, {args.prompt_len}+{args.gen_lens[0]}: decode step H2O {eq['h2o_step_s']:.3f} s "
              f"vs full {eq['full_step_s']:.3f} s ({eq['h2o_step_s'] / eq['full_step_s']:.2f}x, target <= 1); "
              f"scoring and eviction take {eq['h2o_policy_share']:.1%} of H2O's decode time (target < 10%).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
