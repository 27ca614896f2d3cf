"""What `python -m flexh2o.run` does once its flags are parsed (run.py keeps the parser free of
torch, so that --help answers at once): checks, the plan, loading, generation and the report."""

import torch

from flexh2o.offload.disk import OffloadError
from flexh2o.offload.offload_dir import check_offload_dir
from flexh2o.host.thread_waiting import waiting_note
from flexh2o.host.devices import default_device, parse_device, parse_dtype
from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say
from flexh2o.offload.io_tasks import IOTaskError
from flexh2o.engine.preflight import parse_size
from flexh2o.models import resolve_model
from flexh2o.kv import check_budget
from flexh2o.engine.policy import Policy, placement_flag, policy_percents
from flexh2o.runs.prompts import load_tokenizer, pad_prompts, read_prompts, synthetic_prompts
from flexh2o.engine.sampling import check_sampling, check_seed
from flexh2o.common.output_files import check_output_file, json_text, write_json_atomic
from flexh2o.runs.report import build_report, format_report
from flexh2o.cli.distributed import world_from_env
from flexh2o.engine.stage_link import LinkError
from flexh2o.common.signals import kept_line
from flexh2o.jobs.cli import check_job_flags, check_job_names, run_job
from flexh2o.jobs.files import WriteFailed
from flexh2o.cli.run_world import check_peer_timeout, run_in_world
from flexh2o.runs.setup import choose_policy, dtype_name, load_engine
from flexh2o.planning.cost_model import predict
from flexh2o.runs.auto_plan import DEFAULT_GPU_BATCH_SIZE, check_planning_flags


WARMUP_PROMPT_LEN = 32  # FlexGen's warm-up prompts

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


def check_benchmark_flags(args, distributed: bool):
    """--warmup and --cut-gen-len time the one-block run of one process."""
    for flag in ("warmup", "cut_gen_len"):
        if getattr(args, flag) in (None, False):
            continue
        name = f"--{flag.replace('_', '-')}"
        if args.input or distributed or (flag == "cut_gen_len" and args.prompts_file):
            raise UsageError(name, "times a benchmark run of one process and synthetic prompts: "
                             "leave out --input, --prompts-file and torchrun")
    cut = args.cut_gen_len
    if cut is not None and not 4 <= cut <= args.gen_len:
        raise UsageError("--cut-gen-len", f"must be from 4 (two decode steps run as they come, one to project "
                         f"from) to --gen-len ({args.gen_len}), got {cut}")


def run_parsed(args) -> int:
    """The run of parsed flags, its errors as one line and an exit status."""
    try:
        with torch.no_grad():
            return run(args)
    except UsageError as e:
        say(f"error: {e}")
        return 2
    except WriteFailed as e:  # a dataset job's output: what it wrote before is whole, and resumable
        say(f"error: {e}; the records written before it are kept: run the same command again once it can be "
            "written to finish the job")
        return 1
    except LinkError as e:  # a pipeline stage lost the rank it sends to or receives from
        say(f"error: {e}; this rank stopped: {kept_line()} and its offload files removed")
        return 1
    except (OffloadError, IOTaskError) as e:  # a full disk names the flag; any other I/O failure its task
        cause = f"--offload-dir: {e.strerror}" if isinstance(e, OffloadError) else str(e)
        say(f"error: {cause}; the run stopped and its offload files were removed")
        return 1


def run(args) -> int:
    check_not_empty(args)
    check_positive(args)
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_seed(args.seed)
    check_peer_timeout(args.peer_timeout)
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
                    compress_weight=args.compress_weight, compress_cache=args.compress_cache,
                    int8_activations=args.int8_activations)
    caps = {f"{t}_mem": parse_size(getattr(args, f"{t}_mem"), f"--{t}-mem")
            for t in ("gpu", "cpu", "disk") if getattr(args, f"{t}_mem") is not None}
    if args.max_memory is not None:
        caps["max_memory"] = parse_size(args.max_memory, "--max-memory")
    device = parse_device(args.device or default_device())
    dtype = parse_dtype(args.dtype) if args.dtype else None
    spec, weights_dir = resolve_model(args.model, args.path)
    if args.json_out:
        check_output_file("--json-out", args.json_out, inputs=(args.input, args.prompts_file))
    if args.input:  # --output's folder is tried for room where the job opens it: a finished job writes nothing
        check_job_names(args)
    if args.offload_dir is not None:
        check_offload_dir(args.offload_dir)
    world = world_from_env(args.pipeline_stages)
    check_benchmark_flags(args, world.distributed)
    if waiting_note() is not None and world.rank == 0:
        say(waiting_note())
    if world.distributed:
        return run_in_world(args, world, policy, spec, weights_dir, device, dtype, caps, planning, run_block)
    if args.input:
        return run_job(args, policy, spec, weights_dir, device, dtype, caps, planning)
    return run_block(args, policy, spec, weights_dir, device, dtype, caps, planning)


