"""Which kernel multiplies a compressed matrix without widening it first, and up to how many rows.

- "tiles": torch's CPU int4 kernel, bfloat16 activations, the matrix placed in its layout
  (int4_tiles.py): rows a multiple of 32, columns of 64, where torch lays its codes out so;
- "groups": flexh2o's own C kernel on quant.py's groups as they are (grouped_weight.py), float32
  activations: columns a multiple of 64, where the kernels are built (native/); also a GGUF
  file's Q4_0/Q4_1/Q8_0 blocks and F16/BF16 matrices (gguf_blocks.py).
A step of more rows than its kernel's limit widens the matrix once per load and multiplies in full
width, which is faster there (models/linear.py). On CUDA every compressed matrix is widened.
"""

import functools

import torch

from flexh2o import native
from flexh2o.compression.formats import SIXTEEN_BIT
from flexh2o.compression.int4_tiles import tileable, torch_lays_codes_so
from flexh2o.compression.quant import GROUP

MAX_ROWS = {"tiles": 256, "groups": 32}  # results/int4_kernels.md
# A 16-bit matrix multiplied as stored (native/sixteen_bit.c, each value widened in registers), by
# the floats a vector of the build holds. Against widened into a buffer then F.linear, on a 2-core
# Zen 4: built with AVX-512, 190-217 GFLOPS against 91-172 at 128-512 rows (0.9-1.2x past that);
# with AVX2 alone, 120-139 against 96-115 at 128 rows but 116-138 against 133-179 at 256-512. The
# plain C build keeps the 4-bit products' limit.
SIXTEEN_BIT_MAX_ROWS = {16: 512, 8: 128}


@functools.cache
def _sixteen_bit_rows(lib) -> int:
    return SIXTEEN_BIT_MAX_ROWS.get(lib.sixteen_bit_width() if lib is not None else 0, MAX_ROWS["groups"])


def max_rows(kernel: str, fmt: str = "groups") -> int:
    """The most rows at which `kernel` multiplies a matrix in format `fmt` as stored."""
    if kernel == "groups" and fmt in SIXTEEN_BIT:
        return _sixteen_bit_rows(native.library())
    return MAX_ROWS[kernel]


def kernel_for(shape, dtype: torch.dtype, on_cpu: bool, groups_built: bool, fmt: str = "groups") -> str | None:
    """The kernel for a compressed matrix of this (decoded) shape in format `fmt` (quant.Packed) in a
    run of `dtype`; None: widened. groups_built: whether flexh2o's own kernels are there
    (native.library(), or a profile that timed them); they take a GGUF file's blocks too."""
    if not on_cpu or len(shape) != 2:
        return None
    if fmt != "groups":
        return "groups" if dtype == torch.float32 and groups_built else None
    if dtype == torch.bfloat16 and tileable(*shape) and torch_lays_codes_so():
        return "tiles"
    if dtype == torch.float32 and shape[-1] % GROUP == 0 and groups_built:
        return "groups"
    return None


def multiplied_as_stored(shape, dtype: torch.dtype, on_cpu: bool, fmt: str) -> bool:
    """Whether a compressed matrix multiplied at every row count (an LM head: Placed.any_rows) is
    taken as stored by flexh2o's own kernel, so that no buffer of its values is made."""
    return kernel_for(shape, dtype, on_cpu, native.library() is not None, fmt) == "groups"
