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
    n = data.shape[0]
    if x.is_contiguous():  # rows of k values as they are: no view to make (a decode step makes 120 products)
        rows, count, stride = x, x.numel() // k, k
    else:
        rows = x.reshape(-1, k)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        count, stride = rows.shape[0], rows.stride(0)
    out = torch.empty(*x.shape[:-1], n)
    if not data.is_contiguous():
        data = data.contiguous()
    product = lib.matmul_int8 if int8 else lib.matmul_all
    if product(gguf_blocks.NATIVE_FORMATS[fmt], rows.data_ptr(), count, stride, k, data.data_ptr(), out.data_ptr(),
               n, n, torch.get_num_threads()):
        raise MemoryError(f"no memory left for {count} rows of {k} values quantized to int8")
    return out


class GroupedWeight:
    """A compressed matrix as loaded: its groups `data` [n, row bytes] in format `fmt` (quant.py's
    groups, or a GGUF file's blocks: gguf_blocks.py) multiplied as they are, and widened into a
    compute buffer [n, k] only if a step of many rows asks for it. `values`: that buffer; or a
    function that takes one from the pool the first time (a weight kept loaded from token to token,
    WeightIO.loads_once); or None: multiplied as it is at every row count (Placed.any_rows).
    int8: multiplied with int8 activations (int8_activations.py)."""
    kernel_name = "groups"  # kernel_choice.py

    def __init__(self, data: torch.Tensor, k: int, values, fmt: str = "groups", int8: bool = False):
        self.data, self.shape, self.fmt, self._widened = data, (data.shape[0], k), fmt, False
        self.widens = values is not None
        self._take = values if callable(values) else None
        self.values = None if self._take is not None else values
        self.int8 = int8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.data, self.shape[1], self.fmt, self.int8)

    def widened(self) -> torch.Tensor:
        if self.values is None:
            self.values = self._take()
        if not self._widened:
            dequantize_as(self.data, self.fmt, self.shape[1], self.values)
            self._widened = True
        return self.values

    def hand_back(self) -> torch.Tensor | None:
        """The compute buffer this load holds, for the pool (None: it holds none); a weight kept
        loaded takes a new one if it widens again."""
        values = self.values
        if self._take is not None:
            self.values, self._widened = None, False
        return values
