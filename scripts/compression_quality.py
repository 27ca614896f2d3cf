"""What 4-bit compression costs in output quality: greedy generation with the weights, the KV cache or
both compressed, against the same run uncompressed, with the full cache and with H2O.

    python scripts/compression_quality.py   # tiny random OPTs and opt-125m dummy, 8 x (32+32) each; ~2 min

Models: the tiny random OPTs of tests/conftest.py (make_tiny_opt with its CONFIGS 'tiny', 'wide',
'post_norm_proj' and seeds 0, 1, 2 as the tiny_models fixture makes them: weights normal(0, 0.3))
and opt-125m with dummy weights (normal(0, 0.02) windows). float32 on the CPU, greedy, EOS ignored,
one fixed random prompt batch per model, everything on the compute tier. (opt-125m's dummy weights
give near-constant output: with 128-token prompts every sequence repeats one token id throughout, so
the default prompt is 32 tokens, where the output varies a little; the markdown lists the distinct
token ids each reference generated.)

Per model, KV policy (full; h2o with --hh-ratio) and compression (weights, cache, both), against the
uncompressed run with the same KV policy (and, for reference, H2O uncompressed against the full cache):
- token agreement: the fraction of generated tokens equal to the reference's, position by position;
- first divergence: per sequence, the first step whose token differs (step 0 is the token chosen
  from the prompt's logits; a sequence that never diverges counts as gen_len), its mean;
- logit error over the steps whose inputs are still identical (every step up to and including the
  sequence's first divergence): the max abs error, and the mean abs error / the std of the
  reference's logits over those steps. The reference's median margin over the same steps (top logit
  minus the next distinct value: opt-125m's dummy embedding repeats every 16384 rows, so its logits
  come in exactly equal copies) says how close its greedy choices were.
Writes results/compression_quality.{json,md}.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.models import resolve_model  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from tests.conftest import CONFIGS, VOCAB, make_tiny_opt  # noqa: E402

COMPRESSION = {"weights": (True, False), "cache": (False, True), "both": (True, True)}
TINY = list(CONFIGS)


def generate(model: str, dummy: bool, policy: Policy, ids: torch.Tensor, gen_len: int):
    """(generated tokens [batch, gen_len], logits [batch, gen_len, vocab]) of a greedy float32 run."""
    with Engine.from_pretrained(model, policy=policy, device="cpu", dtype=torch.float32, dummy=dummy) as engine:
        out = engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None, output_scores=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)


def compare(ref, run) -> dict:
    """The figures of the module note for `run` against `ref`, each a (tokens, logits) pair."""
    (ref_tokens, ref_logits), (tokens, logits) = ref, run
    batch, gen_len = tokens.shape
    differ = tokens != ref_tokens
    first = torch.where(differ.any(1), differ.int().argmax(1), torch.full((batch,), gen_len))
    same_inputs = torch.arange(gen_len)[None, :] <= first[:, None]  # [batch, gen_len]
    err, base = (logits - ref_logits)[same_inputs].abs(), ref_logits[same_inputs]
    top = base.max(-1, keepdim=True).values  # the margin to the next distinct value: dummy weights tie exactly
    margin = (top - base.masked_fill(base >= top, float("-inf")).max(-1, keepdim=True).values).squeeze(-1)
    return {"agreement": (~differ).float().mean().item(), "diverged": int(differ.any(1).sum()),
            "sequences": batch, "mean_first_divergence": first.float().mean().item(),
            "first_divergence": first.tolist(), "compared_steps": int(same_inputs.sum()),
            "max_abs_err": err.max().item(), "mean_abs_err_over_std": (err.mean() / base.std()).item(),
            "ref_logit_std": base.std().item(), "ref_median_margin": margin.median().item(),
            "ref_distinct_tokens": int(ref_tokens.unique().numel())}


def evaluate(name: str, model: str, dummy: bool, ids: torch.Tensor, gen_len: int, hh_ratio: float) -> list:
    batch = ids.shape[0]
    kvs = {"full": {}, f"h2o-{hh_ratio:g}": {"hh_ratio": hh_ratio}}
    rows, refs = [], {}
    for kv, extra in kvs.items():
        refs[kv] = generate(model, dummy, Policy(gpu_batch_size=batch, **extra), ids, gen_len)
        for label, (cw, cc) in COMPRESSION.items():
            run = generate(model, dummy, Policy(gpu_batch_size=batch, compress_weight=cw, compress_cache=cc, **extra),
                           ids, gen_len)
            rows.append({"model": name, "kv": kv, "compressed": label, "reference": f"{kv}, uncompressed",
                         **compare(refs[kv], run)})
            print({k: v for k, v in rows[-1].items() if k != "first_divergence"}, flush=True)
    h2o = list(kvs)[1]
    rows.append({"model": name, "kv": h2o, "compressed": "none", "reference": "full, uncompressed",
                 **compare(refs["full"], refs[h2o])})
    return rows


def markdown(r) -> str:
    m = r["machine"]
    lines = ["# What 4-bit compression costs in output quality", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}. Command: `{r['command']}` "
             f"({r['elapsed_s']:.0f} s). float32 on the CPU, greedy, EOS ignored, weights and cache on the compute tier.",
             "", "Models: " + "; ".join(f"{x['model']}: {x['weights']}, batch {x['batch']} x ({x['prompt_len']}+"
                                        f"{x['gen_len']}), fixed random prompts (seed {r['seed']})" for x in r["models"])
             + ".", "",
             "Each compressed run is compared with the uncompressed run of the same KV policy; the last row of each "
             "model compares H2O with the full cache, both uncompressed, for scale. Agreement: generated tokens equal "
             "to the reference's, position by position. First divergence: the first step whose token differs (step 0 "
             "comes from the prompt's logits; a sequence that never diverges counts as gen_len). Logit errors: over the "
             "steps whose inputs are still identical, up to and including each sequence's first divergence; relative "
             "error = mean abs error / std of the reference's logits there; margin = the reference's median gap from its "
             "top logit to the next distinct value there (opt-125m's dummy embedding repeats every 16384 rows, so its "
             "logits come in exactly equal copies, which greedy resolves to the lowest id with or without compression)."
             , "",
             "| model | kv cache | compressed | vs | token agreement | sequences diverged | mean first divergence "
             "step | max abs logit error | mean abs error / logit std | reference: logit std, median margin, distinct "
             "tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['model']} | {x['kv']} | {x['compressed']} | {x['reference']} | {x['agreement']:.1%} | "
                     f"{x['diverged']} / {x['sequences']} | {x['mean_first_divergence']:.1f} | {x['max_abs_err']:.3g} | "
                     f"{x['mean_abs_err_over_std']:.3g} | {x['ref_logit_std']:.3g}, {x['ref_median_margin']:.3g}, "
                     f"{x['ref_distinct_tokens']} |")
    flat = sorted({f"{x['model']} ({x['reference']})" for x in r["rows"] if x["ref_distinct_tokens"] == 1})
    if flat:
        lines += ["", f"One token id throughout (every sequence, every step) in the reference run of {', '.join(flat)}: "
                  "token agreement against it says little; the logit errors still apply."]
    return "\n".join(lines + [""])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=TINY + ["opt-125m"], default=TINY + ["opt-125m"])
    ap.add_argument("--batch", type=int, default=8, help="tiny models")
    ap.add_argument("--prompt-len", type=int, default=32, help="tiny models (prompt + gen <= 64 positions)")
    ap.add_argument("--gen-len", type=int, default=32, help="tiny models")
    ap.add_argument("--big-batch", type=int, default=8, help="opt-125m")
    ap.add_argument("--big-prompt-len", type=int, default=32, help="opt-125m (with 128 its dummy output is one token)")
    ap.add_argument("--big-gen-len", type=int, default=32, help="opt-125m")
    ap.add_argument("--hh-ratio", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "compression_quality"))
    args = ap.parse_args()
    started = time.perf_counter()
    torch.set_grad_enabled(False)
    rows, models = [], []
    with tempfile.TemporaryDirectory(prefix="flexh2o-quality-") as tmp:
        for name in args.models:
            if name in CONFIGS:  # as tests/conftest.py's tiny_models fixture makes them
                model, dummy = os.path.join(tmp, name), False
                make_tiny_opt(model, seed=TINY.index(name), **CONFIGS[name])
                batch, prompt_len, gen_len, vocab = args.batch, args.prompt_len, args.gen_len, VOCAB
                weights = f"random normal(0, 0.3), seed {TINY.index(name)}"
            else:
                model, dummy, vocab = name, True, resolve_model(name)[0].vocab_size
                batch, prompt_len, gen_len = args.big_batch, args.big_prompt_len, args.big_gen_len
                weights = "dummy"
            ids, _ = synthetic_prompts(batch, prompt_len, vocab, seed=args.seed)
            models.append({"model": name, "weights": weights, "batch": batch, "prompt_len": prompt_len,
                           "gen_len": gen_len})
            rows += evaluate(name, model, dummy, ids, gen_len, args.hh_ratio)
    result = {"command": "python " + " ".join(sys.argv), "seed": args.seed, "hh_ratio": args.hh_ratio,
              "models": models, "rows": rows, "machine": describe_machine(), "elapsed_s": time.perf_counter() - started}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
