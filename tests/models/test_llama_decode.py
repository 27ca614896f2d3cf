"""A Llama layer's decode step in one C call, and a run of whole layers in one (models/llama_decode.py):
taken where a float32 CPU run multiplies its weights as stored over a full cache, and the same bits
as the layer's own kernels one by one, in fixed blocks, in refilled slots, with int8 activations
and at every batch size."""

import pytest
import torch
from transformers import LlamaConfig

import flexh2o.models.llama_layers as llama_layers
from flexh2o.models.llama_decode import LayersInOneCall
from flexh2o import Engine, Policy, native
from conftest import generate_leaving_nothing
from test_llama import make_tiny_llama
from test_slot_pool import refilled, requests

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Grouped heads (2 query heads a KV head), head_dim 16, widths that 4-bit groups of 64 divide."""
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_llama(directory, LlamaConfig, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128)
    return directory


def one_call(monkeypatch, halves: bool, layers: bool = False) -> dict:
    """The halves of layers whose decode step ran in C, counted: each half in its own call (halves),
    or whole layers in one call for the run of them (layers; "runs": how many such calls); each
    way never taken where it is off."""
    taken = {"attention": 0, "mlp": 0, "runs": 0}

    def counted(name, step):
        def wrapper(*args):
            done = step(*args) if halves else False
            taken[name] += done
            return done
        return wrapper
    monkeypatch.setattr(llama_layers, "attention_step", counted("attention", llama_layers.attention_step))
    monkeypatch.setattr(llama_layers, "mlp_step", counted("mlp", llama_layers.mlp_step))
    whole = LayersInOneCall.step

    def in_one_call(run, hidden, step):
        done = whole(run, hidden, step) if layers else False
        taken["attention"] += done * len(run.attention)
        taken["mlp"] += done * len(run.mlp)
        taken["runs"] += done
        return done
    monkeypatch.setattr(LayersInOneCall, "step", in_one_call)
    return taken


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_fixed_blocks_give_the_same_bits_in_one_call(llama, tmp_path, monkeypatch, batch, int8):
    torch.manual_seed(batch)
    ids = torch.randint(3, 128, (batch, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a padded row: its empty slots are skipped alike
    policy = Policy(gpu_batch_size=batch, compress_weight=True, int8_activations=int8)
    with monkeypatch.context() as patch:
        one_call(patch, halves=False)
        own = generate_leaving_nothing(llama, policy, ids, mask, tmp_path, 6)
    for layers, runs in ((False, 0), (True, 5)):
        with monkeypatch.context() as patch:
            taken = one_call(patch, halves=True, layers=layers)
            fused = generate_leaving_nothing(llama, policy, ids, mask, tmp_path, 6)
        assert taken == {"attention": 2 * 5, "mlp": 2 * 5, "runs": runs}  # 2 layers, every decode step
        assert torch.equal(fused.sequences, own.sequences)
        for mine, theirs in zip(fused.scores, own.scores):
            assert torch.equal(mine, theirs)


def test_refilled_slots_give_the_same_tokens_in_one_call(llama, tmp_path, monkeypatch):
    reqs = requests(9, seed=3)
    policy = Policy(gpu_batch_size=3, compress_weight=True)
    with monkeypatch.context() as patch:
        one_call(patch, halves=False)
        own, _, _ = refilled(llama, reqs, policy, tmp_path)
    for layers in (False, True):
        with monkeypatch.context() as patch:
            taken = one_call(patch, halves=True, layers=layers)
            fused, _, _ = refilled(llama, reqs, policy, tmp_path)
        assert taken["attention"] > 0 and taken["mlp"] > 0 and (taken["runs"] > 0) == layers
        assert fused == own


@pytest.mark.parametrize("policy", [dict(compress_weight=False), dict(compress_weight=True, hh_ratio=0.3),
                                    dict(compress_weight=True, compress_cache=True)],
                         ids=["weights-in-full-width", "h2o", "compressed-cache"])
def test_other_runs_keep_the_layers_own_path(llama, tmp_path, monkeypatch, policy):
    taken = one_call(monkeypatch, halves=True, layers=True)
    with Engine.from_pretrained(llama, policy=Policy(gpu_batch_size=2, **policy), device="cpu",
                                dtype=torch.float32) as engine:
        engine.generate(torch.randint(3, 128, (2, 6)), max_new_tokens=4, eos_token_id=None)
    assert taken["attention"] == 0
    assert taken["mlp"] == (2 * 3 if policy.get("compress_weight") else 0)  # the MLP half needs no cache
