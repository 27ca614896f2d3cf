"""Command line: python -m flexh2o.run --model opt-1.3b --gpu-batch-size 8 ...

Runs one generation job and prints a FlexGen-style throughput report (and JSON with --json-out).
With no flags it runs opt-125m on dummy weights, 512 + 32 tokens, its batch and placement planned
by the cost model on this machine's profile (measured first if none is cached).
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.signals import stop_at_once
    stop_at_once()

import argparse
import sys

import torch

from .disk import OffloadError, check_offload_dir
from .engine import default_device, parse_device, parse_dtype
from .errors import OneLineErrorParser, UsageError
from .io_tasks import IOTaskError
from .memory import parse_size
from .models import resolve_model
from .kv import check_budget
from .policy import KV_POLICIES, Policy, placement_flag, policy_percents
from .prompts import load_tokenizer, pad_prompts, read_prompts, synthetic_prompts
from .sampling import check_sampling, check_seed
from .output import check_output_file, json_text, write_json_atomic
from .report import build_report, format_report
from .signals import run_stoppable
from .jobs.cli import check_job_flags, run_job
from .run_setup import choose_policy, dtype_name, load_engine
from .optimizer.cost_model import predict
from .planning import DEFAULT_GPU_BATCH_SIZE, check_planning_flags


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.run", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--model", default="opt-125m",
                   help="preset (opt-125m ... opt-175b, also as facebook/opt-*) or a directory with an HF config.json")
    p.add_argument("--path", help="directory holding the weights for a preset --model")
    p.add_argument("--dummy", action="store_true",
                   help="deterministic dummy weights (the default for a preset --model without --path)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-batch-size", type=int, default=None,
                   help="sequences per gpu-batch (default: planned, with the placement, by the cost model)")
    p.add_argument("--num-gpu-batches", type=int, default=None, help="gpu-batches per block (default: planned, else 1)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="when planning: the largest batch (sequences) to consider")
    p.add_argument("--allow-compression", action="store_true",
                   help="when planning: let the plan store weights and/or cache as 4-bit groups")
    p.add_argument("--percent", type=float, nargs=6, default=None,
                   metavar=("W_GPU", "W_CPU", "CACHE_GPU", "CACHE_CPU", "ACT_GPU", "ACT_CPU"),
                   help="FlexGen's six placement percentages; the rest of each kind goes to disk")
    for kind, what in (("weights", "weights"), ("cache", "the KV cache"), ("act", "activations")):
        p.add_argument(f"--{kind}", metavar="gpu=P,cpu=P,disk=P",
                       help=f"placement of {what} in percent (the same as three of --percent's numbers)")
    p.add_argument("--kv-policy", choices=KV_POLICIES, default=None,
                   help="KV cache policy: full keeps every token (the default without --hh-ratio); the others "
                   "hold a fixed budget per sequence and head (h2o is the default with --hh-ratio)")
    p.add_argument("--hh-ratio", type=float, default=None, metavar="R",
                   help="H2O: heavy-hitter slots = int(R * prompt_len), 0 < R <= 1; selects --kv-policy h2o")
    p.add_argument("--recent-ratio", type=float, default=None, metavar="R",
                   help="recent-window slots = int(R * prompt_len) (default: the --hh-ratio)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap weight / cache I/O with compute")
    p.add_argument("--cpu-cache-compute", action="store_true",
                   help="on CUDA, attend over a CPU-resident cache on the CPU instead of moving it")
    p.add_argument("--compress-weight", action="store_true",
                   help="store weight matrices as 4-bit groups of 64 (4.5 bits per value) on every tier")
    p.add_argument("--compress-cache", action="store_true",
                   help="store the KV cache as 4-bit groups of 64 along head_dim on every tier")
    for tier in ("gpu", "cpu", "disk"):
        p.add_argument(f"--{tier}-mem", metavar="SIZE", help=f"cap on the {tier} tier, e.g. 16GB (default: detected)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="memory the whole process may use, e.g. 8GB (default: the limit of its memory cgroup, if any)")
    p.add_argument("--no-page-cache", action="store_true",
                   help="disk reads skip the page cache (benchmarks measure the disk): O_DIRECT where the "
                        "filesystem allows it, else each read's pages are evicted after it, readahead off")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="float16 (CUDA default), bfloat16 or float32 (CPU default: bfloat16 where the CPU computes it natively, else float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts, dummy weights and sampling")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                   help="keep generating after EOS (benchmarks)")
    p.add_argument("--offload-dir", default=None,
                   help="directory for tensors placed on disk (default: $TMPDIR/flexh2o_offload)")
    p.add_argument("--json-out", help="write the report's figures, the policy and the machine as JSON here")
    p.add_argument("--prompts-file", help="one prompt per line (needs a tokenizer next to the weights); the "
                   "generated text of each is printed")
    p.add_argument("--chat", action="store_true",
                   help="each plain prompt (--prompts-file, --input) as a user turn in the tokenizer's chat template")
    job = p.add_argument_group("dataset jobs (any number of prompts; see README)")
    job.add_argument("--input", metavar="FILE", help="prompts: plain text (one per line), JSONL ({\"id\", \"prompt\" "
                     "or \"messages\", optional max_tokens, temperature, top_p, top_k, stop, seed}) or an OpenAI "
                     "Batch file; with --gen-len as the default max_tokens")
    job.add_argument("--output", metavar="OUT.jsonl", help="one result record per input record, appended as "
                     "blocks finish; run the same command again to resume a stopped job")
    job.add_argument("--skip-bad", action="store_true", help="write bad input records as error records and go on "
                     "(default: refuse the input before loading the model)")
    job.add_argument("--ordered", action="store_true", help="at the end, rewrite --output in input order")
    job.add_argument("--overwrite", action="store_true",
                     help="start --output again instead of resuming it")
    job.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="progress bars and more detail")
    return p


STRING_FLAGS = ("model", "path", "weights", "cache", "act", "gpu_mem", "cpu_mem", "disk_mem", "max_memory", "device", "dtype",
                "offload_dir", "json_out", "prompts_file", "input", "output")


def check_not_empty(args):
    for name in STRING_FLAGS:
        value = getattr(args, name)
        if value is not None and not value.strip():
            raise UsageError(f"--{name.replace('_', '-')}", "is empty; give a value or leave the flag out")


def check_positive(args):
    for flag in ("prompt_len", "gen_len"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}", f"must be a positive integer, got {getattr(args, flag)}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OffloadError, IOTaskError) as e:  # a full disk names the flag; any other I/O failure its task
        cause = f"--offload-dir: {e.strerror}" if isinstance(e, OffloadError) else str(e)
        print(f"error: {cause}; the run stopped and its offload files were removed", file=sys.stderr)
        return 1


def run(args) -> int:
    check_not_empty(args)
    check_positive(args)
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_seed(args.seed)
    if args.chat and not (args.prompts_file or args.input):
        raise UsageError("--chat", "applies to the prompts of --prompts-file or --input: give one")
    check_job_flags(args)
    planning = args.gpu_batch_size is None and placement_flag(args) is None
    check_planning_flags(args, planning)
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = policy_percents(args)
    policy = Policy(args.gpu_batch_size or DEFAULT_GPU_BATCH_SIZE, args.num_gpu_batches or 1,
                    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu,
                    overlap=args.overlap, cpu_cache_compute=args.cpu_cache_compute, kv_policy=args.kv_policy,
                    hh_ratio=args.hh_ratio, recent_ratio=args.recent_ratio,
                    compress_weight=args.compress_weight, compress_cache=args.compress_cache)
    caps = {f"{t}_mem": parse_size(getattr(args, f"{t}_mem"), f"--{t}-mem")
            for t in ("gpu", "cpu", "disk") if getattr(args, f"{t}_mem") is not None}
    if args.max_memory is not None:
        caps["max_memory"] = parse_size(args.max_memory, "--max-memory")
    device = parse_device(args.device or default_device())
    dtype = parse_dtype(args.dtype) if args.dtype else None
    spec, weights_dir = resolve_model(args.model, args.path)
    for flag in ("json_out", "output"):
        if getattr(args, flag):
            check_output_file(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if args.offload_dir is not None:
        check_offload_dir(args.offload_dir)
    if args.input:
        return run_job(args, policy, spec, weights_dir, device, dtype, caps, planning)
    if args.prompt_len + args.gen_len > spec.max_positions:
        raise UsageError("--prompt-len/--gen-len", f"prompt_len + gen_len = {args.prompt_len + args.gen_len} "
                         f"exceeds the {spec.max_positions} positions of {spec.name}")
    check_budget(policy, args.prompt_len)
    dummy = args.dummy or weights_dir is None
    # Before the pre-flight reads the free memory: what the tokenizer holds is then already in use.
    tokenizer = None if dummy and not args.prompts_file else load_tokenizer(weights_dir)
    policy, profile = choose_policy(args, policy, spec, device, dtype, caps, planning)
    tokens = read_prompts(args.prompts_file, tokenizer, policy.batch_size, args.prompt_len, args.chat) \
        if args.prompts_file else None
    engine = load_engine(args, policy, device, dtype, caps, dummy)
    try:
        predicted = None if profile is None else predict(spec, policy, args.prompt_len, args.gen_len, profile,
                                                         dtype_name(dtype, device))
        return generate_and_report(args, engine, policy, tokens, tokenizer, dummy, predicted)
    finally:
        engine.close()


def batch_prompts(args, spec, batch: int, tokens):
    """The batch's prompt ids and mask: made only once the pre-flight has passed (they are batch-sized)."""
    if tokens is not None:
        return pad_prompts(tokens, args.prompt_len, spec.pad_token_id)
    return synthetic_prompts(batch, args.prompt_len, spec.vocab_size, args.seed)


