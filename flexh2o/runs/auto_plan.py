"""How flexh2o.run plans a job it is given no batch size or placement for, and predicts any job.

Planning uses the local hardware profile (measured first if none is cached for this device) and
the capacities the engine's pre-flight will see; the plan is announced in one `note:` line with
the flags that reproduce it.
"""

from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import duration
from flexh2o.host.hardware import LOCAL, load_profile, local_cache_path
from flexh2o.planning.planner import describe_caps, plan_capacities, run_flags
from flexh2o.planning.search import search
from flexh2o.runs.prompts import read_lines

DEFAULT_GPU_BATCH_SIZE = 4  # with --gpu-batch-size absent but a placement given
PLANNING_FLAGS = ("--max-batch", "--batch", "--allow-compression")


def check_planning_flags(args, planning: bool):
    for flag in PLANNING_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False) and not planning:
            raise UsageError(flag, "applies only to a planned run: leave out --gpu-batch-size and the placement "
                             "flags (--weights/--cache/--act/--percent)")
    for flag in ("gpu_batch_size", "num_gpu_batches", "max_batch", "batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}", f"must be a positive integer, got {value}")


def local_profile(device, offload_dir: str, max_memory: int | None = None):
    from flexh2o.profiling.local_profile import ensure_local_profile  # measuring pulls in the engine
    return ensure_local_profile(device, offload_dir, max_memory=max_memory)


def cached_local_profile(device, dtype: str):
    """The cached local profile of this kind of device, if it knows the run's dtype; else None (a run
    that is told its policy does not measure the machine just to predict it)."""
    try:
        profile = load_profile(LOCAL)
    except UsageError:
        return None
    return profile if profile is not None and profile.device == device.type and profile.knows(dtype) else None


def planned_policy(args, policy, spec, dtype: str, caps: dict, profile, offload_dir: str):
    """The policy the cost model predicts fastest for this run, within what the pre-flight admits."""
    if not profile.knows(dtype):
        raise UsageError("--dtype", f"the local profile has no figures for {dtype} (it has "
                         f"{', '.join(sorted(profile.matmul_flops))}): give --gpu-batch-size and a placement to run it")
    limits = plan_capacities(profile, offload_dir, caps.get("gpu_mem"), caps.get("cpu_mem"), caps.get("disk_mem"),
                             caps.get("max_memory"), dtype)
    total, what = args.batch, "sequences of --batch"
    if args.prompts_file:
        total, what = len(read_lines(args.prompts_file)), "prompts of --prompts-file"
        if args.batch is not None and args.batch != total:
            raise UsageError("--batch", f"is {args.batch}, but --prompts-file holds {total} prompts")
    if total is not None and args.max_batch is not None and args.max_batch < total:
        raise UsageError("--max-batch", f"is {args.max_batch}, below the {total} {what}")
    if total is not None and args.num_gpu_batches is not None and total % args.num_gpu_batches:
        raise UsageError("--num-gpu-batches", f"{args.num_gpu_batches} does not divide the {total} {what}")
    plan = search(spec, args.prompt_len, args.gen_len, profile, limits, policy, dtype=dtype,
                  allow_compression=args.allow_compression, max_batch=args.max_batch, total_batch=total,
                  num_gpu_batches=None if args.num_gpu_batches is None else (args.num_gpu_batches,))
    if plan is None:
        raise UsageError("/".join(f"--{t}-mem" for t in limits["given"]) or "--model",
                         f"no batch size or placement of {spec.name} with {args.prompt_len}+{args.gen_len} tokens "
                         f"fits this machine ({describe_caps(limits, profile.device)} free)")
    p = plan.predicted
    say(f"note: planned with the local hardware profile ({local_cache_path()}): {' '.join(run_flags(plan.policy))} "
        f"(predicted total {p.total_throughput:.3f} token/s: {duration(p.total_seconds)} to generate, decode "
        f"bound by {p.bottleneck['decode']}); give "
        "--gpu-batch-size or --weights/--cache/--act to choose")
    return plan.policy


def planned_stage_policy(args, policy, spec, dtype: str, caps: dict, profile, offload_dir: str, stage):
    """A pipeline stage's policy (pipeline.py): the replica's first stage plans every stage of it as a
    machine like its own within the same caps, for the replica's own records (planning/pipeline_plan.py),
    and hands the plan to its other stages through the store; each takes its own stage's placement
    and the common batch shape. (A replica with nothing left to do plans nothing: none of its stages
    asks.)"""
    import json

    from flexh2o.planning.pipeline_plan import plan_pipeline
    from flexh2o.engine.policy import Policy
    peers, key = stage.peers, f"pipeline_plan/{stage.first_rank}"
    if stage.is_first:
        if not profile.knows(dtype):
            raise UsageError("--dtype", f"the local profile has no figures for {dtype}: give --gpu-batch-size, "
                             "--num-gpu-batches and a placement to run it")
        link = profile.link_bandwidth
        if link is None:  # a profile measured before links were
            from flexh2o.profiling.link import link_rate
            link = link_rate()
        limits = plan_capacities(profile, offload_dir, caps.get("gpu_mem"), caps.get("cpu_mem"), caps.get("disk_mem"),
                                 caps.get("max_memory"), dtype)
        plan = plan_pipeline(spec, args.prompt_len, args.gen_len, profile, limits, policy, stage.count, link, dtype,
                             args.allow_compression, args.max_batch)
        if plan is None:
            raise UsageError("/".join(f"--{t}-mem" for t in limits["given"]) or "--model",
                             f"no batch of {spec.name} with {args.prompt_len}+{args.gen_len} tokens fits every one "
                             f"of {stage.count} stages like this machine ({describe_caps(limits, profile.device)})")
        say(f"note: planned {stage.count} pipeline stages with the local hardware profile: batch {plan.batch}, "
            + "; ".join(f"stage {s} (layers {p.layers.start}-{p.layers.stop - 1}) {' '.join(run_flags(p.policy))}"
                        for s, p in enumerate(plan.stages))
            + f" (predicted total {plan.throughput:.3f} token/s)")
        peers.store.set(key, json.dumps([p.policy.to_dict() for p in plan.stages]))
    peers.wait_for([key])
    return Policy(**json.loads(peers.store.get(key))[stage.index])

