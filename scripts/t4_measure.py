"""The H2O paper's T4 settings of one model, measured on this CUDA GPU with its memory capped at a
T4's 16 GB, beside the cost model's prediction for this machine (a section of `make gpu-bench`).

    python scripts/t4_measure.py --model opt-30b [--seconds S]

For each of the paper's lengths (512+32, 512+512, 512+1024), two rows: FlexGen's baseline (the full
cache at the paper's FlexGen batch) and H2O-20% (10% heavy + 10% recent tokens at the paper's H2O
batch), both on FlexGen's kind of placement (reproduce_t4.FLEXGEN_STYLE: OPT-6.7B whole on the GPU;
OPT-30B with weights and cache in CPU memory and attention on the CPU).

The model loads once (dummy float16 weights, --gpu-mem 16GB); each row then sets its batch and KV
policy on the loaded engine and is timed as FlexGen times itself: a warm-up generate of 32-token
prompts and 1 token, then the run, cut to CUT_GEN_LEN token steps with the cache sized for the
whole length, decode projected from the steps run (FlexGen's --cut-gen-len; the later steps of a
long generation attend over more tokens, so a long cut run's projection leans fast). The batch is
the paper's, in the fewest gpu-batches the pre-flight admits; where no split of it fits this machine
(OPT-30B's cache in CPU memory beside 60 GB of weights), the largest batch that does, and the row
says so. The prediction uses the cached local profile (`python -m flexh2o.profile --device cuda`
measures it); a row's target: measured total throughput within +-25% of the predicted.

Each row is printed on stdout as one JSON line when it is done.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_vs_flexgen import FIGURES  # noqa: E402
from reproduce_t4 import FLEXGEN_STYLE, PAPER, PROMPT_LEN  # noqa: E402

GPU_MEM = "16GB"
TOLERANCE = 0.25
CUT_GEN_LEN = {"opt-6.7b": 32, "opt-30b": 5}  # token steps run (a 30B step streams 60 GB of weights)
MOST_GPU_BATCHES = 64
FULL = dict(kv_policy="full", hh_ratio=None, recent_ratio=None)
H2O = dict(kv_policy="h2o", hh_ratio=0.1, recent_ratio=0.1)


def rows_of(model: str) -> list:
    """The paper's settings of `model`, two rows per length, in the paper's order."""
    rows = []
    for (m, gen_len), (flexgen, h2o) in PAPER.items():
        if m != model:
            continue
        for kind, (tok_s, batch), kv in (("FlexGen baseline", flexgen, FULL), ("H2O-20%", h2o, H2O)):
            rows.append({"name": f"{model} {PROMPT_LEN}+{gen_len}, {kind}", "model": model, "gen_len": gen_len,
                         "kind": kind, "kv": kv, "paper_batch": batch, "paper_tok_s": tok_s})
    return rows


def largest_fitting(admits, most: int) -> int:
    """The largest b in 0..most with admits(b), admits being true up to some b and false above it."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if admits(mid) else (lo, mid - 1)
    return lo


