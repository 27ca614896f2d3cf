"""The low-bit formats' sizes and record layouts, shared by every module of compression/ (its bottom).

quant.py's groups: GROUP values a record of GROUP_BYTES (4-bit codes, then a float16 scale and
minimum). A GGUF file's blocks (gguf_blocks.py): BLOCK values a record of BLOCK_BYTES[format].
"""

from dataclasses import dataclass

import torch

GROUP = 64
GROUP_BYTES = GROUP // 2 + 4  # the codes, then the float16 scale and minimum
BLOCK_VALUES = 1 << 22  # values quantized, or dequantized into an `out`, at once: bounds the temporaries

BLOCK = 32
SIXTEEN_BIT = {"F16": torch.float16, "BF16": torch.bfloat16}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "BF16": 64}

# The C kernels' enums (native/quant4.c, native/blocks.c)
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NATIVE_FORMATS = {"groups": -1, "Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "F16": 3, "BF16": 4}


# Where a record of each block format keeps its codes, scale and minimum (gpu_dequant.py and
# gguf_reader.py read them by it).
@dataclass(frozen=True)
class Layout:
    values: int    # values a record holds
    record: int    # its bytes
    codes_at: int  # where its codes start
    scale_at: int  # where its float16 scale is
    low_at: int    # where its float16 minimum is (added to every value); -1: none
    bits: int      # 4: two codes a byte, the record's first half in the low nibbles; 8: one signed code a byte
    zero: int      # subtracted from every code


LAYOUTS = {
    "groups": Layout(GROUP, GROUP_BYTES, 0, GROUP // 2, GROUP // 2 + 2, 4, 0),
    "Q4_0": Layout(BLOCK, BLOCK_BYTES["Q4_0"], 2, 0, -1, 4, 8),
    "Q4_1": Layout(BLOCK, BLOCK_BYTES["Q4_1"], 4, 0, 2, 4, 0),
    "Q8_0": Layout(BLOCK, BLOCK_BYTES["Q8_0"], 2, 0, -1, 8, 0),
}
