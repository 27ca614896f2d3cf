"""Command line: python -m flexh2o.eval --model M --text FILE --prompt-len 512 --eval-len 128

What a KV policy or compression costs in output quality, on your model and your text:
teacher-forced perplexity through the engine's real cache, evictions included.

The text is tokenized once; K consecutive windows of prompt_len + eval_len tokens form one batch.
Each window prefills its first prompt_len tokens, then is fed its next eval_len tokens one decode
step at a time, and every fed token is scored from the logits of the step before it (the prompt
step's logits score the first). With --agreement the same windows also run with the full cache
and no compression, and the report gives how often the greedy choices of the two runs agree.
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse
import math
import time
from typing import TYPE_CHECKING

from flexh2o.common.errors import OneLineErrorParser, UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import add_kv_flags
from flexh2o.common.output_files import check_output_file

if TYPE_CHECKING:
    import torch

MAX_TEXT_BYTES = 64 << 20


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.eval", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--model", required=True, help="a model with a tokenizer: an HF directory, a .gguf file, or a "
                   "preset with --path (as for flexh2o.run)")
    p.add_argument("--path", help="weights directory for a preset --model")
    p.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file to score (at most 64 MB)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N", help="tokens each window prefills")
    p.add_argument("--eval-len", type=int, default=128, metavar="N", help="tokens each window is fed and scored on")
    p.add_argument("--windows", type=int, default=4, metavar="N",
                   help="consecutive windows of the text, run as one batch")
    p.add_argument("--offset", type=int, default=0, metavar="N", help="text tokens skipped before the first window")
    add_kv_flags(p)
    p.add_argument("--compress-weight", action="store_true", help="weights as 4-bit groups of 64")
    p.add_argument("--compress-cache", action="store_true", help="the KV cache as 4-bit groups of 64")
    p.add_argument("--int8-activations", action="store_true",
                   help="float32 on the CPU: a GGUF file's Q4_0/Q4_1/Q8_0 matrices multiplied at few rows (the fed "
                        "tokens' steps) with int8 activations, as llama.cpp does")
    p.add_argument("--num-gpu-batches", type=int, default=1, metavar="N",
                   help="the windows split into this many gpu-batches")
    p.add_argument("--agreement", action="store_true",
                   help="also run the full cache uncompressed and report greedy-token agreement with it")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float16, bfloat16 or float32; float32 for exact comparisons "
                   "(default: the engine's)")
    p.add_argument("--json-out", metavar="FILE", help="write ppl, tokens_scored and the settings as JSON here")
    return p


def read_text(path: str) -> str:
    from flexh2o.runs.prompts import read_utf8
    return read_utf8(path, "--text", MAX_TEXT_BYTES, "a text to score")


def text_windows(tokens: list[int], windows: int, prompt_len: int, eval_len: int, offset: int = 0) -> "torch.Tensor":
    """[windows, prompt_len + eval_len]: consecutive slices of the text's tokens from `offset`."""
    import torch
    width = prompt_len + eval_len
    need = offset + windows * width
    if len(tokens) < need:
        raise UsageError("--text", f"holds {len(tokens)} tokens; {windows} windows of {prompt_len} + {eval_len} "
                         f"from offset {offset} need {need}: give fewer --windows or shorter lengths")
    return torch.tensor(tokens[offset:need], dtype=torch.long).view(windows, width)


def teacher_forced(engine, windows: "torch.Tensor", prompt_len: int, progress: bool = False):
    """(log-probabilities [windows, eval_len] of each fed token, the greedy choices [windows, eval_len])."""
    prompt, fed = windows[:, :prompt_len], windows[:, prompt_len:]
    out = engine.generate(prompt, prompt.new_ones(prompt.shape), max_new_tokens=fed.shape[1], forced_tokens=fed,
                          progress=progress)
    return out.forced_logprobs, out.greedy


def perplexity(logprobs: "torch.Tensor") -> float:
    return math.exp(-logprobs.mean().item())


