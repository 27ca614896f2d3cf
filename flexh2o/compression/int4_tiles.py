"""4-bit weights in the tile layout of torch's CPU int4 kernel, which multiplies them as stored.

aten._weight_int4pack_mm_for_cpu multiplies bfloat16 activations [m, k] by a 4-bit weight [n, k]
without widening it first (scripts/bench_int4_kernels.py: 20-90x the dequantize-then-multiply path
at 1-8 rows, 1.5-1.8x at 128, 0.5x at 512). Its weight is n x k/2 bytes in tiles of 64 rows, input
column by input column inside a tile: 32 bytes per column, byte j holding row j in its low nibble
and row j + 32 in its high one. Where n is 32 more than a multiple of 64, the last 32 rows are a
tile of their own whose byte j holds rows 2j and 2j + 1. Each group of 64 inputs of a row has a
scale and a zero, bfloat16: value = (code - 8) * scale + zero.

The engine places compressed matrices with pack() where the CPU computes in bfloat16 (weight_io.py):
the kernel's codes, then its bfloat16 scales and zeros, made once (made at every load they took
3.3 ms for OPT-1.3B's fc1, against 0.5 ms for its product at one row), in quant.py's 36 bytes per 64
values. A prompt step, which multiplies many rows at once and is faster widened, widens from those
(TiledWeight), so prompt and decode steps use the same values. Tiles, which also keep quant.py's
exact float16 scale and minimum, measure the layout against quant.py: it dequantizes back exactly,
and as fast (37 ms into bfloat16 for that fc1 either way, on this CPU; tests/compression/test_int4_tiles.py).
"""

import functools
from dataclasses import dataclass

import torch

from flexh2o.compression.quant import BLOCK_VALUES, GROUP, GROUP_BYTES, groups

TILE = 64


