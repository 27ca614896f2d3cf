"""Dequantizing a loaded low-bit matrix on the GPU: one fused kernel per matrix.

Every block format a weight is placed in is a row of records, each one block of values: quant.py's
groups (64 values in 36 bytes: 32 bytes of nibbles, then a float16 scale and minimum) and a GGUF
file's Q4_0, Q4_1 and Q8_0 blocks (32 values; gguf_blocks.py). They differ only in where the codes,
the scale and the minimum sit, so one kernel (triton_dequant.py) takes them all, described by a
Layout. 16-bit blocks (F16, BF16) are the values themselves: one copy.

Before, a CUDA run dequantized with quant.dequantize's torch operations, written for the CPU: per
block of 4M values about ten kernels and three float32 temporaries (the codes unpacked, stacked,
widened, scaled, shifted, then narrowed into the buffer: ~30 bytes of memory traffic per value
against 2.6 for float16), and the Python of each block on an I/O thread, under the GIL the compute
thread needs too. OPT-30B has about 150 such blocks per transformer layer (7,000 per token step),
and the I/O thread waited on the device for each matrix's dequantizing before it queued the next
matrix's copy, so the copy engine idled meanwhile. Where Triton is
missing the torch path here stands in: five kernels per block, no temporaries beyond a Workspace
made once, the same values.
"""

import math
import os
import threading

import torch

from flexh2o.common.messages import say
from flexh2o.compression.formats import BLOCK_VALUES, LAYOUTS, SIXTEEN_BIT, Layout


FORMATS = (*LAYOUTS, *SIXTEEN_BIT)
WORKSPACE_BYTES = 5 * BLOCK_VALUES  # a Workspace: a block's codes (uint8) and values (float32)

_KERNEL = []  # [triton_dequant, or None where Triton cannot be imported], looked up once


def kernel():
    """triton_dequant, or None where it is turned off (FLEXH2O_TRITON=0) or Triton cannot be
    imported (said once on stderr)."""
    if os.environ.get("FLEXH2O_TRITON", "1") == "0":
        return None
    if not _KERNEL:
        try:
            from flexh2o.compression import triton_dequant
        except Exception as e:  # ImportError, or a Triton that fails to start: the torch path still works
            triton_dequant = None
            say(f"flexh2o: Triton is not usable ({type(e).__name__}: {e}); 4-bit weights are dequantized on the "
                "GPU by torch's operations instead (slower)")
        _KERNEL.append(triton_dequant)
    return _KERNEL[0]


