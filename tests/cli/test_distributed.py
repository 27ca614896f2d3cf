"""A torchrun world of data-parallel replicas over a dataset job: the world checked before any weight
loads, the records dealt, the parts merged into what one process writes, and a rank that dies or
fails stopping the others (distributed.py, jobs/replicas.py)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from flexh2o.cli.distributed import World, world_from_env
from flexh2o.common.errors import UsageError
from flexh2o.jobs.input import Entry
from flexh2o.jobs.replicas import deal, part_path
from conftest import REPO, last_line
from test_job import prompt, records, run
from test_job_resume import wait_for_lines

JOB = ["--quiet", "--gpu-batch-size", "2", "--gen-len", "8"]  # the default dtype: records as in one process


def test_without_torchrun_the_world_is_one_process():
    assert world_from_env(1, {}) == World()
    with pytest.raises(UsageError, match="--pipeline-stages: 2 stages need 2 processes"):
        world_from_env(2, {})


def test_a_replicas_stages_are_neighbouring_ranks():
    env = {"WORLD_SIZE": "6", "RANK": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}
    world = world_from_env(3, env)
    assert (world.replicas, world.replica, world.stage, world.local_rank) == (2, 1, 1, 1)


@pytest.mark.parametrize("size,stages,message", [(3, 2, "2 does not divide the world of 3"),
                                                 (4, 0, "must be a positive integer")])
def test_a_world_the_stages_do_not_fit_is_refused_on_every_rank(size, stages, message):
    for rank in range(size):
        env = {"WORLD_SIZE": str(size), "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)}
        with pytest.raises(UsageError, match=message):
            world_from_env(stages, env)


def test_each_record_goes_to_one_replica_and_each_gets_every_length():
    entries = [Entry(i, f"r{i}", i, 0, (i * 7) % 23, 4, None, None) for i in range(50)]
    shares = [deal(entries, 3, r) for r in range(3)]
    assert sorted(e.number for share in shares for e in share) == list(range(50))
    for share in shares:
        assert [e.number for e in share] == sorted(e.number for e in share)  # input order within a share
        assert abs(sum(e.prompt_tokens for e in share) - sum(e.prompt_tokens for e in entries) / 3) <= 23


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_world(model_dir, input_path, output, size: int, flags_of_rank=lambda rank: [], job=JOB) -> list:
    """`size` ranks of `python -m flexh2o.run`, each told its place as torchrun tells it (one thread each)."""
    port, procs = free_port(), []
    for rank in range(size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flexh2o.run", "--model", str(model_dir), "--input", str(input_path), "--output",
             str(output), *job, *flags_of_rank(rank)], cwd=REPO, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, timeout=240) -> list:
    """(exit code, stdout, stderr) of each rank."""
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


@pytest.fixture
def job_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompt(1 + (5 * i) % 19, i) for i in range(14)) + "\n")
    return path


@pytest.mark.parametrize("flags", [pytest.param([], marks=pytest.mark.slow),  # make test-all
                                   ["--hh-ratio", "0.3", "--weights", "gpu=0,cpu=50,disk=50"]])
def test_two_replicas_merge_into_what_one_process_writes(model_with_tokenizer, job_prompts, tmp_path, flags):
    alone, merged = tmp_path / "alone.jsonl", tmp_path / "merged.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, *JOB[1:], *flags) == 0
    results = finish(start_world(model_with_tokenizer, job_prompts, merged, 2, lambda rank: flags))
    assert [code for code, _, _ in results] == [0, 0], results
    assert "merged: 14 of 14 records from 2 replicas" in results[0][1]
    assert records(merged) == records(alone)
    ids = [json.loads(line).get("custom_id", json.loads(line).get("id")) for line in open(merged)]
    assert ids == [json.loads(line).get("custom_id", json.loads(line).get("id")) for line in
                   sorted(open(alone), key=lambda line: int(json.loads(line)["id"]))]  # input order
    assert not os.path.exists(str(merged) + ".parts")


def test_ranks_given_other_settings_refuse_before_loading(model_with_tokenizer, job_prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    results = finish(start_world(model_with_tokenizer, job_prompts, out, 2,
                                 lambda rank: ["--hh-ratio", "0.5"] if rank == 1 else []))
    for code, _, err in results:
        assert code == 2, err
        assert last_line(err) == "error: --hh-ratio: rank 1 runs with 0.5, rank 0 with None: every rank must run " \
                                 "with the same"


def test_replicas_the_preflight_refuses_write_nothing(model_with_tokenizer, job_prompts, tmp_path):
    """No part, parts folder, settings or lock: the replicas open their parts only once their batch fits."""
    out = tmp_path / "job" / "out.jsonl"
    out.parent.mkdir()
    results = finish(start_world(model_with_tokenizer, job_prompts, out, 2, lambda rank: [
        "--gpu-mem", "1KB", "--weights", "gpu=100", "--offload-dir", str(tmp_path / "off")]))
    refused = [code for code, _, err in results if code == 2 and last_line(err).startswith("error: --gpu-mem")]
    stopped = [code for code, _, err in results if code == 1 and "stopped" in last_line(err)]  # by the other's refusal
    assert refused and len(refused) + len(stopped) == 2, results
    assert os.listdir(out.parent) == []


@pytest.mark.slow  # out of make test's 10 minutes (make test-all): a killed stage below covers the ground
def test_a_rank_that_fails_stops_the_other_naming_it(model_with_tokenizer, job_prompts, tmp_path):
    off = tmp_path / "off"
    results = finish(start_world(model_with_tokenizer, job_prompts, tmp_path / "out.jsonl", 2,
                                 lambda rank: ["--weights", "gpu=0,cpu=100,disk=0", "--offload-dir", str(off)] +
                                 (["--cpu-mem", "1KB"] if rank == 1 else [])))
    (code0, _, err0), (code1, _, err1) = results
    assert code1 == 2 and last_line(err1).startswith("error: --cpu-mem")
    assert code0 == 1
    assert last_line(err0).startswith(f"error: rank 1 failed: {last_line(err1)[len('error: '):]}; this rank stopped")
    assert not off.exists() or not os.listdir(off)


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_a_killed_rank_stops_the_other_and_the_same_command_finishes_the_job(model_with_tokenizer, tmp_path):
    many = tmp_path / "many.txt"
    many.write_text("\n".join(prompt(1 + (7 * i) % 25, i) for i in range(40)) + "\n")
    alone, out, off = tmp_path / "alone.jsonl", tmp_path / "out.jsonl", tmp_path / "off"
    flags = ["--weights", "gpu=0,cpu=50,disk=50", "--offload-dir", str(off), "--peer-timeout", "3"]
    assert run(model_with_tokenizer, many, alone, *JOB[1:], *flags) == 0
    procs = start_world(model_with_tokenizer, many, out, 2, lambda rank: flags)
    reached = wait_for_lines(procs[1], tmp_path / "out.jsonl.parts" / "replica-1.jsonl", 2)
    procs[1].send_signal(signal.SIGKILL)
    (code0, _, err0), (code1, _, _) = finish(procs)
    assert reached, "rank 1 ended before it could be killed"
    assert code1 == -signal.SIGKILL and code0 == 1
    assert "error: rank 1 gave no sign of life for 3 s (--peer-timeout)" in last_line(err0), err0
    assert "this rank stopped" in last_line(err0)
    # rank 0 removed its offload files; the killed rank could not (the next run on the host does)
    assert [f for f in os.listdir(off) if f.startswith("flexh2o-run-")] == [run_folder(off, procs[1].pid)]
    kept = sum(1 for _ in open(part_path(str(out), 0))) + sum(1 for _ in open(part_path(str(out), 1)))
    assert 2 <= kept < 40
    results = finish(start_world(model_with_tokenizer, many, out, 2, lambda rank: flags))
    assert [code for code, _, _ in results] == [0, 0], results
    assert records(out) == records(alone)
    assert not os.path.exists(off)


def run_folder(off, pid: int) -> str:
    return next(f for f in os.listdir(off) if f.startswith(f"flexh2o-run-{socket.gethostname()}-{pid}-"))


def test_torchrun_starts_the_replicas(model_with_tokenizer, job_prompts, tmp_path):
    alone, merged = tmp_path / "alone.jsonl", tmp_path / "merged.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, *JOB[1:]) == 0
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "flexh2o.run", "--model",
                           str(model_with_tokenizer), "--input", str(job_prompts), "--output", str(merged), *JOB],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert records(merged) == records(alone)


def test_one_process_takes_over_the_parts_replicas_left(model_with_tokenizer, job_prompts, tmp_path, capsys):
    alone, out = tmp_path / "alone.jsonl", tmp_path / "out.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, *JOB[1:]) == 0
    lines = alone.read_text().splitlines(keepends=True)
    for replica, share in enumerate((lines[:3], lines[5:7])):  # what two replicas had written when stopped
        part = part_path(str(out), replica)
        os.makedirs(os.path.dirname(part), exist_ok=True)
        with open(part, "w") as f:
            f.writelines(share)
        with open(part + ".job.json", "w") as f:
            f.write(open(str(alone) + ".job.json").read())
    capsys.readouterr()
    assert run(model_with_tokenizer, job_prompts, out, *JOB[1:]) == 0
    assert "records: 14 (9 written now, 5 already in" in capsys.readouterr().out
    assert records(out) == records(alone)
    assert not os.path.exists(str(out) + ".parts")


PIPELINE = ["--num-gpu-batches", "2", "--weights", "gpu=100,cpu=0,disk=0", "--pipeline-stages", "2"]


# one pipeline of 2 stages; 2 replicas of 2 stages (make test-all)
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pipeline_stages_write_what_one_process_writes(model_with_tokenizer, job_prompts, tmp_path, size):
    alone, merged = tmp_path / "alone.jsonl", tmp_path / "merged.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, *JOB[1:], *PIPELINE[:4]) == 0
    results = finish(start_world(model_with_tokenizer, job_prompts, merged, size, lambda rank: PIPELINE))
    assert [code for code, _, _ in results] == [0] * size, results
    assert records(merged) == records(alone)


def test_a_killed_stage_stops_the_other_naming_it(model_with_tokenizer, tmp_path):
    many = tmp_path / "many.txt"
    many.write_text("\n".join(prompt(1 + (7 * i) % 25, i) for i in range(40)) + "\n")
    out, off = tmp_path / "out.jsonl", tmp_path / "off"
    flags = PIPELINE[:2] + ["--weights", "gpu=0,cpu=50,disk=50", "--offload-dir", str(off), "--peer-timeout", "3",
                            "--pipeline-stages", "2"]
    procs = start_world(model_with_tokenizer, many, out, 2, lambda rank: flags)
    reached = wait_for_lines(procs[1], tmp_path / "out.jsonl.parts" / "replica-0.jsonl", 2)
    procs[1].send_signal(signal.SIGKILL)
    (code0, _, err0), _ = finish(procs, timeout=60)
    assert reached, "the pipeline ended before it could be killed"
    assert code0 == 1 and "rank 1" in last_line(err0) and "this rank stopped" in last_line(err0), err0
    assert [f for f in os.listdir(off) if f.startswith("flexh2o-run-")] == [run_folder(off, procs[1].pid)]


def test_a_pipeline_given_no_batch_or_placement_is_planned_once_for_every_stage(model_with_tokenizer, job_prompts,
                                                                              tmp_path):
    alone, merged = tmp_path / "alone.jsonl", tmp_path / "merged.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, "--gen-len", "8", "--gpu-batch-size", "2") == 0
    results = finish(start_world(model_with_tokenizer, job_prompts, merged, 2, lambda rank: ["--pipeline-stages", "2"],
                                 job=["--quiet", "--gen-len", "8"]))
    assert [code for code, _, _ in results] == [0, 0], results
    assert "note: planned 2 pipeline stages" in results[0][2]
    assert records(merged) == records(alone)


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_a_planned_pipeline_replica_with_nothing_left_lets_the_others_plan_their_own(model_with_tokenizer,
                                                                                     job_prompts, tmp_path):
    """2 replicas of 2 stages, planned; replica 0's share already written (a resumed job): its stages
    skip, replica 1's first stage plans for its own records and the job finishes."""
    from flexh2o.jobs.input import JobInput
    from flexh2o.runs.prompts import load_tokenizer
    alone, out = tmp_path / "alone.jsonl", tmp_path / "out.jsonl"
    assert run(model_with_tokenizer, job_prompts, alone, "--gen-len", "8", "--gpu-batch-size", "2") == 0
    defaults = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    entries = JobInput(str(job_prompts), load_tokenizer(str(model_with_tokenizer)), defaults, 64).entries
    mine = {e.id for e in deal(entries, 2, 0)}
    part = part_path(str(out), 0)
    os.makedirs(os.path.dirname(part))
    with open(part, "w") as f:
        f.writelines(line for line in open(alone) if json.loads(line)["id"] in mine)
    with open(part + ".job.json", "w") as f:
        f.write(open(str(alone) + ".job.json").read())
    results = finish(start_world(model_with_tokenizer, job_prompts, out, 4, lambda rank: ["--pipeline-stages", "2"],
                                 job=["--quiet", "--gen-len", "8"]), timeout=180)
    assert [code for code, _, _ in results] == [0] * 4, results
    assert "note: planned 2 pipeline stages" in results[2][2] and "planned" not in results[0][2]
    assert records(out) == records(alone)


def test_every_stage_slices_the_model_alike_whatever_it_compresses():
    """A planned stage may compress its weights and another not: the slices must not move (OPT-125M
    in 3 stages: by compressed bytes the first would take 6 layers, by full ones 5)."""
    import torch
    from flexh2o import Engine, Policy
    from flexh2o.models import resolve_model
    from flexh2o.planning.pipeline_plan import stage_parts
    from flexh2o.engine.pipeline import Stage
    spec, _ = resolve_model("opt-125m")
    planned = [piece for _, _, piece in stage_parts(spec, 3, 4)]
    held = []
    for compress in (False, True):
        with Engine.load("opt-125m", policy=Policy(compress_weight=compress), device="cpu",
                             dtype=torch.float32, dummy=True, stage=Stage(0, 3, 0, None)) as engine:
            held.append(engine.layer_indices)
    assert held[0] == held[1] == list(planned[0])