def tileable(n: int, k: int) -> bool:
    """Whether an [n, k] weight fits the kernel's layout: whole tiles of rows, whole groups."""
    return n % (TILE // 2) == 0 and k % GROUP == 0


@functools.cache
def torch_lays_codes_so() -> bool:
    """Whether torch's kernel takes its codes in the layout above on this CPU. It is torch's build
    for the CPU's vector width: on a CPU with AVX2 alone (no AVX-512) torch 2.13 lays them out
    otherwise, and tiles made here would multiply as garbage; there compressed matrices are widened."""
    codes = torch.randint(0, 16, (TILE + TILE // 2, 2 * GROUP), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    try:
        torch_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError):
        return False
    ours = tile_codes(codes.to(torch.uint8))
    return torch_codes.numel() * torch_codes.element_size() == ours.numel() and \
        torch.equal(torch_codes.view(torch.uint8).view(-1), ours.view(-1))


@dataclass
class Tiles:
    codes: torch.Tensor   # uint8 [n, k / 2], the kernel's layout
    scale: torch.Tensor   # float16 [n, k / GROUP]
    low: torch.Tensor     # float16 [n, k / GROUP], each group's minimum
    kernel: torch.Tensor  # bfloat16 [k / GROUP, n, 2]: the kernel's scale and zero per group

    @property
    def shape(self) -> tuple:
        return self.codes.shape[0], self.codes.shape[1] * 2


def _pair_rows(codes: torch.Tensor, tile: int) -> torch.Tensor:
    """Codes uint8 [rows, k] (rows a multiple of `tile`) -> the kernel's bytes [rows, k / 2]."""
    rows, k = codes.shape
    if tile == TILE:  # byte j: rows j and j + 32 of the tile
        halves = codes.view(rows // TILE, 2, TILE // 2, k)
        low, high = halves[:, 0], halves[:, 1]
    else:  # a 32-row tile: byte j holds rows 2j and 2j + 1
        pairs = codes.view(rows // tile, tile // 2, 2, k)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
    return (low | (high << 4)).transpose(1, 2).reshape(rows, k // 2)


def _unpair_rows(packed: torch.Tensor, tile: int) -> torch.Tensor:
    """The kernel's bytes [rows, k / 2] -> codes uint8 [rows, k]."""
    rows, half = packed.shape
    k = half * 2
    columns = packed.view(rows // tile, k, tile // 2).transpose(1, 2)  # [tiles, tile / 2, k]
    low, high = columns & 15, columns >> 4
    stacked = torch.stack([low, high], 1) if tile == TILE else torch.stack([low, high], 2)
    return stacked.reshape(rows, k)


def _by_tiles(t: torch.Tensor, fn) -> torch.Tensor:
    """fn(rows, tile) over t's rows in 64-row tiles, then over a 32-row tail tile; joined."""
    whole = t.shape[0] - t.shape[0] % TILE
    parts = [fn(t[:whole], TILE)] if whole else []
    if whole < t.shape[0]:
        parts.append(fn(t[whole:], TILE // 2))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [n, k] (0..15) -> the kernel's bytes [n, k / 2]."""
    return _by_tiles(codes, _pair_rows)


def untile_codes(packed: torch.Tensor) -> torch.Tensor:
    """The kernel's bytes [n, k / 2] -> codes uint8 [n, k]."""
    return _by_tiles(packed, _unpair_rows)


def to_tiles(packed: torch.Tensor, k: int) -> Tiles:
    """quant.py's groups of an [n, k] weight (uint8 [n, packed_width(k)]) as Tiles."""
    n, g = packed.shape[0], groups(k)
    if not tileable(n, k):
        raise ValueError(f"a [{n}, {k}] weight does not fit the int4 kernel's tiles (rows a multiple of "
                         f"{TILE // 2}, columns of {GROUP})")
    record = packed.view(n, g, GROUP_BYTES)
    pairs = record[..., :GROUP // 2]  # a group's first half in the low nibbles, its second in the high ones
    codes = torch.stack([pairs & 15, pairs >> 4], 2).view(n, k)
    scale = record[..., GROUP // 2: GROUP // 2 + 2].contiguous().view(torch.float16).view(n, g)
    low = record[..., GROUP // 2 + 2:].contiguous().view(torch.float16).view(n, g)
    return Tiles(tile_codes(codes), scale, low, kernel_scales(scale, low))


def kernel_scales(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's scales and zeros, bfloat16 [groups, n, 2], from float16 [n, groups] scales and
    minima: zero = minimum + 8 * scale, so that (code - 8) * scale + zero = minimum + code * scale."""
    scale, low = scale.float(), low.float()
    return torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def matmul(x: torch.Tensor, tiles) -> torch.Tensor:
    """x [..., k] (bfloat16) times the weight's transpose (Tiles or a TiledWeight: its codes and
    kernel scales): [..., n], the weight never widened."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel takes contiguous rows only (x may be a slice)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, tiles.codes, GROUP, tiles.kernel)
    return out.view(*x.shape[:-1], out.shape[-1])


def dequantize(tiles: Tiles, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's values [n, k], exactly as quant.dequantize gives them (float32 math), into `out`
    (any float dtype) when given."""
    n, k = tiles.shape
    codes = untile_codes(tiles.codes).view(n, groups(k), GROUP)
    values = codes.float().mul_(tiles.scale.float().unsqueeze(-1)).add_(tiles.low.float().unsqueeze(-1)).view(n, k)
    if out is None:
        return values
    out.copy_(values)
    return out


# -- as the engine places them: one uint8 tensor of quant.py's size ----------------------------

def _block_rows(k: int) -> int:
    """Rows converted at once: whole tiles, about BLOCK_VALUES values (bounds the temporaries)."""
    return max(TILE, BLOCK_VALUES // k // TILE * TILE)


def _views(data: torch.Tensor, k: int) -> tuple:
    """(codes [n, k / 2], kernel scales [groups, n, 2]) inside a packed weight's bytes. Made once
    per tensor and kept on it: a weight held in memory, or a pooled buffer, is loaded every step
    (18 us a matrix, 2 ms of a SmolLM2 decode step)."""
    made = getattr(data, "_tile_views", None)
    if made is not None and made[0] == k:
        return made[1]
    n = data.shape[0]
    flat = data.reshape(-1)
    views = flat[: n * k // 2].view(n, k // 2), flat[n * k // 2:].view(torch.bfloat16).view(groups(k), n, 2)
    data._tile_views = (k, views)
    return views


def pack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """quant.py's groups [n, packed_width(k)] -> the same bytes' worth holding the kernel's codes
    (n * k / 2 bytes) then its scales and zeros (bfloat16 [groups, n, 2]), as [n, packed_width(k)],
    converted a block of rows at a time. A prompt step dequantizes from the kernel's bfloat16 scales
    and zeros, so the prompt and decode steps multiply by the same values."""
    out = torch.empty(packed.shape, dtype=torch.uint8)
    codes, kernel = _views(out, k)
    step = _block_rows(k)
    for start in range(0, packed.shape[0], step):
        tiles = to_tiles(packed[start: start + step], k)
        codes[start: start + step] = tiles.codes
        kernel[:, start: start + step] = tiles.kernel
    return out


class TiledWeight:
    """A weight as pack() lays it out, loaded: multiplied as stored for steps of few rows, and
    dequantized into `values` (a compute buffer, once per load) for steps of many."""
    kernel_name = "tiles"  # kernel_choice.py

    def __init__(self, data: torch.Tensor, k: int, values: torch.Tensor):
        self.codes, self.kernel = _views(data, k)
        self.data, self.values, self.shape, self._dequantized = data, values, (data.shape[0], k), False
        self.widens = values is not None  # None: multiplied as it is at every row count

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self)

    def widened(self) -> torch.Tensor:
        """The values [n, k] in `values`: (code - 8) * scale + zero, as the kernel computes them; a
        block of rows at a time, so that the float32 temporaries stay small beside a large weight."""
        if not self._dequantized:
            n, k = self.shape
            step = _block_rows(k)
            for start in range(0, n, step):
                rows = min(step, n - start)
                codes = untile_codes(self.codes[start: start + rows]).view(rows, groups(k), GROUP).float().sub_(8)
                scale, zero = self.kernel[:, start: start + rows].float().transpose(0, 1).unbind(-1)
                values = codes.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))
                self.values[start: start + rows].copy_(values.view(rows, k))
            self._dequantized = True
        return self.values
