"""Matrices kept as the checkpoint stores them: a GGUF file's low-bit blocks (Q4_0, Q4_1, Q8_0),
and 16-bit values (F16, BF16; GGUF or safetensors) in a float32 run.

In a float32 run, a GGUF matrix in one of the low-bit formats is placed as its own bytes (rows of
blocks of 32 values, formats.py's LAYOUTS) instead of being widened to float (or, with
--compress-weight, quantized again into quant.py's groups): no float copy of it is made while
loading, nothing is lost, it is held and moved as the bytes llama.cpp reads, and at few rows the
kernel multiplying it as stored is faster than float32's product (a 4-bit matrix is an eighth of
the bytes to read). This is the default where flexh2o's kernels are built (keeps_low_bit), not a
choice of --compress-weight. It is dequantized into a compute buffer, or multiplied as stored
(grouped_weight.matmul: the C kernels of native/blocks.c, float32 activations), as quant.py's
groups are; the dequantized values are bit-equal to gguf_reader.py's. In other widths the matrices
are widened, or with --compress-weight quantized into quant.py's groups: the bfloat16 kernel
(int4_tiles.py) takes those, and its bfloat16 scales could not hold a block's float16 ones.

A float32 run whose weights do not all sit on the compute tier keeps a 16-bit checkpoint's
matrices 16-bit on every tier (keeps_16_bit), as blocks of 32 values with no scale: half the
bytes stored and moved, widened exactly into the compute buffer at each load (or multiplied as
they are by the same kernels). Weights all on the compute tier are used in place in float32 as
before: widening them at every step would cost time and save nothing a run needs. The LM head
(models/layer.py's one_of_a_kind, always on the compute tier) follows the same rule: where the
CPU multiplies it, the kernel takes it at every row count (a row per sequence), so no float32 copy
of it exists at all (weight_io.py); on CUDA it is widened into a buffer per load as the rest are.
"""

import torch

from flexh2o import native
from flexh2o.compression import gpu_dequant
from flexh2o.compression.formats import BLOCK, BLOCK_BYTES, NATIVE_DTYPES, NATIVE_FORMATS, SIXTEEN_BIT


def keeps_16_bit(policy, dtype_bytes: int) -> bool:
    """Whether a run keeps a checkpoint's 16-bit matrices 16-bit (see above): a float32 run, not
    compressing the weights (which quantizes them instead), placing some on the cpu tier or disk."""
    return dtype_bytes == 4 and not policy.compress_weight and policy.w_gpu_percent < 100


def keeps_low_bit(dtype_bytes: int) -> bool:
    """Whether a run keeps a checkpoint's low-bit matrices as their blocks (see above): a float32 run
    where flexh2o's kernels are built. Without them torch's operations would widen every block
    matrix at every step; it is widened once while loading instead."""
    return dtype_bytes == 4 and native.library() is not None


def is_low_bit(fmt: str | None) -> bool:
    return fmt in BLOCK_BYTES and fmt not in SIXTEEN_BIT


def applies(fmt: str | None, matrix: bool, sixteen_bit: bool, low_bit: bool) -> bool:
    """Whether a tensor its checkpoint stores in `fmt` is placed in it, in a float32 run: low-bit
    blocks where it is a matrix (quant.compressible) and the run keeps them (keeps_low_bit, or
    --compress-weight), 16-bit values where keeps_16_bit holds."""
    return fmt in SIXTEEN_BIT and sixteen_bit or is_low_bit(fmt) and matrix and low_bit


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
    if blocks.is_cuda:
        if gpu_dequant.takes(out):  # one fused kernel
            return gpu_dequant.dequantize(blocks, fmt, out)
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
    if fmt in SIXTEEN_BIT:
        return blocks.contiguous().view(SIXTEEN_BIT[fmt]).float()
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
