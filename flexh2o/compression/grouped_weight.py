"""A loaded 4-bit matrix in quant.py's own groups, multiplied as stored by flexh2o's C kernel.

Where the CPU computes in float32, torch's int4 and int8 kernels run slower than the full-width
product (results/int4_kernels.md), so flexh2o multiplies its groups itself: native/quant4.c's
matmul_groups makes each weight value in registers once per block of 8 rows and multiplies it
there, so a matrix is read, moved and held at 0.14x of its float32 bytes. A step of few rows
(decode) multiplies the groups as they are; a step of many (a prompt) widens them once per load
into `values` (a compute buffer) and multiplies in full width, which is faster there.
"""

import torch

from flexh2o import native
from flexh2o.compression import gguf_blocks
from flexh2o.compression.quant import dequantize_as


def matmul(x: torch.Tensor, data: torch.Tensor, k: int, fmt: str = "groups", int8: bool = False) -> torch.Tensor:
    """x [..., k] (float32) times the transpose of the weight whose rows `data` holds in format
    `fmt` (quant.Packed: quant.py's groups, or a GGUF file's blocks): [..., n]. int8: x's rows
    quantized to int8 first (native/int8_dots.c; fmt one of int8_activations.FORMATS)."""
    lib = native.library()
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = data.shape[0]
    out = torch.empty(len(rows), n)
    data = data.contiguous()
    product = lib.matmul_int8 if int8 else lib.matmul_all
    if product(gguf_blocks.NATIVE_FORMATS[fmt], rows.data_ptr(), len(rows), rows.stride(0), k, data.data_ptr(),
               out.data_ptr(), n, n, torch.get_num_threads()):
        raise MemoryError(f"no memory left for {len(rows)} rows of {k} values quantized to int8")
    return out.view(*x.shape[:-1], n)


class GroupedWeight:
    """A compressed matrix as loaded: its groups `data` [n, row bytes] in format `fmt` (quant.py's
    groups, or a GGUF file's blocks: gguf_blocks.py) and `values`, a compute buffer [n, k] filled
    only if a step of many rows asks for the widened matrix; None for a matrix multiplied as it is
    at every row count (Placed.any_rows). int8: multiplied with int8 activations (int8_activations.py)."""
    kernel_name = "groups"  # kernel_choice.py

    def __init__(self, data: torch.Tensor, k: int, values: torch.Tensor, fmt: str = "groups", int8: bool = False):
        self.data, self.values, self.shape, self.fmt, self._widened = data, values, (data.shape[0], k), fmt, False
        self.int8 = int8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.data, self.shape[1], self.fmt, self.int8)

    def widened(self) -> torch.Tensor:
        if not self._widened:
            dequantize_as(self.data, self.fmt, self.shape[1], self.values)
            self._widened = True
        return self.values
