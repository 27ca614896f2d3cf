"""Compressed weights multiplied as stored (int4_tiles.py, models/linear.py): where the CPU
computes in bfloat16, a compressed matrix that fits the int4 kernel's tiles is placed in its layout
and decode steps use the kernel; the run agrees with the same run through quant.py's groups
(dequantize, then multiply) within bfloat16's rounding, on every tier and with H2O, and allocates
nothing after its first decode step."""

import pytest
import torch

from flexh2o import Engine, Policy
from flexh2o.compression import int4_tiles, kernel_choice
from flexh2o.offload.weight_io import WeightIO
from conftest import COMPRESSED_TIERS, FORCED_BATCH, FORCED_PROMPT, compressed_policy, count_calls, forced_logprobs



def logprobs(directory, policy, tmp_path):
    return forced_logprobs(directory, policy, tmp_path, torch.bfloat16,
                           inspect=lambda engine: [p.tiled for layer in engine.layers for p in layer.home])


@pytest.mark.skipif(not int4_tiles.torch_lays_codes_so(),
                    reason="torch's int4 kernel lays its codes out otherwise on this CPU (AVX2 alone)")
@pytest.mark.parametrize("kv", [{}, {"hh_ratio": 0.3}])
@pytest.mark.parametrize("tier", list(COMPRESSED_TIERS))
@pytest.mark.parametrize("fused_rows", [256, 8])  # 8: the prompt step widens the weights, decode steps do not
def test_tiled_weights_agree_with_the_dequantize_path(tileable_model, tmp_path, monkeypatch, tier, kv, fused_rows):
    policy = compressed_policy(tier, kv)
    calls = count_calls(monkeypatch, int4_tiles.TiledWeight, ["matmul", "widened"])
    monkeypatch.setitem(kernel_choice.MAX_ROWS, "tiles", fused_rows)
    fused, tiled = logprobs(tileable_model, policy, tmp_path / "a")
    assert any(tiled) and calls["matmul"] > 0
    assert (calls["widened"] > 0) == (fused_rows < FORCED_BATCH // 2 * FORCED_PROMPT)
    monkeypatch.setattr(WeightIO, "tiles_for", lambda tiers, shape: False)
    reference, untiled = logprobs(tileable_model, policy, tmp_path / "b")
    assert not any(untiled)
    # bfloat16 activations either way; the kernel's scales are bfloat16 where quant.py's are float16.
    # H2O's evictions are discrete: a rounding can keep another token, so after the prompt step most
    # log-probabilities, not all, stay this close.
    off = (fused.float() - reference.float()).abs()
    assert off[:, 0].max() < 0.1, off
    assert (off < 0.1).float().mean() >= (1.0 if not kv else 0.9), off


def test_a_float32_run_is_not_placed_in_tiles(tileable_model, tmp_path):
    with Engine.from_pretrained(tileable_model, policy=Policy(2, compress_weight=True), device="cpu",
                                dtype=torch.float32, offload_dir=str(tmp_path)) as engine:
        assert not any(p.tiled for layer in engine.layers for p in layer.home)
