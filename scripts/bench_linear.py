"""x @ W^T on the CPU as F.linear computes it and as (W @ x^T)^T, the layout flexh2o's LM head
takes at decode sizes (flexh2o/models/lm_head.py).

    python scripts/bench_linear.py               # SmolLM2-135M's shapes; writes results/linear.{json,md}

Part 1, the products alone: for each of SmolLM2's weight shapes and each row count, both calls
run in turn on the same tensors (float32, all of torch's threads); the median of each is kept.
Part 2, in the engine: SmolLM2 (its GGUF, float32) decodes a batch of 32 prompts of 150 tokens,
its LM head taking either layout in turn; the figure is the decode step's median seconds.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.models import lm_head  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_quality import MODEL  # noqa: E402

SHAPES = {"q, k and v": (960, 576), "attention out": (576, 576), "gate and up": (3072, 576),
          "down": (576, 1536), "LM head": (49152, 576)}  # SmolLM2-135M: [out, in]
ROWS = (1, 2, 8, 32, 64, 128, 256, 1024, 4096)


def interleaved(calls: dict, runs: int) -> dict:
    """Median seconds of each call, the calls taking turns so that the machine's noise hits all alike."""
    samples = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(runs):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def markdown(result: dict) -> str:
    lines = ["# The layers' matrix product against F.linear on the CPU", "",
             f"Machine: {result['machine']}. Command: `{result['command']}`. float32, medians of "
             f"{result['runs']} interleaved calls. Ratio = (W @ x^T)^T / F.linear (below 1: faster).", "",
             "| weight [out, in] | rows | F.linear ms | (W @ x^T)^T ms | ratio |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} {r['out']}x{r['in']} | {r['rows']} | {r['f_linear_ms']:.3f} | "
                     f"{r['transposed_ms']:.3f} | {r['transposed_ms'] / r['f_linear_ms']:.2f} |")
    e = result.get("engine")
    if e:
        lines += ["", f"In the engine (SmolLM2, batch {e['batch']}, prompts of {e['prompt_len']} tokens, "
                  f"{e['steps']} decode steps, {e['runs']} runs each in turn): a decode step takes "
                  f"{e['f_linear_head_s']:.3f} s with F.linear as the LM head and {e['transposed_head_s']:.3f} s with "
                  f"the transposed layout ({e['transposed_head_s'] / e['f_linear_head_s']:.2f}x)."]
    return "\n".join(lines) + "\n"


def engine_steps(runs: int, batch: int = 32, prompt_len: int = 150, steps: int = 16) -> dict:
    """Median decode-step seconds of SmolLM2 with each LM head layout, taking turns."""
    from flexh2o import Engine, Policy
    engine = Engine.from_pretrained(MODEL, policy=Policy(gpu_batch_size=batch), dtype=torch.float32)
    ids = torch.randint(100, engine.spec.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    layouts = {"f_linear_head_s": (0, -1), "transposed_head_s": lm_head.FEW_ROWS}
    samples = {name: [] for name in layouts}
    for _ in range(runs):
        for name, rows in layouts.items():
            lm_head.FEW_ROWS = rows
            engine.generate(ids, max_new_tokens=steps + 1, eos_token_id=None)
            samples[name].append(engine.last_stats.decode_seconds / steps)
    lm_head.FEW_ROWS = layouts["transposed_head_s"]
    engine.close()
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "runs": runs,
            **{name: statistics.median(s) for name, s in samples.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--engine-runs", type=int, default=4, help="0: skip part 2 (the engine)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "linear"))
    args = p.parse_args()
    torch.set_grad_enabled(False)
    rows_out = []
    for shape, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) / in_features ** 0.5
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            runs = args.runs if rows * out_features <= 1 << 22 else max(3, args.runs // 5)
            t = interleaved({"f": lambda: F.linear(x, weight),
                             "transposed": lambda: torch.mm(weight, x.t()).t().contiguous()}, runs)
            rows_out.append({"shape": shape, "out": out_features, "in": in_features, "rows": rows,
                             "f_linear_ms": t["f"] * 1e3, "transposed_ms": t["transposed"] * 1e3})
            print(f"{shape} rows {rows}: {t['transposed'] / t['f']:.2f}", flush=True)
    result = {"machine": describe_machine(), "command": "python scripts/bench_linear.py", "runs": args.runs,
              "rows": rows_out,
              "engine": engine_steps(args.engine_runs) if args.engine_runs else None}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
