"""What a run is set up with from its flags: the policy (planned, fitted or as given) and the engine.

flexh2o.run's one-block mode and its dataset jobs (jobs/cli.py) share these.
"""

import functools

from flexh2o.offload.offload_dir import check_offload_dir, default_offload_dir
from flexh2o.engine.engine import Engine
from flexh2o.host.devices import default_dtype
from flexh2o.offload.buffers import TIERS
from flexh2o.engine.preflight import capacities, format_size, run_need, weight_need
from flexh2o.common.messages import say
from flexh2o.common.names import duration, tier_label
from flexh2o.planning.placement import WeightNeeds, describe as describe_placement, fits, fitted_placement, no_fit_error
from flexh2o.engine.policy import Policy, placement_flag
from flexh2o.runs.auto_plan import cached_local_profile, local_profile, planned_policy, planned_stage_policy


def choose_policy(args, policy, spec, device, dtype, caps, planning, stage=None):
    """The policy to run (planned by the cost model, or fitted to the machine when no placement is
    given) for args.prompt_len + args.gen_len, and the profile to predict it with (or None);
    sets args.offload_dir where the policy puts something on disk. stage: a pipeline stage's
    (pipeline.py), planned with the others."""
    profile = None
    if planning:
        offload_dir = args.offload_dir or default_offload_dir()
        profile = local_profile(device, offload_dir, caps.get("max_memory"))
        plan = planned_policy if stage is None else functools.partial(planned_stage_policy, stage=stage)
        policy = plan(args, policy, spec, dtype_name(dtype, device), caps, profile, offload_dir)
    elif placement_flag(args) is None:
        policy = fit_default_placement(args, policy, spec, device, dtype, caps)
    if profile is None:
        profile = cached_local_profile(device, dtype_name(dtype, device))
    if args.offload_dir is None and any(policy.disk_percent(kind) > 0 for kind in ("w", "cache", "act")):
        args.offload_dir = default_offload_dir()
        check_offload_dir(args.offload_dir)
    return policy, profile


def dtype_name(dtype, device) -> str:
    """The compute dtype's name as profiles key it: float32, float16, bfloat16."""
    return str(dtype or default_dtype(device)).removeprefix("torch.")


def fit_default_placement(args, policy, spec, device, dtype, caps) -> Policy:
    """No placement flags: everything on the compute device if it fits, else a placement that does."""
    dtype_bytes = (dtype or default_dtype(device)).itemsize
    limits = capacities(device, None, caps.get("gpu_mem"), caps.get("cpu_mem"), caps.get("disk_mem"),
                        caps.get("max_memory"), dtype_name(dtype, device))
    if fits(spec, policy, dtype_bytes, args.prompt_len, args.gen_len, limits, device):
        return policy
    offload_dir = args.offload_dir or default_offload_dir()
    check_offload_dir(offload_dir)
    limits = capacities(device, offload_dir, caps.get("gpu_mem"), caps.get("cpu_mem"), caps.get("disk_mem"),
                        caps.get("max_memory"), dtype_name(dtype, device))
    weights = WeightNeeds(spec, dtype_bytes, device)
    fitted = fitted_placement(spec, policy, dtype_bytes, args.prompt_len, args.gen_len, limits, device, weights)
    if fitted is None:
        raise no_fit_error(spec, policy, dtype_bytes, args.prompt_len, args.gen_len, limits, device, weights)
    if fitted is policy:
        return policy
    say(f"note: everything on the compute device does not fit; placing {describe_placement(fitted)} "
        "(give --weights/--cache/--act or --percent to choose)")
    return fitted


def placement_note(spec, policy, device, dtype, prompt_len: int, gen_len: int, offload_dir, dummy: bool,
                   profile) -> str:
    """One line: the bytes each tier will hold (weights and the KV cache), and where weights go to
    disk, how long writing them should take at the profile's measured disk speed."""
    dtype_bytes = (dtype or default_dtype(device)).itemsize
    weights = weight_need(spec.build_layers(), dtype_bytes, policy, device)
    run = run_need(spec, policy, dtype_bytes, prompt_len, gen_len, device)
    places = {"gpu": f"on the {tier_label('gpu', device.type)}", "cpu": "in CPU memory", "disk": f"on disk ({offload_dir})"}
    where = ", ".join(f"{format_size(weights[t] + run[t])} {places[t]}" for t in TIERS)
    line = f"note: placing {where}; the weights' share: {' / '.join(format_size(weights[t]) for t in TIERS)}"
    if weights["disk"] and profile is not None and profile.disk_write > 0:
        what = "dummy " if dummy else ""
        what += "4-bit weights (quantized first, which may take longer)" if policy.compress_weight else "weights"
        line += (f"; writing {format_size(weights['disk'])} of {what} to disk takes about "
                 f"{duration(weights['disk'] / profile.disk_write)} at its measured {profile.disk_write / 1e9:.2f} GB/s")
    return line


def load_engine(args, spec, policy, device, dtype, caps: dict, dummy: bool, profile=None, stage=None,
                once_it_fits=None) -> Engine:
    """The engine of a run, its weights placed by `policy`, sized for args.prompt_len + args.gen_len.
    Once the pre-flight passed, once_it_fits() runs, if given (a job makes its files there: a refused
    run writes none); then, where anything is placed off the compute device, a note says what goes where."""
    off_device = any(policy.disk_percent(kind) > 0 or getattr(policy, f"{kind}_cpu_percent") > 0
                     for kind in ("w", "cache"))

    def before_loading():
        if once_it_fits is not None:
            once_it_fits()
        if off_device and stage is None:
            say(placement_note(spec, policy, device, dtype, args.prompt_len, args.gen_len, args.offload_dir, dummy,
                               profile))
    return Engine.load(args.model, policy=policy, device=device, dtype=dtype, dummy=dummy, path=args.path,
                       offload_dir=args.offload_dir, progress=args.verbose, seed=args.seed,
                       bypass_page_cache=args.no_page_cache, prompt_len=args.prompt_len, gen_len=args.gen_len,
                       placement_flag=placement_flag(args) or "--weights/--cache/--act",
                       before_loading=before_loading, stage=stage, **caps)
