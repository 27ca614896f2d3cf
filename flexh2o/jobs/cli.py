"""`python -m flexh2o.run --input FILE --output OUT.jsonl`: a dataset job from the command line.

Every record is read and checked before any weight loads; the output's settings are checked
against a resumed job's; the batch and placement are planned (or taken from the flags) for the
job's longest block; then the weights load once, placed by that plan, and the blocks run
(job.py), each block shape at its own plan (plans.py), the records going to the output as each
block finishes.
"""

import os
import shlex
import sys
import time

from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.common.messages import progress_bar
from flexh2o.common.errors import UsageError
from flexh2o.common.version import version
from flexh2o.models import eos_ids
from flexh2o.planning.planner import plan_capacities
from flexh2o.common.output_files import identity, write_json_atomic
from flexh2o.engine.policy import placement_flag
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.offload.offload_dir import default_offload_dir
from flexh2o.runs.setup import choose_policy, dtype_name, load_engine
from flexh2o.common.signals import set_stop_outcome
from flexh2o.jobs.blocks import ROUND_TO, round_up
from flexh2o.jobs.files import OutputLock, WriteFailed, check_written_names, left_temporary_files, \
    remove_left_temporary_files
from flexh2o.jobs.format import formatter_for
from flexh2o.jobs.input import JobInput
from flexh2o.jobs.job import Job
from flexh2o.jobs.output import JobOutput, finished_records, record_id, settings_path
from flexh2o.jobs.plans import FixedPlan, SearchedPlans
from flexh2o.jobs.replicas import merge, part_paths, records_in, start_over

JOB_ONLY = ("output", "skip_bad", "ordered", "overwrite", "fixed_blocks", "join_every", "prompt_chunk")


def check_job_flags(args):
    if args.input is None:
        for name in JOB_ONLY:
            if getattr(args, name) not in (None, False):
                raise UsageError(f"--{name.replace('_', '-')}", "applies to a dataset job: give --input FILE too")
        return
    if args.output is None:
        raise UsageError("--input", "needs --output OUT.jsonl, where each record's result goes")
    if args.prompts_file is not None:
        raise UsageError("--prompts-file", "is the one-block mode; with --input, give the prompts there")
    if args.batch is not None:
        raise UsageError("--batch", "is the one-block mode's; a job plans its blocks from --input's records "
                         "(--max-batch caps them)")
    for flag, value in (("--join-every", args.join_every), ("--prompt-chunk", args.prompt_chunk)):
        if value is not None and value < 1:
            raise UsageError(flag, f"must be a whole number >= 1, got {value}")
        if value is not None and args.fixed_blocks:
            raise UsageError(flag, "applies to refilled slots, not --fixed-blocks")


def check_job_names(args):
    """Before anything is written: every file the job writes is neither its input nor a link, a
    directory or a FIFO, and --json-out is none of the job's own files."""
    written = [args.output, settings_path(args.output), args.output + ".lock"]
    check_written_names("--output", written, args.input)
    if args.json_out:
        check_written_names("--json-out", [args.json_out], args.input)
        if identity(args.json_out) in {identity(p) for p in written} - {None} or \
                os.path.abspath(args.json_out) in map(os.path.abspath, written):
            raise UsageError("--json-out", f"{args.json_out} is one of the job's own files (--output "
                             f"{args.output}, its settings or its lock): give another path")


def job_settings(args, spec, dtype: str, model_digest: str | None) -> dict:
    """What the output's records depend on: a resumed job must match them (placement and batch do
    not). dtype: the one the run computes in, as resolved (a default is recorded as what it chose);
    model_digest: its files' SHA-256 (fingerprint.py). int8_activations is recorded only where on,
    so the settings of a job begun before the option existed still match a run without it."""
    return {"model": spec.name, "path": args.path, "model_sha256": model_digest, "dtype": dtype, "input": args.input,
            "kv_policy": args.kv_policy, "hh_ratio": args.hh_ratio, "recent_ratio": args.recent_ratio,
            "compress_weight": args.compress_weight, "compress_cache": args.compress_cache, "chat": args.chat,
            "max_tokens": args.gen_len, "do_sample": args.do_sample, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop_at_eos": args.stop_at_eos,
            **({"int8_activations": True} if args.int8_activations else {})}


