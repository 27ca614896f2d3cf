"""The cost model against measurements on the machine at hand.

    python scripts/validate_cost_model.py            # about 10 minutes on 2 cores; needs a quiet machine

Runs each policy of CASES (weights and cache in memory, on disk, split; full cache and H2O;
several gpu-batches; compressed weights and cache; overlap off) through the engine with dummy
weights, disk reads bypassing the page cache (as the profile measured the disk), a warm-up first
and the median of --runs; predicts each with the cost model on the local profile (measured first
if none is cached; the disk's speed measured again before each case that reads it); writes
results/cost_model.{json,md} with both side by side. A prediction is
within the target when measured / predicted total throughput lies in 0.75..1.25.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.engine import default_device, default_dtype, parse_device  # noqa: E402
from flexh2o.machine import LoadMeter, describe_machine  # noqa: E402
from flexh2o.models import resolve_model  # noqa: E402
from flexh2o.optimizer.cost_model import predict  # noqa: E402
from flexh2o.optimizer.measure import disk_rates, sizes_for  # noqa: E402
from flexh2o.optimizer.planner import run_flags  # noqa: E402
from flexh2o.output import write_results  # noqa: E402
from flexh2o.profile import ensure_local_profile  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.report import build_report  # noqa: E402

TARGET = 0.25


def placed(w=(100, 0), cache=(100, 0), **kw) -> dict:
    return dict(w_gpu_percent=w[0], w_cpu_percent=w[1], cache_gpu_percent=cache[0], cache_cpu_percent=cache[1], **kw)


# (name, model, prompt_len, gen_len, policy fields)
CASES = [
    ("everything in memory, full cache", "opt-125m", 256, 16, dict(gpu_batch_size=8)),
    ("everything in memory, H2O 10% + 10%", "opt-125m", 256, 16, dict(gpu_batch_size=8, hh_ratio=0.1)),
    ("weights split between tiers in memory", "opt-125m", 256, 16, placed(w=(50, 50), gpu_batch_size=8)),
    ("half the weights on disk", "opt-125m", 256, 16, placed(w=(50, 0), gpu_batch_size=8)),
    ("weights on disk, 2 gpu-batches", "opt-350m", 64, 8, placed(w=(0, 0), gpu_batch_size=4, num_gpu_batches=2)),
    ("weights on disk, overlap off", "opt-350m", 64, 8, placed(w=(0, 0), gpu_batch_size=8, overlap=False)),
    ("compressed weights on disk", "opt-350m", 64, 8, placed(w=(0, 0), gpu_batch_size=8, compress_weight=True)),
    ("cache on disk, full", "opt-125m", 256, 16, placed(cache=(0, 0), gpu_batch_size=8)),
    ("cache on disk, H2O 10% + 10%", "opt-125m", 256, 16, placed(cache=(0, 0), gpu_batch_size=8, hh_ratio=0.1)),
    ("cache half in memory, half on disk, 4 gpu-batches", "opt-125m", 256, 16,
     placed(cache=(0, 50), gpu_batch_size=4, num_gpu_batches=4)),
    ("compressed cache", "opt-125m", 256, 16, dict(gpu_batch_size=8, compress_cache=True)),
]


def measure(model: str, policy: Policy, prompt_len: int, gen_len: int, device, dtype, offload_dir: str, runs: int):
    spec, _ = resolve_model(model)
    ids, mask = synthetic_prompts(policy.batch_size, prompt_len, spec.vocab_size, seed=0)
    reports = []
    with Engine.from_pretrained(model, policy=policy, device=device, dtype=dtype, dummy=True, offload_dir=offload_dir,
                                bypass_page_cache=True, prompt_len=prompt_len, gen_len=gen_len) as engine:
        engine.generate(ids, mask, max_new_tokens=2, eos_token_id=None)  # warm-up
        for _ in range(runs):
            engine.generate(ids, mask, max_new_tokens=gen_len, eos_token_id=None)
            reports.append(build_report(engine, engine.last_stats, policy))
    return {key: statistics.median(r[key] for r in reports)
            for key in ("prefill_throughput", "decode_throughput", "total_throughput")}


def uses_disk(policy) -> bool:
    return any(policy.disk_percent(kind) > 0 for kind in ("w", "cache", "act"))


def run_case(case, args, device, dtype, profile) -> dict:
    name, model, prompt_len, gen_len, fields = case
    policy = Policy(**fields)
    spec, _ = resolve_model(model)
    if uses_disk(policy):
        # This machine's virtual disk drifts (O_DIRECT reads measured 0.84 to 2.2 GB/s within an
        # hour): its speed is measured again right before the runs that read it.
        read, write = disk_rates(args.offload_dir, sizes_for(device, quick=False), lambda line: None)
        profile = dataclasses.replace(profile, disk_read=read, disk_write=write)
    predicted = predict(spec, policy, prompt_len, gen_len, profile, str(dtype).removeprefix("torch."))
    meter = LoadMeter()
    measured = measure(model, policy, prompt_len, gen_len, device, dtype, args.offload_dir, args.runs)
    ratio = measured["total_throughput"] / predicted.total_throughput
    row = {"case": name, "model": model, "disk_read": profile.disk_read if uses_disk(policy) else None, "prompt_len": prompt_len, "gen_len": gen_len, "batch": policy.batch_size,
           "flags": " ".join(run_flags(policy)), "policy": policy.to_dict(), "predicted": predicted.to_dict(),
           "measured": measured, "load": meter.result(), "measured_over_predicted": ratio,
           "within_target": abs(ratio - 1) <= TARGET}
    print(f"{name}: predicted {predicted.total_throughput:.2f}, measured {measured['total_throughput']:.2f} token/s "
          f"(x{ratio:.2f})", file=sys.stderr, flush=True)
    return row


def load_cell(load) -> str:
    if load is None:  # a result written before the load was recorded
        return "- |"
    start, end = load["loadavg_1min"]
    return f"{start:.2f}, {end:.2f}; {load['others_cpu_share']:.0%} |"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Cost model vs measurement: {m['cpu']}, {m['physical_cores']} cores, torch {m['torch']}", "",
             f"Command: `{result['command']}`. Device {result['device']}, {result['dtype']}, dummy weights, disk reads "
             f"bypassing the page cache, warm-up then the median of {result['runs']} runs. Profile: "
             f"{result['profile']['source']}. Target: measured / predicted total throughput within 1 +- {TARGET:g}; "
             f"{result['within_target']} of {len(result['rows'])} are.", "",
             "| case | model, tokens, batch | predicted prefill / decode / total (token/s) | measured | measured / "
             "predicted total | predicted bottleneck (decode) | disk read, measured before the case "
             "| load avg (start, end), other processes' CPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p, q = r["predicted"], r["measured"]
        lines.append(f"| {r['case']} | {r['model']}, {r['prompt_len']}+{r['gen_len']}, {r['batch']} | "
                     f"{p['prefill_throughput']:.1f} / {p['decode_throughput']:.2f} / {p['total_throughput']:.2f} | "
                     f"{q['prefill_throughput']:.1f} / {q['decode_throughput']:.2f} / {q['total_throughput']:.2f} | "
                     f"**{r['measured_over_predicted']:.2f}** | {p['bottleneck']['decode']} | "
                     + (f"{r['disk_read'] / 1e9:.2f} GB/s | " if r["disk_read"] else "- | ") + load_cell(r.get("load")))
    lines += ["", "Flags of each case:", ""] + [f"- {r['case']}: `{r['flags']}`" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--offload-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_validate"))
    p.add_argument("--only", default=None, help="run the cases whose name holds this text")
    p.add_argument("--out", default="results/cost_model")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    device = parse_device(args.device or default_device())
    dtype = default_dtype(device)
    profile = ensure_local_profile(device, args.offload_dir)
    cases = [c for c in CASES if args.only is None or args.only in c[0]]
    rows = [run_case(c, args, device, dtype, profile) for c in cases]
    result = {"command": "python scripts/validate_cost_model.py" + (f" --only '{args.only}'" if args.only else ""),
              "device": str(device), "dtype": str(dtype).removeprefix("torch."), "runs": args.runs,
              "profile": dataclasses.asdict(profile), "machine": describe_machine(), "rows": rows,
              "within_target": sum(r["within_target"] for r in rows)}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
