"""4-bit compression of weights and KV cache in the engine: it equals the uncompressed engine run
on quantized-then-dequantized tensors, on every tier, with every kind of policy; it stores and
moves compressed bytes; a decode step quantizes only the slots it wrote."""

from collections import Counter

import pytest
import torch

import flexh2o.kv.compressed
import flexh2o.kv.home
import flexh2o.checkpoints.weights
from flexh2o import Engine, Policy
from flexh2o.kv import cache_bytes
from flexh2o.kv.cache import KVCache
from flexh2o.kv.eviction import FullCache
from flexh2o.compression.quant import compressible, dequantize, packed_width, quantize, stored_bytes
from flexh2o.checkpoints.weights import CheckpointWeights
from conftest import generate_leaving_nothing, make_tiny_opt, padded_batch

TIERS = {"gpu": (100, 0), "cpu": (0, 100), "disk": (0, 0), "mixed": (34, 33)}
KV = {"full": {}, "h2o": {"hh_ratio": 0.3}, "local": {"kv_policy": "local", "hh_ratio": 0.2, "recent_ratio": 0.4}}
BATCH, PROMPT, NEW = 6, 10, 6


def round_trip(t):
    return dequantize(quantize(t, check=False), t.shape[-1]).to(t.dtype)


def run(directory, policy, tmp_path, dtype=torch.float32):
    ids, mask = padded_batch(BATCH, PROMPT, pads=[(r * 3) % 8 for r in range(BATCH)], seed=5)
    return generate_leaving_nothing(directory, policy, ids, mask, tmp_path, NEW, dtype)


def reference(directory, policy, tmp_path, monkeypatch):
    """The uncompressed engine, all on the compute device, on the same tensors quantized and
    dequantized: every weight matrix as it is read, every K and V as it enters the cache."""
    with monkeypatch.context() as m:
        if policy.compress_weight:
            get = CheckpointWeights.get
            m.setattr(CheckpointWeights, "get", lambda self, name, shape, dtype: (
                round_trip(get(self, name, shape, dtype).float()) if compressible(shape) else get(self, name, shape, dtype)))
        if policy.compress_cache:
            fill, put, append = KVCache.fill_prompt, KVCache.put, KVCache.append
            m.setattr(KVCache, "fill_prompt", lambda self, k, v, *a, **kw: fill(self, round_trip(k), round_trip(v), *a, **kw))
            m.setattr(KVCache, "put", lambda self, slots, k, v, *a, **kw: put(self, slots, round_trip(k), round_trip(v), *a, **kw))
            m.setattr(KVCache, "append",
                      lambda self, k, v, pos, slot=None: append(self, round_trip(k), round_trip(v), pos, slot))
            # A new token is attended as computed, and stored compressed: so it must be stored after
            # the step attends, not first, as the full cache does when it stores exactly.
            m.setattr(FullCache, "appends", False)
        plain = Policy(policy.gpu_batch_size, policy.num_gpu_batches, kv_policy=policy.kv_policy,
                       hh_ratio=policy.hh_ratio, recent_ratio=policy.recent_ratio)
        return run(directory, plain, tmp_path)


@pytest.fixture(scope="module")
def references():
    """(kv, nb) -> the reference output with weights and cache compressed, made once per module."""
    return {}


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.scores, ref.scores):
        assert torch.allclose(mine, theirs, atol=1e-4, rtol=0)


MATRIX = [(w, c, kv, nb) for w in TIERS for c in TIERS for kv in KV for nb in (1, 3)]


def in_default_run(w, c, kv, nb):
    """16 of the 96 cases: each pair of tiers once, with the eviction and micro-batch count turning
    so that each tier meets each eviction and each count, and each eviction each count
    (make test-all runs all 96)."""
    turn = list(TIERS).index(w) + list(TIERS).index(c)
    return kv == list(KV)[turn % len(KV)] and nb == (1, 3)[turn % 2]


@pytest.mark.parametrize("weights,cache,kv,nb", [
    case if in_default_run(*case) else pytest.param(*case, marks=pytest.mark.slow) for case in MATRIX],
    ids=[f"w-{w}_cache-{c}_{kv}_nb{nb}" for w, c, kv, nb in MATRIX])
