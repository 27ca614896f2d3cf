"""Pipeline stages that hold few layers (issue 61): a 2-layer OPT of 512 positions, whose embedding
weighs as much as the rest, in 2 stages, and a 4-layer Llama in 4; each stage holds a decoder
layer, and the job writes what one process writes, also after a stage was killed. More stages than
decoder layers are refused in one line on every rank before any loads."""

import os
import signal

import pytest
import torch
from transformers import LlamaConfig

import flexh2o.run
from flexh2o import Engine
from flexh2o.common.errors import UsageError
from flexh2o.engine.pipeline import Stage
from conftest import last_line, make_tiny_opt, with_word_tokenizer
from test_distributed import finish, start_world
from test_job import prompt, records, run
from test_job_resume import wait_for_lines
from test_llama import make_tiny_llama

PLACED = ["--gpu-batch-size", "2", "--weights", "gpu=100", "--cache", "gpu=100"]
JOB = ["--quiet", "--gen-len", "8"]


@pytest.fixture(scope="module")
def opt_512(tmp_path_factory):
    """A 2-layer OPT (hidden 32, 4 heads) of 512 positions, with a tokenizer."""
    weights = tmp_path_factory.mktemp("opt_512_weights")
    make_tiny_opt(str(weights), seed=4, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                  max_position_embeddings=512)
    return with_word_tokenizer(str(weights), tmp_path_factory.mktemp("opt_512"))


@pytest.fixture(scope="module")
def llama_4(tmp_path_factory):
    """A 4-layer Llama (hidden 32, 4 heads, 2 KV heads), with a tokenizer."""
    weights = tmp_path_factory.mktemp("llama_4_weights")
    make_tiny_llama(str(weights), LlamaConfig, seed=6, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
    return with_word_tokenizer(str(weights), tmp_path_factory.mktemp("llama_4"))


def write_prompts(path, count: int):
    path.write_text("\n".join(prompt(1 + (7 * i) % 25, i) for i in range(count)) + "\n")
    return path


def alone_and_staged(model, prompts, tmp_path, stages: int, flags: list) -> tuple:
    """The job's records from one process and from `stages` processes, one stage each."""
    alone, staged = tmp_path / "alone.jsonl", tmp_path / "staged.jsonl"
    assert run(model, prompts, alone, *JOB[1:], *PLACED, *flags) == 0
    results = finish(start_world(model, prompts, staged, stages, lambda rank: [*PLACED, *flags, "--pipeline-stages",
                                                                              str(stages)], job=JOB))
    assert [code for code, _, _ in results] == [0] * stages, results
    return records(alone), records(staged)


# refilled slots joining every step, or every 2 (make test-all)
@pytest.mark.parametrize("flags", [[], pytest.param(["--join-every", "2"], marks=pytest.mark.slow)])
def test_a_two_layer_opt_with_a_heavy_embedding_in_two_stages(opt_512, tmp_path, flags):
    want, got = alone_and_staged(opt_512, write_prompts(tmp_path / "prompts.txt", 8), tmp_path, 2, flags)
    assert len(want) == 8 and got == want


@pytest.mark.slow  # four processes: out of make test's 10 minutes (make test-all runs it)
def test_a_four_layer_llama_in_four_stages(llama_4, tmp_path):
    want, got = alone_and_staged(llama_4, write_prompts(tmp_path / "prompts.txt", 8), tmp_path, 4,
                                 ["--num-gpu-batches", "4"])
    assert len(want) == 8 and got == want


@pytest.mark.parametrize("stages", [5, 8])
def test_more_stages_than_decoder_layers_are_refused_on_every_rank_before_loading(llama_4, tmp_path, monkeypatch,
                                                                                  capsys, stages):
    """Each rank refuses by itself, before it joins the others (none is started here) or loads."""
    prompts, out = write_prompts(tmp_path / "prompts.txt", 4), tmp_path / "out.jsonl"
    monkeypatch.setattr(Engine, "load", lambda *args, **kwargs: pytest.fail("a rank loaded the model"))
    for rank in range(stages):
        for name, value in (("RANK", rank), ("WORLD_SIZE", stages), ("LOCAL_RANK", rank),
                            ("LOCAL_WORLD_SIZE", stages)):
            monkeypatch.setenv(name, str(value))
        code = flexh2o.run.main(["--model", str(llama_4), "--input", str(prompts), "--output", str(out), *JOB,
                                 *PLACED, "--pipeline-stages", str(stages)])
        assert code == 2
        assert last_line(capsys.readouterr().err) == f"error: --pipeline-stages: must be between 1 and the 4 " \
            f"decoder layers of {os.path.basename(llama_4)} (each stage holds at least one), got {stages}"
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out.jsonl")]


def test_the_python_api_refuses_a_stage_without_a_decoder_layer(llama_4):
    with pytest.raises(UsageError, match="--pipeline-stages: must be between 1 and the 4 decoder layers"):
        Engine.load(str(llama_4), device="cpu", dtype=torch.float32, stage=Stage(4, 5, 0, None))


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_a_killed_stage_of_a_heavy_embedding_split_is_finished_by_the_same_command(opt_512, tmp_path):
    prompts = write_prompts(tmp_path / "many.txt", 40)
    alone, out = tmp_path / "alone.jsonl", tmp_path / "out.jsonl"
    flags = [*PLACED, "--join-every", "2", "--peer-timeout", "3"]
    assert run(opt_512, prompts, alone, *JOB[1:], *flags) == 0
    staged = [*flags, "--pipeline-stages", "2"]
    procs = start_world(opt_512, prompts, out, 2, lambda rank: staged, job=JOB)
    reached = wait_for_lines(procs[1], tmp_path / "out.jsonl.parts" / "replica-0.jsonl", 2)
    procs[1].send_signal(signal.SIGKILL)
    (code0, _, err0), (code1, _, _) = finish(procs, timeout=60)
    assert reached, "the pipeline ended before it could be killed"
    assert code1 == -signal.SIGKILL and code0 == 1 and "rank 1" in last_line(err0), err0
    results = finish(start_world(opt_512, prompts, out, 2, lambda rank: staged, job=JOB))
    assert [code for code, _, _ in results] == [0, 0], results
    assert records(out) == records(alone)
