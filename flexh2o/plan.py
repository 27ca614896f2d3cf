"""Command line: python -m flexh2o.plan --model opt-30b --hardware t4 --prompt-len 512 --gen-len 32

Picks the batch size, placement and switches with the best predicted throughput for a job on a
hardware profile, and prints the flexh2o.run flags that reproduce it (JSON with --json-out).
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse
import time

from flexh2o.common.errors import OneLineErrorParser, UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import add_kv_flags
from flexh2o.host.hardware import LOCAL, load_profile, shipped
from flexh2o.common.output_files import check_output_file


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.plan", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--model", default="opt-125m", help="as for flexh2o.run")
    p.add_argument("--hardware", default=LOCAL,
                   help=f"profile: {', '.join(shipped() + [LOCAL])} (measured here, profiling first if needed) "
                        "or a path to a profile JSON")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N", help="tokens per prompt")
    p.add_argument("--gen-len", type=int, default=32, metavar="N", help="tokens generated per prompt")
    add_kv_flags(p)
    p.add_argument("--allow-compression", action="store_true",
                   help="let the plan store weights and/or cache as 4-bit groups")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="plan for I/O not overlapped")
    p.add_argument("--max-batch", type=int, default=None, metavar="N", help="largest batch (sequences) to consider")
    p.add_argument("--batch", type=int, default=None, metavar="N", help="plan for exactly this many sequences")
    p.add_argument("--dtype", default=None, help="float16, bfloat16 or float32: the run's (default: the profile's)")
    for tier in ("gpu", "cpu", "disk"):
        p.add_argument(f"--{tier}-mem", metavar="SIZE", help=f"cap on the {tier} tier (default: the profile's)")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="where the local profile's disk is measured and found free")
    p.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                   help="plan a pipeline of S stages, each a machine like --hardware with these caps (pipeline.py)")
    p.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/s",
                   help="with --pipeline-stages: the link between stages (default: the profile's link_bandwidth)")
    p.add_argument("--json-out", metavar="FILE", help="write the plan (policy, predicted throughput) as JSON here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return plan(args)
    except UsageError as e:
        say(f"error: {e}")
        return 2


def load_or_measure(name: str, offload_dir: str):
    profile = load_profile(name)
    if profile is None:  # the local profile, not measured yet
        from flexh2o.profiling.local_profile import ensure_local_profile
        say("note: no local hardware profile yet: measuring this machine first (python -m flexh2o.profile)")
        profile = ensure_local_profile(None, offload_dir)
    return profile


def plan(args) -> int:
    # Imported once the flags parsed: torch is among them, and --help answers without it.
    from flexh2o.engine.preflight import parse_size
    from flexh2o.models import resolve_model
    from flexh2o.planning.planner import describe_caps, describe_prediction, plan_capacities, run_flags
    from flexh2o.planning.search import search
    from flexh2o.engine.policy import Policy
    from flexh2o.cli.run_main import check_positive, save_json
    from flexh2o.offload.offload_dir import default_offload_dir
    check_positive(args)
    for flag in ("max_batch", "batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}", f"must be a positive integer, got {getattr(args, flag)}")
    if args.dtype is not None and args.dtype not in ("float16", "bfloat16", "float32"):
        raise UsageError("--dtype", f"expected float16, bfloat16 or float32, got {args.dtype!r}")
    base = Policy(kv_policy=args.kv_policy, hh_ratio=args.hh_ratio, recent_ratio=args.recent_ratio,
                  overlap=args.overlap)
    spec, _ = resolve_model(args.model)
    if args.prompt_len + args.gen_len > spec.max_positions:
        raise UsageError("--prompt-len/--gen-len", f"prompt_len + gen_len = {args.prompt_len + args.gen_len} "
                         f"exceeds the {spec.max_positions} positions of {spec.name}")
    if args.json_out:
        check_output_file("--json-out", args.json_out)
    offload_dir = args.offload_dir or default_offload_dir()
    sizes = [parse_size(getattr(args, f"{t}_mem"), f"--{t}-mem") if getattr(args, f"{t}_mem") is not None else None
             for t in ("gpu", "cpu", "disk")]
    profile = load_or_measure(args.hardware, offload_dir)
    if args.dtype is not None and not profile.knows(args.dtype):
        raise UsageError("--dtype", f"the {profile.name} profile has no figures for {args.dtype} (it has "
                         f"{', '.join(sorted(profile.matmul_flops))})")
    caps = plan_capacities(profile, offload_dir, *sizes, dtype=args.dtype)
    if args.pipeline_stages != 1:
        return plan_stages(args, spec, profile, caps, base)
    start = time.perf_counter()
    found = search(spec, args.prompt_len, args.gen_len, profile, caps, base, dtype=args.dtype,
                     allow_compression=args.allow_compression, max_batch=args.max_batch, total_batch=args.batch)
    seconds = time.perf_counter() - start
    if found is None:
        raise UsageError("/".join(f"--{t}-mem" for t in caps["given"]) or "--model",
                         f"no policy of {spec.name} with {args.prompt_len}+{args.gen_len} tokens fits {profile.name} "
                         f"({describe_caps(caps, profile.device)})")
    command = " ".join(["python -m flexh2o.run", f"--model {args.model}", f"--prompt-len {args.prompt_len}",
                        f"--gen-len {args.gen_len}"] + run_flags(found.policy)
                       + [f"--{t}-mem {getattr(args, f'{t}_mem')}" for t in caps["given"]]
                       + ([f"--dtype {args.dtype}"] if args.dtype else []))
    print(f"plan for {spec.name} on {profile.name} ({describe_caps(caps, profile.device)}), "
          f"{args.prompt_len} + {args.gen_len} tokens, batch {found.policy.batch_size} "
          f"({found.policy.gpu_batch_size} x {found.policy.num_gpu_batches})")
    print(command)
    print("\n".join(describe_prediction(found.predicted)))
    print(f"searched {found.candidates:,} policies in {seconds:.1f} s")
    if args.json_out:
        return save_json(args.json_out, {
            "model": spec.name, "hardware": profile.name, "hardware_source": profile.source,
            "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "capacities": {t: caps[t] for t in ("gpu", "cpu", "disk")},
            "policy": found.policy.to_dict(), "predicted": found.predicted.to_dict(), "command": command,
            "searched": found.candidates, "search_seconds": seconds})
    return 0


def plan_stages(args, spec, profile, caps, base) -> int:
    """--pipeline-stages: each stage's placement and the pipeline's projected throughput."""
    from flexh2o.planning.pipeline_plan import plan_pipeline
    from flexh2o.planning.planner import describe_caps, run_flags
    from flexh2o.cli.run_main import save_json
    from flexh2o.engine.pipeline import check_stage_count
    stages = args.pipeline_stages
    check_stage_count(stages, spec)
    if args.link_bandwidth is not None and args.link_bandwidth <= 0:
        raise UsageError("--link-bandwidth", f"must be a positive number of GB/s, got {args.link_bandwidth:g}")
    link = args.link_bandwidth * 1e9 if args.link_bandwidth is not None else profile.link_bandwidth
    if link is None:
        raise UsageError("--link-bandwidth", f"the {profile.name} profile has no link_bandwidth: give the link "
                         "between stages in GB/s (or measure this machine's: python -m flexh2o.profile --force)")
    start = time.perf_counter()
    found = plan_pipeline(spec, args.prompt_len, args.gen_len, profile, caps, base, stages, link, args.dtype,
                          args.allow_compression, args.max_batch, args.batch)
    seconds = time.perf_counter() - start
    if found is None:
        raise UsageError("/".join(f"--{t}-mem" for t in caps["given"]) or "--model",
                         f"no batch of {spec.name} with {args.prompt_len}+{args.gen_len} tokens fits every one of "
                         f"{stages} stages on {profile.name} ({describe_caps(caps, profile.device)} each)")
    shape = found.stages[0].policy
    print(f"plan for {spec.name} on {stages} x {profile.name} ({describe_caps(caps, profile.device)} each, link "
          f"{link / 1e9:.2f} GB/s), {args.prompt_len} + {args.gen_len} tokens, batch {found.batch} "
          f"({shape.gpu_batch_size} x {shape.num_gpu_batches}) in {found.micro_batches} micro-batches")
    for s, stage in enumerate(found.stages):
        print(f"stage {s}: layers {stage.layers.start}-{stage.layers.stop - 1}, "
              f"{' '.join(run_flags(stage.policy)[2:])}: {stage.seconds:.2f} s per micro-batch over the run")
    print(f"predicted: total {found.throughput:.3f} token/s ({found.seconds:.2f} s); the busiest stage idles "
          f"{found.bubble_share:.0%} of it; hidden states between stages {found.link_seconds:.2f} s per micro-batch")
    print(f"planned in {seconds:.1f} s")
    if args.json_out:
        return save_json(args.json_out, {
            "model": spec.name, "hardware": profile.name, "stages": stages, "link_bandwidth": link,
            "prompt_len": args.prompt_len, "gen_len": args.gen_len, "batch": found.batch,
            "micro_batches": found.micro_batches, "total_throughput": found.throughput, "seconds": found.seconds,
            "bubble_share": found.bubble_share, "link_seconds": found.link_seconds,
            "stage_plans": [{"layers": [st.layers.start, st.layers.stop], "policy": st.policy.to_dict(),
                             "seconds": st.seconds} for st in found.stages]})
    return 0


if __name__ == "__main__":
    from flexh2o.common.signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.cli.run_main",))
