"""The fused dequantizing kernel (Triton): low-bit blocks in, 16- or 32-bit values out, one launch a matrix.

Imported only where a CUDA tensor is dequantized (gpu_dequant.py), or by a test that runs it in
Triton's interpreter on the CPU (TRITON_INTERPRET=1). One program takes BLOCKS consecutive blocks
(of one row or of several) and writes their values straight into the output rows: nothing else is
read or written, so a matrix costs its stored bytes plus its output bytes of memory traffic.

The arithmetic is quant.py's and gguf_reader.py's, in float32, then rounded once to the output's
dtype: a code (at most 8 bits) times a float16 scale is exact in float32, so whether the compiler
fuses the multiply and the add does not change a bit.
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

VALUES_PER_PROGRAM = 2048


@triton.jit
def _half(at, live):
    """The float16 stored little-endian at byte pointers `at`, as float32."""
    low = tl.load(at, mask=live, other=0).to(tl.uint16)
    high = tl.load(at + 1, mask=live, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store(dst, at, first, col, codes, scale, low, n, live, LOW_AT: tl.constexpr, ZERO: tl.constexpr):
    """Writes the values of `codes` [BLOCKS, columns] at output columns first + col of each block."""
    values = (codes.to(tl.float32) - ZERO) * scale
    if LOW_AT >= 0:
        values = values + low
    where = first[:, None] + col[None, :]
    tl.store(at[:, None] + col[None, :], values.to(dst.dtype.element_ty), mask=live[:, None] & (where < n))


@triton.jit
def _dequantize(src, dst, total, per_row, n, size1, size2, stride0, stride1, stride2,
                VALUES: tl.constexpr, RECORD: tl.constexpr, CODES_AT: tl.constexpr, SCALE_AT: tl.constexpr,
                LOW_AT: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < total
    record = src + block * RECORD
    scale = _half(record + SCALE_AT, live)[:, None]
    low = scale
    if LOW_AT >= 0:
        low = _half(record + LOW_AT, live)[:, None]
    row = block // per_row  # of out's up to three leading dimensions, flattened: where it starts
    outer = row // size2
    at = dst + (outer // size1) * stride0 + (outer % size1) * stride1 + (row % size2) * stride2
    first = (block % per_row) * VALUES
    at += first
    if BITS == 4:  # a block's first half in the low nibbles, its second half in the high ones
        col = tl.arange(0, VALUES // 2)
        pairs = tl.load(record[:, None] + CODES_AT + col[None, :], mask=live[:, None], other=0)
        _store(dst, at, first, col, pairs & 15, scale, low, n, live, LOW_AT, ZERO)
        _store(dst, at, first, col + VALUES // 2, pairs >> 4, scale, low, n, live, LOW_AT, ZERO)
    else:  # one signed code a byte
        col = tl.arange(0, VALUES)
        codes = tl.load(record[:, None] + CODES_AT + col[None, :], mask=live[:, None], other=0)
        _store(dst, at, first, col, codes.to(tl.int8, bitcast=True), scale, low, n, live, LOW_AT, ZERO)


def launch(packed, layout, out, rows: int, sizes: tuple, strides: tuple):
    """out [..., n] <- the values of packed (contiguous: `rows` rows of blocks in `layout`,
    formats.Layout), out's rows being its leading dimensions of `sizes` and `strides` (three):
    one kernel launch."""
    n = out.shape[-1]
    per_row = -(-n // layout.values)
    total = rows * per_row
    blocks = VALUES_PER_PROGRAM // layout.values
    with torch.cuda.device(out.device) if out.is_cuda else nullcontext():  # an I/O thread's device may be another
        _dequantize[(triton.cdiv(total, blocks),)](
            packed, out, total, per_row, n, sizes[1], sizes[2], *strides, VALUES=layout.values, RECORD=layout.record,
            CODES_AT=layout.codes_at, SCALE_AT=layout.scale_at, LOW_AT=layout.low_at, BITS=layout.bits,
            ZERO=layout.zero, BLOCKS=blocks)