def test_compressed_engine_equals_the_uncompressed_one_on_round_tripped_tensors(
        tiny_models, tmp_path, monkeypatch, references, weights, cache, kv, nb):
    directory, _ = tiny_models["wide"]
    policy = Policy(BATCH // nb, nb, *TIERS[weights], *TIERS[cache], compress_weight=True, compress_cache=True, **KV[kv])
    if (kv, nb) not in references:
        references[kv, nb] = reference(directory, policy, tmp_path, monkeypatch)
    assert_same(run(directory, policy, tmp_path), references[kv, nb])


@pytest.mark.parametrize("what", ["compress_weight", "compress_cache"])
def test_each_compression_alone_equals_its_reference(tiny_models, tmp_path, monkeypatch, what):
    directory, _ = tiny_models["post_norm_proj"]
    policy = Policy(2, 3, 0, 50, 34, 33, hh_ratio=0.3, **{what: True})
    out = run(directory, policy, tmp_path)
    assert_same(out, reference(directory, policy, tmp_path, monkeypatch))
    # ... and differs from the uncompressed engine: the test would see compression doing nothing.
    plain = run(directory, Policy(2, 3, hh_ratio=0.3), tmp_path)
    assert any(not torch.equal(a, b) for a, b in zip(out.scores, plain.scores))


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory):
    """A model whose head_dim is one whole group (64), as in real OPTs."""
    directory = str(tmp_path_factory.mktemp("head64"))
    make_tiny_opt(directory, hidden_size=128, num_hidden_layers=2, ffn_dim=256, num_attention_heads=2)
    return directory


@pytest.mark.parametrize("w_gpu,w_cpu,c_gpu,c_cpu", [(100, 0, 100, 0), (20, 30, 0, 100), (0, 0, 0, 0), (50, 50, 34, 33)])
def test_tiers_hold_compressed_bytes_and_the_preflight_bounds_them(head_dim_64, tmp_path, w_gpu, w_cpu, c_gpu, c_cpu):
    policy = Policy(3, 2, w_gpu, w_cpu, c_gpu, c_cpu, hh_ratio=0.4, compress_weight=True, compress_cache=True)
    ids, mask = padded_batch(6, 16, pads=[0, 2, 4, 0, 1, 3], seed=1)
    with Engine.from_pretrained(head_dim_64, policy=policy, device="cpu", dtype=torch.bfloat16,
                                offload_dir=str(tmp_path)) as engine:
        layers = engine.layers
        placed = {tier: 0 for tier in ("gpu", "cpu", "disk")}
        for layer in layers:
            for home in layer.home:
                for seg in home.segments:
                    placed[seg.tier] += seg.data.nbytes if seg.data is not None else seg.file.nbytes
                assert (home.dtype == torch.uint8) == (home.decoded_shape is not None)
        weights = sum(stored_bytes(tuple(h.decoded_shape or h.shape), 2, h.decoded_shape is not None)
                      for layer in layers for h in layer.home)
        assert sum(placed.values()) == weights
        # Shares of compressed bytes, to within a row of each tensor; the LM head's layer and the
        # vectors stay on the compute device whatever the shares (placed.split_rows).
        pinned = sum(stored_bytes(tuple(h.decoded_shape or h.shape), 2, h.decoded_shape is not None)
                     for layer in layers for h in layer.home if layer.one_of_a_kind or len(h.shape) == 1)
        shared = weights - pinned
        assert abs(placed["gpu"] - pinned - shared * w_gpu / 100) < shared * 0.08
        assert abs(placed["cpu"] - shared * w_cpu / 100) < shared * 0.08
        engine.generate(ids, mask, max_new_tokens=4, eos_token_id=None)
        for tier in ("gpu", "cpu", "disk"):
            assert engine.tiers.peak[tier] <= engine.projected[tier], tier
        from flexh2o.runs.report import build_report
        report = build_report(engine, engine.last_stats, policy)
    sixteen_bit = sum(2 * torch.Size(shape).numel() for layer in layers for _, shape in layer.weight_specs())
    assert report["model_size_bytes"] == weights and 0.28 < weights / sixteen_bit < 0.30
    assert report["cache_size_bytes"] == cache_bytes(engine.spec, policy, 6, 16, 4, 2)
    plain = cache_bytes(engine.spec, Policy(3, 2, hh_ratio=0.4), 6, 16, 4, 2)
    state = cache_bytes(engine.spec, Policy(3, 2, hh_ratio=0.4), 6, 16, 4, 0)  # positions and scores alone
    assert (report["cache_size_bytes"] - state) / (plain - state) == packed_width(64) / 128


