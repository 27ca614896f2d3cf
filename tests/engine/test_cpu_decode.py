"""Whole decode steps on the CPU (engine/cpu_decode.py): taken where nothing moves and no weight
widens, the same bits as the schedule's unit-by-unit steps, and left alone otherwise."""

import pytest
import torch

from flexh2o import Policy
from flexh2o.compression.kernel_choice import MAX_ROWS
from flexh2o.engine.schedule import Schedule
from conftest import count_calls, generate_leaving_nothing
from test_llama_decode import llama  # noqa: F401 (the tiny Llama, a fixture)


def run(llama, tmp_path, monkeypatch, policy, batch, whole: bool):
    """Scores of a greedy run, and how many token steps ran whole and unit by unit."""
    torch.manual_seed(batch)
    ids = torch.randint(3, 128, (batch, 5))
    with monkeypatch.context() as patch:
        if not whole:
            patch.setattr(Schedule, "use_whole_steps", lambda self: None)
        calls = count_calls(patch, Schedule, ["whole_token", "token"])
        out = generate_leaving_nothing(llama, policy, ids, torch.ones_like(ids), tmp_path, 6)
    return out, calls


@pytest.mark.parametrize("compress", [True, False], ids=["blocks-as-stored", "full-width"])
def test_whole_steps_give_the_same_bits_as_unit_by_unit(llama, tmp_path, monkeypatch, compress):
    policy = Policy(gpu_batch_size=2, compress_weight=compress)
    own, unit_calls = run(llama, tmp_path, monkeypatch, policy, 2, whole=False)
    whole, whole_calls = run(llama, tmp_path, monkeypatch, policy, 2, whole=True)
    assert unit_calls == {"whole_token": 0, "token": 6}
    assert whole_calls == {"whole_token": 5, "token": 1}  # every decode step; the prompt's unit by unit
    assert torch.equal(whole.sequences, own.sequences)
    for mine, theirs in zip(whole.scores, own.scores):
        assert torch.equal(mine, theirs)


def test_a_step_that_would_widen_a_weight_runs_unit_by_unit(llama, tmp_path, monkeypatch):
    """Past the as-stored kernel's rows a weight is widened into a pooled buffer for the step; a
    whole step would hold every layer's at once, more than the pool has."""
    batch = MAX_ROWS["groups"] + 1
    out, calls = run(llama, tmp_path, monkeypatch, Policy(gpu_batch_size=batch, compress_weight=True), batch,
                     whole=True)
    assert calls == {"whole_token": 0, "token": 6}
    assert out.sequences.shape == (batch, 5 + 6)


def test_a_streamed_cache_keeps_unit_by_unit_steps(llama, tmp_path, monkeypatch):
    policy = Policy(gpu_batch_size=2, compress_weight=True, cache_gpu_percent=0, cache_cpu_percent=0)
    _, calls = run(llama, tmp_path, monkeypatch, policy, 2, whole=True)
    assert calls == {"whole_token": 0, "token": 6}
