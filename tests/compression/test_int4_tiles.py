"""flexh2o's 4-bit groups in the layout of torch's CPU int4 kernel (int4_tiles.py): the layout is
torch's own, nothing is lost on the way back, and the kernel multiplies them as dequantizing would."""

import pytest
import torch

from flexh2o.compression import int4_tiles, kernel_choice
from flexh2o.compression.quant import dequantize, quantize

TORCH_LAYOUT = pytest.mark.skipif(not int4_tiles.torch_lays_codes_so(),
                                  reason="torch's int4 kernel lays its codes out otherwise on this CPU (AVX2 alone)")


@TORCH_LAYOUT
@pytest.mark.parametrize("n,k", [(64, 128), (128, 64), (96, 192), (32, 128), (160, 64)])
def test_the_codes_are_laid_out_as_torch_lays_them(n, k):
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.int32)
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    tiled = int4_tiles.tile_codes(codes.to(torch.uint8))
    assert torch.equal(tiled.view(-1), expected.view(torch.uint8).view(-1))
    assert torch.equal(int4_tiles.untile_codes(tiled), codes.to(torch.uint8))


@TORCH_LAYOUT
@pytest.mark.parametrize("n,k", [(64, 128), (96, 192)])
def test_tiles_dequantize_exactly_and_multiply_as_dequantized(n, k):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    packed = quantize(weight)
    tiles = int4_tiles.to_tiles(packed, k)
    reference = dequantize(packed, k)
    assert torch.equal(int4_tiles.dequantize(tiles), reference)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert torch.equal(int4_tiles.dequantize(tiles, out), reference.to(torch.bfloat16))
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = int4_tiles.matmul(x, tiles).float()
    want = x.float() @ reference.t()
    # bfloat16 scales and zeros, bfloat16 output: 0.4% of the output's scale seen; row-major codes gave 170%
    assert got.shape == (3, 5, n) and (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_a_weight_the_tiles_cannot_hold_is_refused():
    assert int4_tiles.tileable(64, 128) and int4_tiles.tileable(96, 64)
    assert not int4_tiles.tileable(48, 128) and not int4_tiles.tileable(64, 100)
    with pytest.raises(ValueError, match="tiles"):
        int4_tiles.to_tiles(quantize(torch.randn(48, 64)), 64)


def test_packed_in_blocks_and_widened_in_blocks_as_whole(monkeypatch):
    """pack() and TiledWeight.widened() work a block of whole tiles at a time (bounded temporaries):
    with blocks of 64 rows, a 160-row weight (two tiles, then a 32-row tail) comes out as in one go."""
    n, k = 160, 128
    packed = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(3)))
    whole = int4_tiles.pack(packed, k)
    expected = int4_tiles.TiledWeight(whole, k, torch.empty(n, k)).widened().clone()
    monkeypatch.setattr(int4_tiles, "BLOCK_VALUES", 64 * k)
    assert int4_tiles._block_rows(k) == 64
    blocked = int4_tiles.pack(packed, k)
    assert torch.equal(blocked, whole)
    assert torch.equal(int4_tiles.TiledWeight(blocked, k, torch.empty(n, k)).widened(), expected)
    # the kernel's own values: within a bfloat16 scale's rounding of quant.py's
    assert (expected - dequantize(packed, k)).abs().max() <= 0.01 * dequantize(packed, k).abs().max()


def test_rows_that_are_a_slice_multiply_as_contiguous_ones():
    """OPT-350M's head projection gets the last position of each sequence, a strided slice."""
    k, n = 128, 64
    tiles = int4_tiles.to_tiles(quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(3))), k)
    hidden = torch.randn(4, 6, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(int4_tiles.matmul(hidden[:, -1], tiles), int4_tiles.matmul(hidden[:, -1].contiguous(), tiles))


def test_tiles_are_used_only_where_torch_lays_codes_out_so(monkeypatch):
    """On a CPU where torch's kernel takes another layout, a bfloat16 run widens compressed matrices."""
    assert kernel_choice.kernel_for((64, 128), torch.bfloat16, True, True) == \
        ("tiles" if int4_tiles.torch_lays_codes_so() else None)
    monkeypatch.setattr(kernel_choice, "torch_lays_codes_so", lambda: False)
    assert kernel_choice.kernel_for((64, 128), torch.bfloat16, True, True) is None
    monkeypatch.setattr(kernel_choice, "torch_lays_codes_so", lambda: True)
    assert kernel_choice.kernel_for((64, 128), torch.bfloat16, True, True) == "tiles"