def batch_shape(target: int, admits) -> tuple:
    """(gpu_batch_size, num_gpu_batches, note): `target` sequences in the fewest gpu-batches that
    admits(gpu_batch_size, num_gpu_batches) allows; if no split of it is admitted, the largest total
    batch that is (0 when none is), with a note saying so."""
    for nb in range(1, min(target, MOST_GPU_BATCHES) + 1):
        if target % nb == 0 and admits(target // nb, nb):
            return target // nb, nb, ""
    best = (0, 1)
    for nb in (1, 2, 4, 8):
        b = largest_fitting(lambda b: admits(b, nb), -(-target // nb))
        if b * nb > best[0] * best[1]:
            best = (b, nb)
    return (*best, f"the paper's batch of {target} does not fit this machine: the largest that does")


def admitted(engine, policy, gen_len: int) -> bool:
    """Whether the engine's pre-flight (Engine.generate's) admits `policy` for PROMPT_LEN + gen_len."""
    from flexh2o.common.errors import UsageError
    from flexh2o.engine.preflight import add, check_fits, run_need
    need = add(engine.weight_need, run_need(engine.cache_spec, policy, engine.tiers.dtype.itemsize, PROMPT_LEN,
                                            gen_len, engine.tiers.compute, False, engine.tiers.io_threads))
    try:
        check_fits(need, engine.caps, engine.tiers.compute)
        return True
    except UsageError:
        return False


def judge(row: dict, predicted) -> dict:
    """The prediction beside the measurement, and whether it is within TOLERANCE of it."""
    row["predicted"] = {k: v for k, v in predicted.to_dict().items() if k != "breakdown"}
    if "total_throughput" in row:
        row["measured_over_predicted"] = row["total_throughput"] / predicted.total_throughput
        row["within_target"] = abs(row["measured_over_predicted"] - 1) <= TOLERANCE
    return row


def measure_row(engine, row: dict, profile, cut: int) -> dict:
    """One row on the loaded engine: its batch shape, FlexGen's protocol with `cut` token steps run,
    the report's figures, and the prediction (profile None: none)."""
    import torch
    from flexh2o.planning.cost_model import predict
    from flexh2o.runs.prompts import synthetic_prompts
    from flexh2o.runs.report import build_report
    from flexh2o.cli.run_main import WARMUP_PROMPT_LEN, warm_up
    gen_len, cut = row["gen_len"], min(cut, row["gen_len"])

    def shape(b, nb):
        return dataclasses.replace(engine.policy, gpu_batch_size=b, num_gpu_batches=nb, **row["kv"])
    b, nb, note = batch_shape(row["paper_batch"], lambda b, nb: admitted(engine, shape(b, nb), gen_len))
    out = {**row, "gpu_batch_size": b, "num_gpu_batches": nb, "batch": b * nb, "batch_note": note, "steps_run": cut}
    if b == 0:
        return {**out, "error": "not even one sequence fits beside the weights"}
    start = time.monotonic()
    try:
        engine.use_policy(gpu_batch_size=b, num_gpu_batches=nb, **row["kv"])
        warm_up(engine, b * nb, WARMUP_PROMPT_LEN, 0)
        ids, mask = synthetic_prompts(b * nb, PROMPT_LEN, engine.spec.vocab_size, 0)
        engine.generate(ids, mask, max_new_tokens=gen_len, eos_token_id=None, row_max_new_tokens=[cut] * (b * nb))
        report = build_report(engine, engine.last_stats, engine.policy, cut_gen_len=cut if cut < gen_len else None)
        out.update({k: report[k] for k in FIGURES}, peak_gpu_allocator_bytes=report["peak_gpu_allocator_bytes"])
    except Exception as e:  # out of memory, or a refusal: the row says so and the next runs
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch.cuda.empty_cache()
    out["seconds"] = time.monotonic() - start
    if profile is None:
        return {**out, "predicted": None}
    dtype = str(engine.tiers.dtype).removeprefix("torch.")
    return judge(out, predict(engine.spec, engine.policy, PROMPT_LEN, gen_len, profile, dtype))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(FLEXGEN_STYLE), required=True)
    ap.add_argument("--seconds", type=float, default=600, help="no row starts after this many seconds")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"t4_measure: no CUDA device (torch {torch.__version__}): nothing measured", file=sys.stderr)
        return 0
    from flexh2o import Engine, Policy
    from flexh2o.engine.preflight import parse_size
    from flexh2o.runs.auto_plan import cached_local_profile
    torch.set_grad_enabled(False)
    deadline = time.monotonic() + args.seconds
    device = torch.device("cuda")
    profile = cached_local_profile(device, "float16")
    policy = Policy(gpu_batch_size=1, **FLEXGEN_STYLE[args.model])
    with Engine.from_pretrained(args.model, policy=policy, device=device, dtype=torch.float16, dummy=True,
                                gpu_mem=parse_size(GPU_MEM, "--gpu-mem")) as engine:
        for row in rows_of(args.model):
            if time.monotonic() > deadline:
                break
            print(json.dumps(measure_row(engine, row, profile, CUT_GEN_LEN[args.model])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