def run_block(args, policy, spec, weights_dir, device, dtype, caps, planning, stage=None, report=True) -> int:
    """The one-block mode: one batch of prompts (synthetic, or --prompts-file), generated and
    reported (where `report`: in a pipeline, by its first stage alone)."""
    if args.prompt_len + args.gen_len > spec.max_positions:
        raise UsageError("--prompt-len/--gen-len", f"prompt_len + gen_len = {args.prompt_len + args.gen_len} "
                         f"exceeds the {spec.max_positions} positions of {spec.name}")
    check_budget(policy, args.prompt_len)
    dummy = args.dummy or weights_dir is None
    # Before the pre-flight reads the free memory: what the tokenizer holds is then already in use.
    tokenizer = None if dummy and not args.prompts_file else load_tokenizer(weights_dir)
    policy, profile = choose_policy(args, policy, spec, device, dtype, caps, planning, stage)
    tokens = read_prompts(args.prompts_file, tokenizer, policy.batch_size, args.prompt_len, args.chat) \
        if args.prompts_file else None
    engine = load_engine(args, spec, policy, device, dtype, caps, dummy, profile, stage)
    try:
        predicted = None if profile is None or stage is not None else \
            predict(spec, policy, args.prompt_len, args.gen_len, profile, dtype_name(dtype, device))
        return generate_and_report(args, engine, policy, tokens, tokenizer, dummy, predicted, report)
    finally:
        engine.close()


def batch_prompts(args, spec, batch: int, tokens):
    """The batch's prompt ids and mask: made only once the pre-flight has passed (they are batch-sized)."""
    if tokens is not None:
        return pad_prompts(tokens, args.prompt_len, spec.pad_token_id)
    return synthetic_prompts(batch, args.prompt_len, spec.vocab_size, args.seed)


def generate_and_report(args, engine, policy, tokens, tokenizer, dummy, predicted=None, report=True) -> int:
    input_ids, mask = batch_prompts(args, engine.spec, policy.batch_size, tokens)
    if dummy and not args.dummy and report:
        say(f"note: no --path given for {engine.spec.name}: using dummy weights")
    if args.warmup:
        warm_up(engine, policy.batch_size, min(WARMUP_PROMPT_LEN, args.prompt_len), args.seed)
    cut = args.cut_gen_len
    ids = engine.generate(input_ids, mask, max_new_tokens=args.gen_len, do_sample=args.do_sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          eos_token_id=-1 if args.stop_at_eos and cut is None else None, progress=report,
                          row_max_new_tokens=None if cut is None else [cut] * policy.batch_size)
    if not report:
        return 0
    sample, generated = None, None
    if tokenizer is not None and not dummy:
        texts = [tokenizer.decode(row[args.prompt_len:], skip_special_tokens=True) for row in ids]
        sample, generated = texts[0], texts if tokens is not None else None
    built = build_report(engine, engine.last_stats, policy, sample, predicted, generated, cut)
    print(format_report(built), flush=True)
    return save_json(args.json_out, built) if args.json_out else 0


def warm_up(engine, batch: int, prompt_len: int, seed: int):
    """FlexGen's warm-up before the timed run: one untimed generate of short prompts and one new token."""
    ids, mask = synthetic_prompts(batch, prompt_len, engine.spec.vocab_size, seed)
    engine.generate(ids, mask, max_new_tokens=1, eos_token_id=None)


def save_json(path: str, report: dict) -> int:
    """Writes the JSON report; if that fails after all, prints it to stdout instead (exit code 1)."""
    try:
        write_json_atomic(path, report)
        return 0
    except OSError as e:
        print(json_text(report), end="")
        say(f"error: --json-out: cannot write {path}: {e.strerror or e}; the JSON report went to stdout")
        return 1
