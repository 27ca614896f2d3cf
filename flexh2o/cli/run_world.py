"""One rank of a `torchrun` world running `python -m flexh2o.run` (distributed.py): stage
world.stage of replica world.replica.

The ranks agree on the run's settings first (before any weight loads); then the stages of each
replica join the process group their hidden states and tokens travel over (pipeline.py), and each
rank runs its share: a dataset job's records dealt to its replica (jobs/replicas.py), or, with one
replica, the one-block mode's batch through the pipeline. An error on any rank reaches every other
rank, and another rank's error or death stops this one.
"""

import os

import psutil
import torch

from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.cli.distributed import Peers
from flexh2o.common.errors import UsageError
from flexh2o.jobs.cli import job_settings, run_job
from flexh2o.jobs.replicas import Replica
from flexh2o.engine.pipeline import check_stage_count, join_pipeline
from flexh2o.engine.policy import placement_flag
from flexh2o.runs.setup import dtype_name
from flexh2o.common.signals import Stopped, stop_for, stopped_for


def check_world_flags(args, world, spec, planning: bool):
    if world.replicas > 1 and not args.input:
        raise UsageError("--input", f"a torchrun world of {world.replicas} replicas splits a dataset job's records: "
                         "give --input FILE and --output OUT.jsonl (or --pipeline-stages "
                         f"{world.size} for one pipeline over every process)")
    if world.stages > 1 and not planning and (args.gpu_batch_size is None or placement_flag(args) is None):
        raise UsageError("--pipeline-stages", "give --gpu-batch-size and the placement (--weights/--cache/--act or "
                         "--percent) together, or neither (every stage then planned)")
    check_stage_count(world.stages, spec)


MAX_PEER_TIMEOUT = 365 * 24 * 3600  # seconds; far past any wait, short of what the store's timers hold


def check_peer_timeout(seconds: float):
    """Checked on every run, one process or a world: inf or nan would overflow the rendezvous's timer
    on every rank."""
    if not 0 < seconds <= MAX_PEER_TIMEOUT:  # (false for nan too)
        raise UsageError("--peer-timeout", f"must be a number of seconds above 0 and at most {MAX_PEER_TIMEOUT} "
                         f"(a year), got {seconds:g}")


def world_settings(args, spec, weights_dir, device, dtype) -> dict:
    """What every rank must run with alike (the model's files too: each node reads its own copy)."""
    settings = {"device": device.type, "pipeline_stages": args.pipeline_stages,
                "gpu_batch_size": args.gpu_batch_size, "num_gpu_batches": args.num_gpu_batches,
                **job_settings(args, spec, dtype_name(dtype, device), model_sha256(weights_dir))}
    if args.input:
        settings["output"] = os.path.abspath(args.output)
    else:
        settings.update(prompt_len=args.prompt_len, prompts_file=args.prompts_file, dummy=args.dummy)
    return settings


def run_in_world(args, world, policy, spec, weights_dir, device, dtype, caps, planning, run_block) -> int:
    check_world_flags(args, world, spec, planning)
    if device.type == "cuda":  # one GPU per process on its node
        if world.local_size > torch.cuda.device_count():
            raise UsageError("--nproc-per-node", f"{world.local_size} processes on a node with "
                             f"{torch.cuda.device_count()} GPUs: give at most one process per GPU")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)  # (pinned memory and caches would open a context on GPU 0 otherwise)
    if world.local_size > 1 and "max_memory" not in caps and "cpu_mem" not in caps:
        caps["max_memory"] = psutil.virtual_memory().available // world.local_size  # the node's RAM, shared
    if world.rank > 0:
        args.quiet = True  # one progress bar, rank 0's
        if args.json_out:
            stem, ext = os.path.splitext(args.json_out)
            args.json_out = f"{stem}.rank{world.rank}{ext}"
    peers = Peers.join(world, args.peer_timeout, stop_for)
    try:
        # Every rank compares the same settings and refuses alike: not told as a failure, which
        # could stop a rank before it says so itself.
        peers.agree(world_settings(args, spec, weights_dir, device, dtype))
    except BaseException:
        peers.close()
        raise
    try:
        stage = join_pipeline(world, peers) if world.stages > 1 else None
        if args.input:
            return run_job(args, policy, spec, weights_dir, device, dtype, caps, planning,
                           Replica(peers, args.output, stage))
        code = run_block(args, policy, spec, weights_dir, device, dtype, caps, planning, stage, world.rank == 0)
        peers.finished()
        if world.rank == 0:
            peers.wait_all_finished()  # (its process may host the store the others still use)
        return code
    except Stopped as e:
        if stopped_for() is None:  # a signal to this rank alone: the others hear of it at once
            peers.fail(f"stopped by {e}")
        raise
    except BaseException as e:
        peers.fail(str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}")
        raise
    finally:
        peers.close()