def leading(out: torch.Tensor) -> tuple[tuple, tuple] | None:
    """The sizes and strides of out's leading dimensions, as three (dimensions merged where their
    strides allow, a size-1 dimension added in front where fewer); None where out's values are not
    adjacent along its last dimension or more than three leading dimensions remain."""
    if out.dim() == 0 or (out.stride(-1) != 1 and out.shape[-1] > 1):
        return None
    dims = []
    for size, stride in zip(out.shape[:-1], out.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 3:
        return None
    dims = [(1, 0)] * (3 - len(dims)) + dims
    return tuple(d[0] for d in dims), tuple(d[1] for d in dims)


def takes(out: torch.Tensor) -> bool:
    """Whether dequantize() writes into `out`."""
    return leading(out) is not None


class Workspace:
    """The torch path's working memory, made on first use and kept: the codes of a block and its
    float32 values. Its users queue on one stream, one matrix at a time (the lock): on a GPU that
    stream runs their kernels in the order they were queued, so a matrix never finds the
    workspace in use."""

    def __init__(self, least: int = BLOCK_VALUES):
        self.lock = threading.Lock()
        self.least = least  # values it holds at least: a block's, so that other shapes fit as well
        self.codes = self.values = None
        self.made = 0  # times its memory was made (once, unless a row outgrows it)

    def take(self, values: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.values is None or self.values.numel() < values or self.values.device != device:
            size = max(values, self.least)
            self.codes = torch.empty(size, dtype=torch.uint8, device=device)
            self.values = torch.empty(size, dtype=torch.float32, device=device)
            self.made += 1
        return self.codes, self.values


def dequantize(packed: torch.Tensor, fmt: str, out: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """out [..., n] <- the values of packed [..., row bytes] (uint8, rows of blocks in format `fmt`,
    quant.Packed, as many rows as out has), on the device both are on: one Triton kernel on CUDA,
    else the torch path (in `workspace`, or in memory made for this call). See takes() for out."""
    n = out.shape[-1]
    if fmt in SIXTEEN_BIT:
        out.copy_(packed.contiguous().view(SIXTEEN_BIT[fmt]).view(out.shape))
        return out
    layout, dims = LAYOUTS[fmt], leading(out)
    if dims is None:
        raise ValueError(f"the fused dequantizer cannot write an output of shape {tuple(out.shape)} and strides "
                         f"{out.stride()}")
    rows = math.prod(out.shape[:-1])
    if packed.numel() != rows * -(-n // layout.values) * layout.record:
        raise ValueError(f"{packed.numel()} bytes do not hold {rows} rows of {n} values in {fmt}")
    if not out.numel():
        return out
    packed = packed.contiguous()
    triton_dequant = kernel() if packed.is_cuda else None
    if triton_dequant is not None and launched(triton_dequant, packed, layout, out, rows, dims):
        return out
    workspace = workspace or Workspace(least=0)
    with workspace.lock:
        _by_torch(packed, layout, out, workspace)
    return out


def launched(triton_dequant, packed, layout: Layout, out, rows: int, dims: tuple) -> bool:
    """Whether the Triton kernel ran; where it fails (Triton cannot compile for this GPU, say) it is
    given up on for the process, in one line on stderr, and the torch path goes on."""
    try:
        triton_dequant.launch(packed, layout, out, rows, *dims)
        return True
    except Exception as e:
        _KERNEL[:] = [None]
        say(f"flexh2o: the Triton kernel failed ({type(e).__name__}: {e}); 4-bit weights are dequantized on the "
            "GPU by torch's operations instead (slower)")
        return False


def _by_torch(packed: torch.Tensor, layout: Layout, out: torch.Tensor, workspace: Workspace):
    """The torch path: a slice of out's first dimension (BLOCK_VALUES values, or one index) at a time."""
    n = out.shape[-1]
    out = out.view(1, *out.shape) if out.dim() == 1 else out
    width = -(-n // layout.values) * layout.values  # values of a row, the last block's padding included
    per_index = math.prod(out.shape[1:-1]) * width
    step = max(1, BLOCK_VALUES // per_index)
    codes_space, values_space = workspace.take(min(step, len(out)) * per_index, packed.device)
    packed = packed.view(len(out), -1)
    at, half = layout.codes_at, layout.values // 2
    for start in range(0, len(out), step):
        stop = min(start + step, len(out))
        record = packed[start:stop].view(-1, layout.record)
        count = len(record) * layout.values
        values = values_space[:count].view(-1, layout.values)
        if layout.bits == 4:
            codes = codes_space[:count].view(-1, layout.values)
            torch.bitwise_and(record[:, at: at + half], 15, out=codes[:, :half])
            torch.bitwise_right_shift(record[:, at: at + half], 4, out=codes[:, half:])
            values.copy_(codes)
        else:
            values.copy_(record[:, at: at + layout.values].view(torch.int8))
        if layout.zero:
            values.sub_(layout.zero)
        scale = record[:, layout.scale_at: layout.scale_at + 2].view(torch.float16)
        if layout.low_at >= 0:
            torch.addcmul(record[:, layout.low_at: layout.low_at + 2].view(torch.float16), values, scale, out=values)
        else:
            values.mul_(scale)
        part = out[start:stop]
        part.copy_(values.view(*part.shape[:-1], width)[..., :n])
