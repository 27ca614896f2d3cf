"""The layers' matrix product: F.linear, or the int4 kernel on a tiled 4-bit weight (int4_tiles.py).

A step of few rows (decode) multiplies the tiled weight unwidened; a step of many (a prompt) widens
it once per load and multiplies in full width, which is faster there (results/int4_kernels.md: the
kernel beats dequantize-then-multiply up to 128 rows, 1.5-1.8x, and loses at 512, 0.5x).
"""

import torch
import torch.nn.functional as F

from ..int4_tiles import TiledWeight

FUSED_MAX_ROWS = 256  # rows multiplied unwidened, at most


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, TiledWeight):
        if x.numel() // x.shape[-1] <= FUSED_MAX_ROWS:
            out = weight.matmul(x)
            return out if bias is None else out.add_(bias)
        weight = weight.widened()
    return F.linear(x, weight, bias)
