"""Sampling with a seed, and per-sequence stopping at EOS."""

import pytest
import torch

from flexh2o import Engine, Policy
from flexh2o.engine.sampling import Sampler
from conftest import hf_generate, padded_batch


@pytest.fixture(scope="module")
def engines(tiny_models):
    directory, _ = tiny_models["tiny"]
    make = lambda bs, nb: Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=bs, num_gpu_batches=nb),  # noqa: E731
                                                 device="cpu", dtype=torch.float32)
    return {"4x1": make(4, 1), "2x2": make(2, 2)}


def sample(engine, seed, **kw):
    ids, mask = padded_batch(4, 8, pads=[0, 2, 0, 5], seed=7)
    return engine.generate(ids, mask, max_new_tokens=12, do_sample=True, seed=seed, eos_token_id=None, **kw)


def test_same_seed_repeats(engines):
    assert torch.equal(sample(engines["4x1"], 11), sample(engines["4x1"], 11))


def test_different_seeds_differ(engines):
    assert not torch.equal(sample(engines["4x1"], 11), sample(engines["4x1"], 12))


def test_seed_gives_same_tokens_however_the_batch_is_split(engines):
    assert torch.equal(sample(engines["4x1"], 5, top_k=20, top_p=0.9, temperature=0.8),
                       sample(engines["2x2"], 5, top_k=20, top_p=0.9, temperature=0.8))


def test_top_k_one_is_greedy(engines):
    ids, mask = padded_batch(4, 8, pads=[0, 2, 0, 5], seed=7)
    greedy = engines["4x1"].generate(ids, mask, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(sample(engines["4x1"], 3, top_k=1), greedy)


def test_sampler_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]).clamp_min(1e-30)).repeat(20000, 1)
    tokens = Sampler(do_sample=True, seed=0).pick(logits, torch.rand(20000, dtype=torch.float64,
                                                                     generator=torch.Generator().manual_seed(1)))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(5000, 1)
    tokens = Sampler(do_sample=True, top_p=0.6, seed=0).pick(logits, torch.rand(5000, dtype=torch.float64))
    assert set(tokens.tolist()) == {0, 1}


def test_each_sequence_stops_at_eos_like_transformers(tiny_models):
    directory, model = tiny_models["tiny"]
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=4), device="cpu", dtype=torch.float32)
    ids, mask = padded_batch(4, 8, pads=[0, 1, 2, 3], seed=9)
    free = engine.generate(ids, mask, max_new_tokens=10, eos_token_id=None)
    eos = int(free[0, 8 + 3])  # a token sequence 0 produces at its 4th step
    out = engine.generate(ids, mask, max_new_tokens=10, eos_token_id=eos, output_scores=True)
    ref = hf_generate(model, ids, mask, 10, eos_token_id=eos)
    n = ref.sequences.shape[1]  # transformers stops once every sequence is done
    assert torch.equal(out.sequences[:, :n], ref.sequences)
    assert (out.sequences[:, n:] == 1).all()
    for row in range(4):
        new = out.sequences[row, 8:].tolist()
        if eos in new:
            after = new[new.index(eos) + 1:]
            assert all(t == 1 for t in after), "a finished sequence must emit padding"
    first_eos = out.sequences[0, 8:].tolist().index(eos)
    assert first_eos <= 3
    for mine, theirs in zip(out.scores, ref.scores):
        assert torch.allclose(mine, theirs, atol=1e-4, rtol=0)


def test_generation_ends_early_when_every_sequence_finished(tiny_models):
    directory, _ = tiny_models["tiny"]
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=1), device="cpu", dtype=torch.float32)
    ids, mask = padded_batch(1, 6, pads=[0], seed=2)
    free = engine.generate(ids, mask, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, 6 + 2])
    out = engine.generate(ids, mask, max_new_tokens=8, eos_token_id=eos)
    stop = free[0, 6:].tolist().index(eos)
    assert engine.last_stats.steps_done == stop + 1
    assert out.shape == (1, 14) and (out[0, 6 + stop + 1:] == 1).all()


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
@pytest.mark.parametrize("top_k", [0, 5])
def test_a_tiny_temperature_is_greedy_not_nan(temperature, top_k):
    """Logits / 1e-38 overflow float32; 1e-300 is 0 there. Both must pick the largest logit."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 50, generator=g) * 5
    uniforms = torch.rand(64, dtype=torch.float64, generator=g)
    picked = Sampler(do_sample=True, temperature=temperature, top_k=top_k, seed=0).pick(logits, uniforms)
    assert torch.equal(picked, logits.argmax(-1))
