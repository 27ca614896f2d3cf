"""4-bit group quantization (flexh2o/quant.py): round trip within half a step, layout and bytes, by
both paths: the C kernels (flexh2o/native) and torch's operations, bit-equal to each other."""

import math

import pytest
import torch

from flexh2o.compression.quant import (GROUP, GROUP_BYTES, compressible, dequantize, packed_bytes, packed_shape, packed_width,
                           quantize, stored_bytes)
from flexh2o.compression.formats import NATIVE_DTYPES


pytestmark = pytest.mark.usefixtures("kernel_path")  # every test through both paths (conftest.py)


def steps(packed, n):
    """The stored scale of each group: [..., groups]."""
    record = packed.view(*packed.shape[:-1], -1, GROUP_BYTES)
    return record[..., GROUP // 2: GROUP // 2 + 2].contiguous().view(torch.float16).float().squeeze(-1)


def assert_within_half_a_step(x, n=None):
    n = x.shape[-1] if n is None else n
    packed = quantize(x)
    back = dequantize(packed, n)
    step = steps(packed, n)
    groups = -(-n // GROUP)
    per_value = step.repeat_interleave(GROUP, -1)[..., :n]
    error = (back - x.float()).abs()
    slack = 1e-6 * x.float().abs().amax().clamp(min=1)  # float32 arithmetic of q * scale + minimum
    assert (error <= per_value / 2 + slack).all(), (error - per_value / 2).max()
    # The step is the group's range over 15 levels (rounded up to float16), not something larger.
    padded = torch.cat([x.float(), x.float()[..., -1:].expand(*x.shape[:-1], groups * GROUP - n)], -1)
    grouped = padded.view(*x.shape[:-1], groups, GROUP)
    spread = grouped.amax(-1) - grouped.amin(-1)
    assert (step <= spread / 15 * (1 + 2 ** -9) + grouped.abs().amax(-1) * 2 ** -9 + 2 ** -24).all()
    return back


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
def test_random_groups_come_back_within_half_a_step(dtype):
    x = (torch.randn(7, 5, 256, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    assert_within_half_a_step(x)


@pytest.mark.parametrize("n", [1, 8, 63, 65, 100, 130, 200])
def test_sizes_that_are_not_a_multiple_of_the_group(n):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    back = assert_within_half_a_step(x)
    assert back.shape == (3, n)
    assert quantize(x).shape == (3, packed_width(n))


def test_constant_and_all_equal_groups_are_exact_or_within_a_float16_step():
    exact = torch.full((4, 128), 0.5)
    assert torch.equal(dequantize(quantize(exact), 128), exact)
    zeros = torch.zeros(2, 64)
    assert torch.equal(dequantize(quantize(zeros), 64), zeros)
    awkward = torch.full((3, 70), math.pi)  # not a float16 value: the minimum is rounded down
    assert_within_half_a_step(awkward)
    half_and_half = torch.cat([torch.full((2, 64), -2.0), torch.full((2, 64), 7.0)], -1)
    assert torch.equal(dequantize(quantize(half_and_half), 128), half_and_half)


def test_extreme_values_within_float16_range():
    x = torch.tensor([[-65504.0, 65504.0] + [0.0] * 62, [1e-7, -1e-7] * 32, [60000.0, 60001.0] * 32])
    assert_within_half_a_step(x)
    # Exactly 16 levels come back as themselves, up to the scale's rounding up to float16: the
    # scale 2/15 lies in [1/8, 1/4), where float16 steps by 2^-13, and the top level is 15 scales up.
    levels = torch.linspace(-1, 1, 16).repeat(4)[None]
    assert (dequantize(quantize(levels), 64) - levels).abs().max() <= 15 * 2 ** -13


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e6])
def test_inf_nan_and_values_beyond_float16_are_a_clear_error(bad):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="inf or NaN|float16's range"):
        quantize(x)


def test_without_the_check_a_bad_group_comes_back_non_finite_never_as_garbage():
    x = torch.randn(3, 128)
    x[1, 70] = float("nan")
    x[2, 3] = float("inf")
    back = dequantize(quantize(x, check=False), 128)
    assert not torch.isfinite(back[1, 64:]).any() and not torch.isfinite(back[2, :64]).any()
    assert torch.isfinite(back[0]).all() and torch.isfinite(back[1, :64]).all() and torch.isfinite(back[2, 64:]).all()


def test_bytes_are_as_documented():
    assert GROUP == 64 and GROUP_BYTES == 36  # 32 bytes of codes, float16 scale and minimum
    assert packed_width(64) == 36 and packed_width(65) == 72 and packed_width(4096) == 64 * 36
    assert packed_shape((10, 3, 128)) == (10, 3, 72)
    assert packed_bytes((7168, 7168)) * 8 / (7168 * 7168) == 4.5  # bits per value
    assert packed_bytes((7168, 7168)) / (7168 * 7168 * 2) == pytest.approx(0.28125)
    x = torch.randn(5, 128)
    assert quantize(x).dtype == torch.uint8 and quantize(x).numel() == packed_bytes((5, 128))
    assert stored_bytes((5, 128), 2, True) == 5 * 72 and stored_bytes((5, 128), 2, False) == 5 * 256
    assert compressible((5, 128)) and not compressible((128,))


def test_layout_codes_two_per_byte_then_scale_and_minimum():
    x = torch.arange(64, dtype=torch.float32)[None] % 16  # codes 0..15 with scale 1, minimum 0
    record = quantize(x)[0]
    assert record[:32].tolist() == [(i % 16) | ((i + 32) % 16) << 4 for i in range(32)]
    assert record[32:34].view(torch.float16).item() == 1.0 and record[34:36].view(torch.float16).item() == 0.0


def test_rows_are_independent_and_dequantize_writes_any_strided_view():
    x = torch.randn(6, 4, 128)
    packed = quantize(x)
    assert torch.equal(quantize(x[2:5]), packed[2:5])  # a slice of rows is a compressed tensor of them
    out = torch.empty(4, 6, 128).transpose(0, 1)  # strided destination
    dequantize(packed, 128, out)
    assert torch.equal(out, dequantize(packed, 128))
    odd = torch.empty(4, 6, 100).transpose(0, 1)
    dequantize(quantize(x[..., :100]), 100, odd)
    assert torch.equal(odd, dequantize(quantize(x[..., :100]), 100))


def test_large_tensors_dequantize_in_blocks_to_the_same_values(monkeypatch):
    import flexh2o.compression.quant as quant
    x = torch.randn(40, 256)
    whole = dequantize(quantize(x), 256)
    monkeypatch.setattr(quant, "BLOCK_VALUES", 1000)  # 3 rows at a time
    out = torch.empty(40, 256)
    assert torch.equal(dequantize(quantize(x), 256, out), whole)


def test_a_row_larger_than_a_block_dequantizes_row_by_row(monkeypatch):
    import flexh2o.compression.quant as quant
    x = torch.randn(3, 5, 4, 64)
    packed, whole, odd = quantize(x), dequantize(quantize(x), 64), quantize(x[..., :50])
    monkeypatch.setattr(quant, "BLOCK_VALUES", 300)  # one leading row holds 1280 values
    out = torch.empty(3, 5, 4, 64)
    assert torch.equal(dequantize(packed, 64, out), whole)
    assert torch.equal(quantize(x), packed)  # quantized in blocks (row by row here) to the same bytes
    monkeypatch.setattr(quant, "BLOCK_VALUES", 3000)  # two leading rows at a time
    assert torch.equal(quantize(x), packed) and torch.equal(quantize(x[..., :50]), odd)


def test_rounding_to_float16_down_and_up_matches_nextafter():
    from flexh2o.compression.quant import _round_float16
    x = torch.cat([torch.randn(50000) * 10, torch.randn(50000) * 1e-6,
                   torch.tensor([0.0, -0.0, 65504.0, -65504.0, 1e-9, -1e-9, 3.0, -3.0, 6e-8, -6e-8])])
    for up in (True, False):
        y = x.half()
        wrong = y.float() < x if up else y.float() > x
        toward = torch.full_like(y, float("inf") if up else float("-inf"))
        assert torch.equal(_round_float16(x, up).float(), torch.where(wrong, torch.nextafter(y, toward), y).float())
        assert ((_round_float16(x, up).float() >= x) if up else (_round_float16(x, up).float() <= x)).all()


def test_a_packed_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="does not hold"):
        dequantize(torch.zeros(2, 36, dtype=torch.uint8), 100)


def test_large_groups_and_their_joins_start_at_a_disk_block():
    """So that placed on disk they are written from where they are (disk.py's O_DIRECT writes)."""
    from flexh2o.offload.disk import ALIGN
    from flexh2o.compression.quant import ALIGNED_BYTES, BLOCK_VALUES, Packed, join
    x = torch.randn(max(ALIGNED_BYTES // GROUP_BYTES, BLOCK_VALUES // GROUP) + 1, GROUP)  # the torch path: in blocks
    parts = [Packed(quantize(x), tuple(x.shape)), Packed(quantize(x[:5]), (5, GROUP))]
    joined = join(parts)
    assert parts[0].groups.data_ptr() % ALIGN == 0 and joined.groups.data_ptr() % ALIGN == 0
    assert torch.equal(joined.groups, torch.cat([p.groups for p in parts])) and joined.shape == (len(x) + 5, GROUP)
