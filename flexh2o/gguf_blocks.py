"""A GGUF file's low-bit blocks kept as the file stores them: Q4_0, Q4_1 and Q8_0.

With --compress-weight in a float32 run, a GGUF matrix in one of these formats is placed as its
own bytes (rows of blocks of 32 values, gguf_reader.py's BLOCK_LAYOUTS) instead of being widened
to float and quantized again into quant.py's groups: no float copy of it is made while loading,
nothing is lost to requantizing, and it moves as the bytes llama.cpp reads. It is dequantized
into a compute buffer, or multiplied unwidened (grouped_weight.matmul: the C kernels of
native/blocks.c, float32 activations), as quant.py's groups are; the dequantized values are
bit-equal to gguf_reader.py's. In other widths the matrices are quantized into quant.py's groups
as before: the bfloat16 kernel (int4_tiles.py) takes those, and its bfloat16 scales could not
hold a block's float16 ones.
"""

import torch

from . import native
from .quant import NATIVE_DTYPES

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
NATIVE_FORMATS = {"groups": -1, "Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # native/blocks.c's enum (groups: quant.py's)


def holds(fmt: str | None, shape) -> bool:
    """Whether a matrix of this shape in format `fmt` is kept in its blocks."""
    return fmt in BLOCK_BYTES and len(shape) == 2 and shape[-1] % BLOCK == 0


def row_bytes(fmt: str, n: int) -> int:
    """Bytes of one row of n values."""
    return n // BLOCK * BLOCK_BYTES[fmt]


def dequantize(blocks: torch.Tensor, fmt: str, n: int, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of rows of blocks [..., row_bytes(fmt, n)] (uint8), as [..., n] of out's dtype
    (or `dtype`), on the blocks' device."""
    if out is None:
        out = torch.empty(*blocks.shape[:-1], n, dtype=dtype, device=blocks.device)
    lib = native.library() if blocks.device.type == "cpu" else None
    rows = out.view(-1, n)
    if lib is None or out.dtype not in NATIVE_DTYPES or not out.is_contiguous():
        out.copy_(_dequantize_torch(blocks, fmt).view(out.shape))
        return out
    blocks = blocks.contiguous()
    native.split_rows(lambda a, b: lib.dequantize_blocks(NATIVE_FORMATS[fmt], blocks.data_ptr(), n, rows.data_ptr(),
                                                         NATIVE_DTYPES[out.dtype], n, a, b), len(rows), rows.numel())
    return out


def _dequantize_torch(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values [rows, n] by torch operations (any device): gguf_reader.py's arithmetic."""
    b = blocks.reshape(-1, BLOCK_BYTES[fmt])

    def half(at):
        return b[:, at: at + 2].contiguous().view(torch.float16).float()
    if fmt == "Q8_0":
        values = b[:, 2:].contiguous().view(torch.int8).float() * half(0)
    else:
        q = b[:, 4:] if fmt == "Q4_1" else b[:, 2:]
        q = torch.cat([q & 0x0F, q >> 4], dim=1).float()
        values = q * half(0) + half(2) if fmt == "Q4_1" else (q - 8) * half(0)
    return values.view(*blocks.shape[:-1], -1)
