"""The low-bit formats' sizes, shared by every module of compression/ (the bottom of it).

quant.py's groups: GROUP values a record of GROUP_BYTES (4-bit codes, then a float16 scale and
minimum). A GGUF file's blocks (gguf_blocks.py): BLOCK values a record of BLOCK_BYTES[format].
"""

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
