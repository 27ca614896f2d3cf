"""H2O's real eviction against the slow mask-based reference (tests/h2o_reference.py)."""

import pytest
import torch

from conftest import CONFIGS, padded_batch, row_budgets
from flexh2o import Engine, Policy, UsageError
from flexh2o.kv import POLICIES, budget, check_budget

EVICTING = [name for name in POLICIES if name != "full"]
from h2o_reference import MaskedH2OOPT

PROMPT, NEW = 20, 8
# (cache gpu, cache cpu) percentages and gpu-batches: on the compute device, in CPU memory, on disk, mixed.
TIERS = [((100, 0), 1), ((0, 100), 2), ((0, 0), 1), ((34, 33), 3)]


def run_engine(directory, ids, mask, tmp_path, nb=1, cache=(100, 0), **kv):
    policy = Policy(gpu_batch_size=ids.shape[0] // nb, num_gpu_batches=nb, cache_gpu_percent=cache[0],
                    cache_cpu_percent=cache[1], **kv)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        out = engine.generate(ids, mask, max_new_tokens=NEW, output_scores=True, eos_token_id=None)
        allocations = engine.last_stats.step_allocations
    assert allocations[2:] == [0] * (NEW - 2), allocations  # nothing allocated after the first decode step
    return out


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_engine_matches_the_masked_reference(tiny_models, tmp_path, ratio, model):
    directory, hf = tiny_models[model]
    ids, mask = padded_batch(6, PROMPT, pads=[0, 3, 0, 7, 1, 12], seed=5)
    ref_tokens, ref_logits = MaskedH2OOPT(hf, *row_budgets(mask, ratio)).generate(ids, mask, NEW)
    for cache, nb in TIERS:
        out = run_engine(directory, ids, mask, tmp_path, nb, cache, hh_ratio=ratio)
        assert torch.equal(out.sequences[:, PROMPT:], ref_tokens), (cache, nb)
        for got, want in zip(out.scores, ref_logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_separate_recent_ratio(tiny_models, tmp_path):
    directory, hf = tiny_models["wide"]
    ids, mask = padded_batch(4, PROMPT, pads=[0, 2, 5, 9], seed=6)
    ref_tokens, ref_logits = MaskedH2OOPT(hf, *row_budgets(mask, 0.1, 0.25)).generate(ids, mask, NEW)
    out = run_engine(directory, ids, mask, tmp_path, hh_ratio=0.1, recent_ratio=0.25)
    assert torch.equal(out.sequences[:, PROMPT:], ref_tokens)


def test_eviction_changes_the_output(tiny_models, tmp_path):
    """The reference comparison above could pass vacuously if nothing were ever evicted."""
    directory, _ = tiny_models["wide"]
    ids, mask = padded_batch(4, PROMPT, pads=[0, 2, 5, 9], seed=6)
    full = run_engine(directory, ids, mask, tmp_path)
    h2o = run_engine(directory, ids, mask, tmp_path, hh_ratio=0.1)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(full.scores, h2o.scores))


@pytest.mark.parametrize("kv_policy", EVICTING)
def test_a_budget_holding_every_token_equals_the_full_cache(tiny_models, tmp_path, kv_policy):
    directory, _ = tiny_models["wide"]
    ids, mask = padded_batch(4, PROMPT, pads=[0, 2, 5, 9], seed=6)
    full = run_engine(directory, ids, mask, tmp_path)
    big = run_engine(directory, ids, mask, tmp_path, cache=(0, 0), kv_policy=kv_policy, hh_ratio=1.0)  # 40 >= 20 + 8
    assert torch.equal(full.sequences, big.sequences)
    for a, b in zip(full.scores, big.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_budget_that_rounds_to_zero_keeps_one_slot_of_each():
    """The engine (and a dataset job's short records) keep at least one heavy and one recent slot;
    the command line refuses such ratios for its one block (tests/cli/test_bad_input.py)."""
    assert budget(Policy(hh_ratio=0.01), 20, 4) == (2, 1)
    assert budget(Policy(hh_ratio=0.5, recent_ratio=0.01), 20, 4) == (11, 1)
    with pytest.raises(UsageError, match="--hh-ratio.*rounds to 0"):
        check_budget(Policy(hh_ratio=0.01), 20)
    with pytest.raises(UsageError, match="--recent-ratio.*rounds to 0"):
        check_budget(Policy(hh_ratio=0.5, recent_ratio=0.01), 20)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(hh_ratio=0), "--hh-ratio"), (dict(hh_ratio=1.5), "--hh-ratio"), (dict(hh_ratio=0.2, recent_ratio=-1), "--recent-ratio"),
    (dict(kv_policy="lru", hh_ratio=0.2), "--kv-policy"), (dict(kv_policy="local"), "--hh-ratio"),
    (dict(kv_policy="full", hh_ratio=0.2), "--kv-policy")])
def test_bad_kv_settings_name_their_flag(kwargs, flag):
    with pytest.raises(UsageError) as e:
        Policy(**kwargs)
    assert e.value.flag == flag


def test_the_reference_evicts_the_older_of_equal_scores():
    """The tie-break the engine follows too (tests/kv/test_kv_policies.py): lowest position goes first."""
    ref = MaskedH2OOPT.__new__(MaskedH2OOPT)
    ref.heavy, ref.recent = [2], [2]
    ref.kept, ref.score = [torch.ones(1, 1, 8, dtype=torch.bool)], [torch.zeros(1, 1, 8)]
    ref.key_pos = torch.arange(8)[None]
    ref._evict(0)
    assert ref.kept[0][0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7]
