"""Compressed weights multiplied as stored in float32 by flexh2o's own kernel (grouped_weight.py,
native/quant4.c): the product equals dequantize-then-multiply within float32 summation error, and a
compressed run agrees with the same run through the dequantize path on every tier, full and H2O,
with the prompt step widening or not, allocating nothing after its first decode step."""

import pytest
import torch

from flexh2o import native
from flexh2o.compression import grouped_weight, quant, kernel_choice
from conftest import COMPRESSED_TIERS, FORCED_BATCH, FORCED_PROMPT, compressed_policy, count_calls, forced_logprobs

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")



@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("n,k", [(5, 64), (40, 192), (33, 640)])
def test_the_product_equals_dequantize_then_multiply(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    groups = quant.quantize(weight)
    x = torch.randn(rows, k + 3, generator=g)[:, 2: k + 2]  # rows not adjacent in memory
    expected = x.double() @ quant.dequantize(groups, k).double().T
    got = grouped_weight.matmul(x, groups, k)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    scale = x.abs().double() @ quant.dequantize(groups, k).abs().double().T
    assert ((got.double() - expected).abs() <= 1e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_is_the_same_alone_as_among_others(threads, monkeypatch):
    """A row alone is multiplied four weight rows at a time (quant4.c's wide_block), among others a
    weight row at a time: bit-equal, whatever the weight rows' count (here not a multiple of four)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    groups = quant.quantize(torch.randn(53, 192, generator=torch.Generator().manual_seed(5)))
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(6))
    together = grouped_weight.matmul(x, groups, 192)
    for r in range(9):
        assert torch.equal(grouped_weight.matmul(x[r:r + 1], groups, 192), together[r:r + 1]), r


def test_split_over_threads_and_leading_dimensions(monkeypatch):
    groups = quant.quantize(torch.randn(70, 128))
    x = torch.randn(2, 3, 128)
    one = grouped_weight.matmul(x, groups, 128)
    assert one.shape == (2, 3, 70)
    monkeypatch.setattr(native, "PARALLEL_VALUES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert torch.equal(grouped_weight.matmul(x, groups, 128), one)  # each output by one thread, same order
    finally:
        torch.set_num_threads(threads)


def test_which_matrices_each_kernel_takes(monkeypatch):
    kernel_for = kernel_choice.kernel_for
    monkeypatch.setattr(kernel_choice, "torch_lays_codes_so", lambda: True)  # a CPU whose torch takes our tiles
    assert kernel_for((96, 128), torch.float32, True, True) == "groups"
    assert kernel_for((96, 100), torch.float32, True, True) is None  # a partial last group
    assert kernel_for((96, 128), torch.float32, True, False) is None  # no kernels built: widened
    assert kernel_for((96, 128), torch.bfloat16, True, True) == "tiles"
    assert kernel_for((100, 128), torch.bfloat16, True, True) is None  # not whole tiles of rows
    assert kernel_for((96, 128), torch.float32, False, True) is None  # on CUDA
    assert kernel_for((128,), torch.float32, True, True) is None


def test_16_bit_matrices_are_multiplied_as_stored_at_more_rows_than_4_bit_ones(monkeypatch):
    """A 4-bit product of float32 activations pays for each value it makes and loses to widening
    past 32 rows; a 16-bit one makes each value in one conversion and keeps ahead up to 512 rows
    with AVX-512, 128 with AVX2; a plain C build keeps the 4-bit limit."""
    from flexh2o.models.linear import as_stored
    data = torch.zeros(8, 64 * 2, dtype=torch.uint8)
    width = native.library().sixteen_bit_width() if native.library() is not None else 0
    sixteen = {16: 512, 8: 128}.get(width, 32)
    for fmt, most in (("groups", 32), ("Q4_1", 32), ("Q8_0", 32), ("F16", sixteen), ("BF16", sixteen)):
        assert kernel_choice.max_rows("groups", fmt) == most
        weight = grouped_weight.GroupedWeight(data, 64, lambda: None, fmt)
        assert as_stored(weight, most) and not as_stored(weight, most + 1), fmt
    assert kernel_choice.max_rows("tiles") == kernel_choice.MAX_ROWS["tiles"]
    for build_width, rows in ((16, 512), (8, 128), (1, 32)):
        class Build:
            def sixteen_bit_width(self):
                return build_width
        monkeypatch.setattr(native, "library", Build)
        assert kernel_choice.max_rows("groups", "F16") == rows


@pytest.mark.parametrize("kv", [{}, {"hh_ratio": 0.3}])
@pytest.mark.parametrize("tier", list(COMPRESSED_TIERS))
@pytest.mark.parametrize("fused_rows", [32, 4])  # 4: the prompt step widens the weights, decode steps do not
def test_a_compressed_run_agrees_with_the_dequantize_path(tileable_model, tmp_path, monkeypatch, tier, kv, fused_rows):
    policy = compressed_policy(tier, kv)
    calls = count_calls(monkeypatch, grouped_weight.GroupedWeight, ["matmul", "widened"])
    monkeypatch.setitem(kernel_choice.MAX_ROWS, "groups", fused_rows)
    fused, _ = forced_logprobs(tileable_model, policy, tmp_path / "a", torch.float32)
    assert calls["matmul"] > 0
    assert (calls["widened"] > 0) == (fused_rows < FORCED_BATCH // 2 * FORCED_PROMPT)
    monkeypatch.setenv("FLEXH2O_NATIVE", "0")  # quant.py's torch path: dequantize, then multiply
    calls.update(matmul=0, widened=0)
    reference, _ = forced_logprobs(tileable_model, policy, tmp_path / "b", torch.float32)
    assert calls == {"matmul": 0, "widened": 0}
    assert (fused - reference).abs().max() < 1e-4



@pytest.mark.parametrize("fused_rows", [32, 4])  # 4: the prompt step widens the weights, decode steps do not
def test_groups_held_in_memory_are_loaded_once_and_widened_only_when_asked(tileable_model, monkeypatch, fused_rows):
    """Multiplied where they lie, a layer's compressed weights are loaded when placed, not at every
    token; a step of many rows takes a buffer to widen them into, and the layer gives it back."""
    from flexh2o import Engine, Policy
    from flexh2o.offload.weight_io import WeightIO
    monkeypatch.setitem(kernel_choice.MAX_ROWS, "groups", fused_rows)
    widened = count_calls(monkeypatch, grouped_weight.GroupedWeight, ["widened"])
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    with Engine.from_pretrained(tileable_model, Policy(2, 2, compress_weight=True), device="cpu",
                                dtype=torch.float32) as engine:
        layers = [layer for layer in engine.layers if not layer.looks_up_only]
        assert layers and all(layer.weights_in_place for layer in layers)
        loads = count_calls(monkeypatch, WeightIO, ["load"])
        engine.generate(ids, max_new_tokens=4)
        assert loads["load"] == 0
        free = sum(len(buffers) for buffers in engine.tiers.free_buffers.values())
        assert free == engine.tiers.pooled_count()  # every buffer a widening took is back in the pool
    assert (widened["widened"] > 0) == (fused_rows < 2 * 12)