def evaluate(args) -> dict:
    # Imported once the flags parsed: torch is among them, and --help answers without it.
    from flexh2o.common.version import version
    from flexh2o.engine.engine import Engine
    from flexh2o.host.devices import default_device, parse_dtype
    from flexh2o.models import resolve_model
    from flexh2o.engine.policy import Policy
    from flexh2o.runs.prompts import load_tokenizer
    from flexh2o.runs.setup import dtype_name
    from flexh2o.offload.offload_dir import default_offload_dir
    for flag in ("prompt_len", "eval_len", "windows", "num_gpu_batches"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}", f"must be a positive integer, got {getattr(args, flag)}")
    if args.offset < 0:
        raise UsageError("--offset", f"must be 0 or more, got {args.offset}")
    if args.windows % args.num_gpu_batches:
        raise UsageError("--num-gpu-batches", f"must divide --windows {args.windows}, got {args.num_gpu_batches}")
    policy = Policy(args.windows // args.num_gpu_batches, args.num_gpu_batches, kv_policy=args.kv_policy,
                    hh_ratio=args.hh_ratio, recent_ratio=args.recent_ratio, compress_weight=args.compress_weight,
                    compress_cache=args.compress_cache, int8_activations=args.int8_activations)
    spec, weights_dir = resolve_model(args.model, args.path)
    if args.prompt_len + args.eval_len > spec.max_positions:
        raise UsageError("--prompt-len/--eval-len", f"{args.prompt_len} + {args.eval_len} exceeds the "
                         f"{spec.max_positions} positions of {spec.name}")
    tokenizer = load_tokenizer(weights_dir)
    if tokenizer is None:
        raise UsageError("--model", f"{args.model} has no tokenizer files: the text cannot be tokenized")
    if args.json_out:
        check_output_file("--json-out", args.json_out, inputs=(args.text,))
    tokens = tokenizer(read_text(args.text), add_special_tokens=False)["input_ids"]
    windows = text_windows(tokens, args.windows, args.prompt_len, args.eval_len, args.offset)
    device = args.device or default_device()
    dtype = parse_dtype(args.dtype) if args.dtype else None
    scored = windows[:, args.prompt_len:].numel()
    again = ", then again with the full cache" if args.agreement else ""
    say(f"scoring {args.windows} windows of {args.prompt_len} + {args.eval_len} tokens ({scored} tokens scored{again}): "
        f"the bar counts the token steps of {'each run' if again else 'the run'}, each feeding one token to every "
        "window")
    start = time.perf_counter()
    with Engine.from_pretrained(args.model, policy=policy, device=device, dtype=dtype, path=args.path,
                                offload_dir=default_offload_dir(), prompt_len=args.prompt_len,
                                gen_len=args.eval_len) as engine:
        logprobs, greedy = teacher_forced(engine, windows, args.prompt_len, progress=True)
        if args.agreement:  # the same weights, the full cache uncompressed
            engine.use_policy(kv_policy="full", hh_ratio=None, recent_ratio=None, compress_cache=False)
            full_logprobs, full_greedy = teacher_forced(engine, windows, args.prompt_len, progress=True)
    result = {"model": spec.name, "model_sha256": engine.model_sha256, "flexh2o_version": version(),
              "text": args.text, "text_tokens": len(tokens), "prompt_len": args.prompt_len,
              "eval_len": args.eval_len, "windows": args.windows, "offset": args.offset, "policy": policy.to_dict(),
              "dtype": dtype_name(engine.tiers.dtype, device), "ppl": perplexity(logprobs),
              "tokens_scored": logprobs.numel(),
              "mean_nll": -logprobs.mean().item()}
    if args.agreement:
        result |= {"full_cache_ppl": perplexity(full_logprobs),
                   "agreement": (greedy == full_greedy).double().mean().item()}
    result["seconds"] = time.perf_counter() - start
    return result


def describe(r: dict) -> str:
    p = r["policy"]
    kv = p["kv_policy"] if p["kv_policy"] == "full" else \
        f"{p['kv_policy']} (hh_ratio {p['hh_ratio']:g}, recent_ratio {p['recent_ratio'] or p['hh_ratio']:g})"
    lines = [f"model: {r['model']}\ttext: {r['text']} ({r['text_tokens']} tokens)\t{r['windows']} windows of "
             f"{r['prompt_len']} + {r['eval_len']} from token {r['offset']}",
             f"model sha256: {r['model_sha256'] or 'none (dummy weights)'}\tdtype: {r['dtype']}\t"
             f"flexh2o: {r['flexh2o_version']}",
             f"kv cache: {kv}" + (", weights compressed" if p["compress_weight"] else "")
             + (", cache compressed" if p["compress_cache"] else "")
             + (", int8 activations" if p.get("int8_activations") else ""),
             f"perplexity: {r['ppl']:.4f} over {r['tokens_scored']} tokens (mean NLL {r['mean_nll']:.4f})"]
    if "agreement" in r:
        lines.append(f"full cache, uncompressed: perplexity {r['full_cache_ppl']:.4f}; greedy tokens agree "
                     f"{100 * r['agreement']:.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    try:
        with torch.no_grad():
            result = evaluate(args)
    except UsageError as e:
        say(f"error: {e}")
        return 2
    print(describe(result), flush=True)
    from flexh2o.cli.run_main import save_json
    return save_json(args.json_out, result) if args.json_out else 0


if __name__ == "__main__":
    from flexh2o.common.signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.cli.run_main",))