def run_job(args, policy, spec, weights_dir, device, dtype, caps, planning: bool, replica=None) -> int:
    """policy: as the flags give it; planned (or fitted) here for the job's longest block.
    replica: this process's side of a data-parallel world (replicas.py), or None: the whole job."""
    tokenizer = load_tokenizer(weights_dir)
    if tokenizer is None:
        raise UsageError("--input", "needs a tokenizer: give --path (or --model) a directory with tokenizer files "
                         "or a GGUF file")
    began = time.perf_counter()
    defaults = {"max_tokens": args.gen_len, "temperature": args.temperature if args.do_sample else 0.0,
                "top_p": args.top_p, "top_k": args.top_k, "seed": None}
    job_input = JobInput(args.input, tokenizer, defaults, spec.max_positions, args.chat, args.skip_bad)
    provenance = {"model": spec.name, "model_sha256": model_sha256(weights_dir), "dtype": dtype_name(dtype, device),
                  "flexh2o_version": version()}
    settings = {**job_settings(args, spec, provenance["dtype"], provenance["model_sha256"]),
                "input_records": job_input.fingerprint}
    # Read only: a run refused before its weights load writes nothing (a replica's part included).
    in_output, done = already_done(args, settings)
    all_ids = [e.id for e in job_input.entries]
    if replica is not None:
        job_input.entries = replica.own(job_input.entries)
    if all(e.id in done for e in job_input.entries):  # a finished job run again: the model is not loaded
        if replica is None:
            finish_done(args, settings, job_input, in_output)
        else:  # rank 0 merges the parts once every replica has opened its own
            open_output(args, settings, all_ids, replica).close()
        print(f"records: {len(job_input.entries)}, every one already in {args.output}: nothing to do", flush=True)
        first_on_node(replica, "plan", lambda: None)  # its node's other ranks may wait to plan after it
        return finish(replica, settings)
    read_seconds = time.perf_counter() - began
    good = [e for e in job_input.entries if e.error is None]
    if good:
        args.prompt_len = min(round_up(max(e.prompt_tokens for e in good), ROUND_TO), spec.max_positions - 1)
        args.gen_len = max(e.max_tokens for e in good)
        args.gen_len = min(args.gen_len, spec.max_positions - args.prompt_len)
        if args.gpu_batch_size is None and placement_flag(args) is None and args.max_batch is None:
            args.max_batch = len(good)
    stage = None if replica is None else replica.stage  # a pipeline's stages run the one plan of every block
    policy, profile = first_on_node(replica, "plan",
                                    lambda: choose_policy(args, policy, spec, device, dtype, caps, planning, stage))
    plans = FixedPlan(policy)
    if planning and stage is None:  # the capacities as the first plan saw them, before the weights take their share
        limits = plan_capacities(profile, args.offload_dir or default_offload_dir(), caps.get("gpu_mem"),
                                 caps.get("cpu_mem"), caps.get("disk_mem"), caps.get("max_memory"),
                                 dtype_name(dtype, device))
        plans = SearchedPlans(spec, policy, profile, limits, dtype_name(dtype, device), args.max_batch)
    total = len(job_input.entries)
    opened = []
    set_stop_outcome(lambda: f"{sum(e.id in (opened[0].done if opened else done) for e in job_input.entries)} of "
                              f"{total} records are safe in {opened[0].path if opened else args.output}; "
                              f"run the same command again to finish the rest ({resume_command()})")

    def open_once_it_fits():  # the pre-flight passed: now the output (or part), its settings and its lock are made
        opened.append(open_output(args, settings, all_ids, replica))
    try:
        engine = load_engine(args, spec, policy, device, dtype, caps, dummy=False, profile=profile, stage=stage,
                             once_it_fits=open_once_it_fits)
    except BaseException:
        if opened:
            opened[0].close()
        raise
    output = opened[0]
    try:
        generate_all(args, engine, job_input, output, tokenizer, spec, plans, read_seconds, ordered=replica is None,
                     provenance=provenance)
    finally:
        engine.close()
        output.close()
    return finish(replica, settings)


def already_done(args, settings) -> tuple[list[str], set[str]]:
    """Read only: (the ids of --output's whole records in file order, the ids of every record it and
    any part an interrupted data-parallel run left hold); a resume that cannot go on is refused
    here, before anything is planned, loaded or written."""
    if args.overwrite:
        return [], set()
    in_output = [record_id(r) for r in finished_records(args.output, settings)]
    return in_output, set(in_output) | set(records_in(part_paths(args.output), settings))


