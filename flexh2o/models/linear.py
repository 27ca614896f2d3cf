"""The layers' matrix product: F.linear, or a 4-bit weight multiplied as stored: torch's int4 kernel
on a tiled one (int4_tiles.py, bfloat16), flexh2o's own on quant.py's groups (grouped_weight.py,
float32).

A step of few rows (decode) multiplies the 4-bit weight as stored; a step of many (a prompt) widens
it once per load and multiplies in full width, which is faster there (results/int4_kernels.md: the
int4 kernel beats dequantize-then-multiply up to 128 rows, 1.5-1.8x, and loses at 512, 0.5x).
"""

import torch
import torch.nn.functional as F

from flexh2o.compression.grouped_weight import GroupedWeight
from flexh2o.compression.int4_tiles import TiledWeight
from flexh2o.compression.kernel_choice import max_rows


def as_stored(weight, rows: int) -> bool:
    """Whether a 4-bit or GGUF weight (TiledWeight, GroupedWeight) is multiplied as stored at this row count."""
    return not weight.widens or rows <= max_rows(weight.kernel_name, getattr(weight, "fmt", "groups"))


def never_widened(weight, rows: int) -> bool:
    """Whether linear() multiplies `weight` (any loaded weight) at this row count without widening it
    into a buffer of the pool."""
    return not isinstance(weight, (TiledWeight, GroupedWeight)) or as_stored(weight, rows)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, (TiledWeight, GroupedWeight)):
        if as_stored(weight, x.numel() // x.shape[-1]):
            out = weight.matmul(x)
            return out if bias is None else out.add_(bias)
        weight = weight.widened()
    return F.linear(x, weight, bias)