def test_a_decode_step_quantizes_only_the_slots_it_wrote(head_dim_64, tmp_path, monkeypatch):
    seen = []
    for module in (flexh2o.kv.home, flexh2o.kv.compressed):  # homes moved each step, and homes used in place
        real = module.quantize
        monkeypatch.setattr(module, "quantize", lambda t, real=real, **kw: seen.append(tuple(t.shape)) or real(t, **kw))
    policy = Policy(2, 2, cache_gpu_percent=50, cache_cpu_percent=0, hh_ratio=0.25, compress_cache=True)
    ids, mask = padded_batch(4, 16, pads=[0, 3, 0, 5], seed=2)
    with Engine.from_pretrained(head_dim_64, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        engine.generate(ids, mask, max_new_tokens=5, eos_token_id=None)
    # Each (layer, gpu-batch): one sequence's cache on the compute device, one on disk; K and V each.
    writes = 2 * 2 * 2 * 2
    assert Counter(seen) == {(1, 2, 8, 64): writes, (1, 2, 64): 4 * writes}  # the 8 kept slots once, then 1 slot


def test_compressed_slots_change_in_place_one_per_sequence_and_head(head_dim_64, tmp_path):
    """Between two decode steps, a home on the compute device changes in exactly the slots written."""
    policy = Policy(2, 1, hh_ratio=0.25, compress_cache=True)
    ids, mask = padded_batch(2, 16, pads=[0, 3], seed=3)
    snapshots = []
    store = flexh2o.kv.home.CacheHome.store

    def spy(self, views):
        out = store(self, views)
        out.wait()
        snapshots.append((self, self.parts[0].home.k.clone(), views[0][1].written))
        return out
    with pytest.MonkeyPatch.context() as m:
        m.setattr(flexh2o.kv.home.CacheHome, "store", spy)
        with Engine.from_pretrained(head_dim_64, policy=policy, device="cpu", dtype=torch.float32,
                                    offload_dir=str(tmp_path)) as engine:
            engine.generate(ids, mask, max_new_tokens=4, eos_token_id=None)
    first = [s for s in snapshots if s[0] is snapshots[0][0]]
    for (_, before, _), (_, after, slots) in zip(first[1:], first[2:]):
        changed = (before != after).any(-1)  # [capacity, batch, kv_heads]
        for b in range(2):
            for h in range(2):
                rows = changed[:, b, h].nonzero().flatten().tolist()
                assert rows in ([], [slots[b, h].item()]), (rows, slots[b, h])


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("w_gpu,w_cpu", [(0, 0), (0, 100), (30, 30), (30, 40)])
def test_the_preflight_counts_every_buffer_of_groups_and_whole_rows(head_dim_64, tmp_path, w_gpu, w_cpu, compress):
    """Weights alone compressed (or not), split over tiers: what is tracked on each tier stays within
    the projection (every buffer of groups; each tier's share in the whole rows it gets)."""
    policy = Policy(2, 1, w_gpu, w_cpu, compress_weight=compress)
    ids, mask = padded_batch(2, 8, pads=[0, 1], seed=4)
    with Engine.from_pretrained(head_dim_64, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        engine.generate(ids, mask, max_new_tokens=3, eos_token_id=None)
        for tier in ("gpu", "cpu", "disk"):
            assert engine.tiers.peak[tier] <= engine.projected[tier], tier


@pytest.mark.parametrize("cache", ["gpu", "cpu", "disk", "mixed"])
@pytest.mark.parametrize("kv", [{"hh_ratio": 0.7}, {"kv_policy": "local", "hh_ratio": 0.2, "recent_ratio": 0.9}])
def test_a_budget_larger_than_the_prompt_attends_over_empty_slots_as_zeros(tiny_models, tmp_path, monkeypatch, cache, kv):
    """capacity > prompt_len: slots no token has filled yet count as in use, with probability 0;
    their groups must read as zeros (fresh memory could read as NaN, and 0 x NaN is NaN)."""
    directory, _ = tiny_models["wide"]
    policy = Policy(BATCH, 1, 100, 0, *TIERS[cache], compress_cache=True, **kv)
    out = run(directory, policy, tmp_path)
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert_same(out, reference(directory, policy, tmp_path, monkeypatch))


def test_dummy_weights_made_as_groups_run_as_the_quantized_dummy_values(tmp_path, monkeypatch):
    """A compressed run on dummy weights copies their groups (DummyWeights.get_packed) instead of
    quantizing: the same tokens and scores as quantizing get()'s values, on every tier."""
    ids, mask = padded_batch(4, 12, pads=[0, 1, 2, 3], seed=5)
    policy = Policy(2, 2, 30, 30, hh_ratio=0.3, compress_weight=True)

    def run():
        with Engine.from_pretrained("opt-125m", policy=policy, device="cpu", dtype=torch.float32, dummy=True,
                                    offload_dir=str(tmp_path)) as engine:
            return engine.generate(ids, mask, max_new_tokens=3, output_scores=True, eos_token_id=None)
    packed = run()
    monkeypatch.setattr(flexh2o.checkpoints.weights.DummyWeights, "get_packed", lambda *args: None)
    quantized = run()
    assert torch.equal(packed.sequences, quantized.sequences)
    assert all(torch.equal(a, b) for a, b in zip(packed.scores, quantized.scores))