def finish_done(args, settings, job_input, in_output: list[str]):
    """Every record is done: writes only what is left to write (parts to merge, --ordered's rewrite
    of an output out of input order), so a finished job in a folder now read-only has nothing to do."""
    ids = [e.id for e in job_input.entries]
    if part_paths(args.output) or (args.ordered and in_output != ids):
        output = open_output(args, settings, ids, None)  # merges the parts
        try:
            if args.ordered:
                output.rewrite_in_order(ids)
        finally:
            output.close()
    elif left_temporary_files(args.output) or left_temporary_files(settings_path(args.output)):
        try:
            lock = OutputLock(args.output)  # a rewrite a SIGKILL stopped left its file: removed once no job runs
        except (UsageError, WriteFailed):
            return
        try:
            remove_left_temporary_files([args.output, settings_path(args.output)])
        finally:
            lock.release()


def open_output(args, settings, all_ids: list[str], replica) -> JobOutput:
    """The output this process appends to: --output itself (parts an interrupted data-parallel run
    left merged into it first), or its replica's part (its `done`: the records made anywhere)."""
    if replica is not None:
        return replica.open_output(settings, args.overwrite, all_ids)
    lock = OutputLock(args.output)  # before anything is removed or merged
    try:
        if args.overwrite:
            start_over(args.output)
        elif part_paths(args.output):
            merge(args.output, settings, all_ids)
        return JobOutput(args.output, settings, args.overwrite, lock)
    except BaseException:
        lock.release()
        raise


def first_on_node(replica, name: str, work):
    return work() if replica is None else replica.peers.first_on_node(name, work)


def finish(replica, settings) -> int:
    line = None if replica is None else replica.finish(settings)
    if line:
        print(line, flush=True)
    return 0


def resume_command() -> str:
    return "python -m flexh2o.run " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def generate_all(args, engine, job_input, output, tokenizer, spec, plans, read_seconds: float = 0.0,
                 ordered: bool = True, provenance: dict | None = None) -> int:
    """provenance: the model, its SHA-256, the dtype and flexh2o's version, which the summary records."""
    # Closed on the way out of an error too: a bar left drawn would run into the error's line.
    with progress_bar(total=len(job_input.entries), initial=len(output.done & {e.id for e in job_input.entries}),
                      unit="record", desc="job", dynamic_ncols=True, disable=args.quiet) as bar:
        tokens = [0]

        def progress(records: int, generated: int):
            if not args.quiet:
                tokens[0] += generated
                bar.update(records)
                bar.set_postfix_str(f"{tokens[0] / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        job = Job(engine, job_input, output, tokenizer, formatter_for(job_input.format, spec.name),
                  eos_ids(spec) if args.stop_at_eos else None, args.seed, progress, plans, args.fixed_blocks,
                  args.join_every or 1, args.prompt_chunk)
        job.stats.read_seconds = read_seconds
        for _ in job.run():
            pass
    if args.ordered and ordered:
        output.rewrite_in_order([e.id for e in job_input.entries])
    summary = {**(provenance or {}), **job.stats.summary()}
    if output.writes:  # (a middle pipeline stage's records hold no tokens)
        print(format_summary(summary, output.path), flush=True)
    if args.json_out and output.writes:
        try:
            write_json_atomic(args.json_out, {"job": summary, "policy": engine.policy.to_dict()})
        except OSError as e:
            raise WriteFailed(args.json_out, e) from None
    return 0


def format_summary(s: dict, path: str) -> str:
    return "\n".join(([f"model: {s['model']} (sha256 {s['model_sha256'] or 'none: dummy weights'}), {s['dtype']}, "
                       f"flexh2o {s['flexh2o_version']}"] if "model" in s else []) + [
        f"records: {s['records']} ({s['written']} written now, {s['skipped_already_done']} already in {path}, "
        f"{s['bad_records']} bad)",
        (f"slots refilled: {s['refills']} times, new records joining at {s['join_steps']} token steps"
         if s["refills"] or s["join_steps"] else f"blocks: {s['blocks']} ({s['block_shapes']} shapes)"),
        f"prompt tokens: {s['prompt_tokens']} real of {s['computed_prompt_tokens']} computed "
        f"(padding {s['padding_share']:.1%})",
        f"generated tokens: {s['generated_tokens']} of {s['decode_slots']} decode slots "
        f"({s['slots_wasted_after_stop']:.1%} after a sequence stopped)",
        f"wall time: {s['wall_seconds']:.1f} s (the first plan and the model's loading excluded), "
        f"{s['generated_tokens_per_second']:.2f} generated tokens/s",
        f"the job's own reading, tokenizing, planning and writing: {s['job_own_seconds']:.1f} s "
        f"({s['job_own_share']:.1%} of the wall time)"])
