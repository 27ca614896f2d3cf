"""FlexGen's multi-GPU scaling, projected: OPT-30B and OPT-175B on 1 to 4 T4 machines as pipeline stages.

    python scripts/project_pipeline.py        # a few minutes: one plan per model and stage count

Each stage is a machine like configs/hardware/t4.json (a T4 16 GB, 208 GB DRAM, 1.5 TB SSD), the
link between stages its link_bandwidth (an assumption the profile states). For every stage count
the planner (planning/pipeline_plan.py) picks the batch and each stage's placement with the best
projected throughput, 512 + 32 tokens (FlexGen's setting), full cache, nothing compressed; one
stage is the single-GPU plan. Writes results/pipeline_t4.{json,md}. These are projections of the
cost model, not measurements (no multi-GPU machine here).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flexh2o.models import resolve_model  # noqa: E402
from flexh2o.host.hardware import load_profile  # noqa: E402
from flexh2o.planning.pipeline_plan import plan_pipeline  # noqa: E402
from flexh2o.planning.planner import run_flags  # noqa: E402
from flexh2o.planning.search import caps_of  # noqa: E402
from flexh2o.engine.policy import Policy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["opt-30b", "opt-175b"])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--out", default="results/pipeline_t4")
    args = p.parse_args()
    t4 = load_profile("t4")
    caps = caps_of(t4)
    rows = []
    for model in args.models:
        spec, _ = resolve_model(model)
        for stages in args.stages:
            start = time.perf_counter()
            plan = plan_pipeline(spec, args.prompt_len, args.gen_len, t4, caps, Policy(), stages, t4.link_bandwidth)
            row = {"model": model, "stages": stages, "seconds_to_plan": time.perf_counter() - start}
            if plan is not None:
                row.update(batch=plan.batch, micro_batches=plan.micro_batches, throughput=plan.throughput,
                           bubble_share=plan.bubble_share, link_seconds=plan.link_seconds,
                           stage_flags=[" ".join(run_flags(s.policy)[:5]) for s in plan.stages],
                           stage_layers=[[s.layers.start, s.layers.stop] for s in plan.stages])
            rows.append(row)
            print(model, stages, round(row.get("throughput", 0.0), 3), row.get("batch"), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "hardware_source": t4.source, "rows": rows}, f, indent=1)
    lines = ["# Pipeline stages on T4 machines: projected scaling (FlexGen's multi-GPU setting)", "",
             f"`python scripts/project_pipeline.py`: {args.prompt_len} + {args.gen_len} tokens, full cache, nothing "
             f"compressed; each stage a machine like configs/hardware/t4.json, linked at "
             f"{t4.link_bandwidth / 1e9:.2f} GB/s (assumed: a 10 Gb/s network). Projections of the cost model "
             "(planning/pipeline_plan.py), not measurements.", "",
             "| model | T4 stages | batch (micro-batches) | projected tok/s | per T4 | vs 1 T4 | busiest stage idle | "
             "each stage's placement |", "|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        base = next((r["throughput"] for r in rows if r["model"] == model and r["stages"] == 1 and "throughput" in r),
                    None)
        for r in (r for r in rows if r["model"] == model):
            if "throughput" not in r:
                lines.append(f"| {model} | {r['stages']} | no fit | | | | | |")
                continue
            ratio = f"{r['throughput'] / base:.2f}x" if base else ""
            placements = "; ".join(f"{flags.split('--weights ')[1].split(' --')[0]}" for flags in r["stage_flags"])
            lines.append(f"| {model} | {r['stages']} | {r['batch']} ({r['micro_batches']}) | {r['throughput']:.2f} | "
                         f"{r['throughput'] / r['stages']:.2f} | {ratio} | {r['bubble_share']:.0%} | "
                         f"weights {placements} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
