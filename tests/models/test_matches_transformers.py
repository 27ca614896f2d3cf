"""The engine's greedy tokens and logits equal transformers' OPT generate (float32)."""

import pytest
import torch

from flexh2o import Engine, Policy
from conftest import CONFIGS, hf_generate, padded_batch


def run_engine(directory, ids, mask, new_tokens, gpu_batch_size, num_gpu_batches=1, **kw):
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=gpu_batch_size,
                                                             num_gpu_batches=num_gpu_batches),
                                    device="cpu", dtype=torch.float32)
    return engine.generate(ids, mask, max_new_tokens=new_tokens, output_scores=True, eos_token_id=None, **kw)


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for mine, theirs in zip(out.scores, ref.scores):
        assert torch.allclose(mine, theirs.float(), atol=1e-4, rtol=0), (mine - theirs).abs().max()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_and_scores_match(tiny_models, name):
    directory, model = tiny_models[name]
    ids, mask = padded_batch(4, 12, pads=[0, 0, 0, 0], seed=1)
    assert_same(run_engine(directory, ids, mask, 10, gpu_batch_size=4), hf_generate(model, ids, mask, 10))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_left_padded_batch_matches(tiny_models, name):
    directory, model = tiny_models[name]
    ids, mask = padded_batch(4, 12, pads=[0, 3, 7, 11], seed=2)
    assert_same(run_engine(directory, ids, mask, 10, gpu_batch_size=4), hf_generate(model, ids, mask, 10))


def test_each_padded_row_equals_its_unpadded_run(tiny_models):
    directory, model = tiny_models["tiny"]
    ids, mask = padded_batch(2, 10, pads=[0, 4], seed=3)
    batched = run_engine(directory, ids, mask, 6, gpu_batch_size=2)
    alone = run_engine(directory, ids[1:, 4:], mask[1:, 4:], 6, gpu_batch_size=1)
    assert torch.equal(batched.sequences[1, 10:], alone.sequences[0, 6:])


@pytest.mark.parametrize("num_gpu_batches", [2, 3])
def test_several_gpu_batches_equal_one(tiny_models, num_gpu_batches):
    directory, _ = tiny_models["wide"]
    batch = 2 * num_gpu_batches
    ids, mask = padded_batch(batch, 9, pads=[(r * 2) % 7 for r in range(batch)], seed=4)
    one = run_engine(directory, ids, mask, 8, gpu_batch_size=batch)
    many = run_engine(directory, ids, mask, 8, gpu_batch_size=2, num_gpu_batches=num_gpu_batches)
    assert torch.equal(one.sequences, many.sequences)
    for a, b in zip(one.scores, many.scores):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_plain_tensor_result_shape(tiny_models):
    directory, _ = tiny_models["tiny"]
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=3), device="cpu", dtype=torch.float32)
    ids, mask = padded_batch(3, 5, pads=[0, 1, 2])
    out = engine.generate(ids, mask, max_new_tokens=4, eos_token_id=None)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 9) and out.dtype == torch.long
    assert torch.equal(out[:, :5], ids)


def test_a_padded_prompt_step_runs_its_real_tokens_only(tiny_models, monkeypatch):
    """The token-wise work of a padded prompt runs on its real tokens (models/real_tokens.py), and
    gives what running it on every position gives."""
    from flexh2o.models import real_tokens
    directory, model = tiny_models["tiny"]
    ids, mask = padded_batch(4, 12, pads=[0, 3, 7, 11], seed=5)
    gathered = []
    gather = real_tokens.RealTokens.gather

    def counted(self, x):
        rows = gather(self, x)
        gathered.append(rows.shape[0])
        return rows
    monkeypatch.setattr(real_tokens.RealTokens, "gather", counted)
    packed = run_engine(directory, ids, mask, 6, gpu_batch_size=4)
    assert int(mask.sum()) in gathered
    monkeypatch.setattr(real_tokens, "MIN_PADDING", 2.0)  # never: every position computed
    assert_same(packed, run_engine(directory, ids, mask, 6, gpu_batch_size=4))