def generate_and_report(args, engine, policy, tokens, tokenizer, dummy, predicted=None) -> int:
    input_ids, mask = batch_prompts(args, engine.spec, policy.batch_size, tokens)
    if dummy and not args.dummy:
        print(f"note: no --path given for {engine.spec.name}: using dummy weights", file=sys.stderr)
    ids = engine.generate(input_ids, mask, max_new_tokens=args.gen_len, do_sample=args.do_sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          eos_token_id=-1 if args.stop_at_eos else None, progress=True)
    sample, generated = None, None
    if tokenizer is not None and not dummy:
        texts = [tokenizer.decode(row[args.prompt_len:], skip_special_tokens=True) for row in ids]
        sample, generated = texts[0], texts if tokens is not None else None
    report = build_report(engine, engine.last_stats, policy, sample, predicted, generated)
    print(format_report(report), flush=True)
    return save_json(args.json_out, report) if args.json_out else 0


def save_json(path: str, report: dict) -> int:
    """Writes the JSON report; if that fails after all, prints it to stdout instead (exit code 1)."""
    try:
        write_json_atomic(path, report)
        return 0
    except OSError as e:
        print(json_text(report), end="")
        print(f"error: --json-out: cannot write {path}: {e.strerror or e}; the JSON report went to stdout",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(run_stoppable(main))
