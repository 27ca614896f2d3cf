"""On CUDA every decode step's attention runs the same ops on the same shapes, for every KV policy
and placement: a fused attention backend that plans per shape (cuDNN's) plans once, and a CUDA
graph can replay the step. Checked on the simulated device (simulated_cuda.py) by recording the
torch calls of each decode step's attention over the cache parts the device attends over (a part
the CPU attends over, under cpu_cache_compute, is the CPU's work)."""

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from flexh2o.models.cached_attention import CachedAttention
from flexh2o.kv import POLICIES
from test_llama import MODELS as LLAMA_MODELS, make_tiny_llama
from test_simulated_cuda import MATRIX, NEW_TOKENS, assert_same, cpu_reference, simulated_run

KV_POLICIES = {name: dict(kv_policy=name, hh_ratio=0.3) if name != "full" else {} for name in POLICIES}
# Every policy with everything on the device; the full cache and H2O also with the cache split
# across the tiers, compressed, and partly attended by the CPU (make test takes each of those
# placements with one of the two in turn, make test-all with both).
SPLIT = ("weights-disk-cache-cpu", "compressed-mixed", "cpu-cache-compute-mixed-h2o")
CASES = [(kv, "all-on-gpu") for kv in KV_POLICIES] + \
    [(kv, placement) if ("full", "h2o")[SPLIT.index(placement) % 2] == kv
     else pytest.param(kv, placement, marks=pytest.mark.slow) for kv in ("full", "h2o") for placement in SPLIT]


class Calls(TorchFunctionMode):
    """Records (function, shapes of its tensor arguments) of every torch call while active."""

    def __init__(self, into: list):
        super().__init__()
        self.into = into

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.into.append((getattr(func, "__name__", str(func)), tuple(tuple(t.shape) for t in tensors)))
        return func(*args, **kwargs)


def attention_calls_per_step(directory, policy, tmp_path, monkeypatch):
    """Runs on the simulated device; returns its output and {token step: [(call, shapes)] of every
    decode attention over a device-attended part}."""
    per_step = {}
    decode = CachedAttention._decode
    monkeypatch.setenv("FLEXH2O_CUDA_GRAPHS", "0")  # every step runs its Python code (test_decode_graphs.py replays)

    def recorded(layer, q, k_new, v_new, positions, cache, scale, step):
        if cache.cpu_attended:
            return decode(layer, q, k_new, v_new, positions, cache, scale, step)
        with Calls(per_step.setdefault(step.i, [])):
            return decode(layer, q, k_new, v_new, positions, cache, scale, step)
    monkeypatch.setattr(CachedAttention, "_decode", recorded)
    out, _, _ = simulated_run(directory, policy, tmp_path, monkeypatch)
    return out, per_step


def with_kv(placement: str, kv: dict):
    """MATRIX's placement with KV policy `kv` instead of its own."""
    return dataclasses.replace(MATRIX[placement], **{"kv_policy": "h2o" if kv else "full", "hh_ratio": None, **kv})


@pytest.mark.parametrize("kv,placement", CASES)
def test_every_decode_step_attends_with_the_same_shapes(tiny_models, tmp_path, monkeypatch, placement, kv):
    directory, _ = tiny_models["wide"]
    policy = with_kv(placement, KV_POLICIES[kv])
    reference = cpu_reference(directory, policy, tmp_path)
    out, per_step = attention_calls_per_step(directory, policy, tmp_path, monkeypatch)
    assert_same(reference, out)
    steps = sorted(per_step)
    assert steps == list(range(1, NEW_TOKENS)), steps
    first = per_step[steps[0]]
    assert first, "no decode attention ran on the device"
    for i in steps[1:]:
        assert per_step[i] == first, f"decode step {i} made other calls or shapes than step {steps[0]}: " \
            f"{sorted(set(per_step[i]) ^ set(first))[:4]}"


def test_grouped_heads_attend_with_the_same_shapes(tmp_path, monkeypatch):
    """Grouped-query attention (a Llama with 2 KV heads for 6 query heads), full cache on the device."""
    config_class, overrides = LLAMA_MODELS["wide"]
    directory = str(tmp_path / "llama")
    make_tiny_llama(directory, config_class, seed=5, **overrides)
    policy = MATRIX["all-on-gpu"]
    reference = cpu_reference(directory, policy, tmp_path)
    out, per_step = attention_calls_per_step(directory, policy, tmp_path, monkeypatch)
    assert_same(reference, out)
    assert all(per_step[i] == per_step[1] for i in per_step)
