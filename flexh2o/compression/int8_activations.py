"""--int8-activations: a float32 run's products of a GGUF file's Q4_0, Q4_1 and Q8_0 blocks taken
with int8 activations, as llama.cpp takes them (native/int8_dots.c), where they are multiplied as
stored: at up to kernel_choice.MAX_ROWS rows (a decode step of up to 32 sequences a gpu-batch, a
prompt step of up to 32 tokens), and for the LM head at every row count. Larger steps keep widening
the matrix and multiplying in float32.

Each row of x is quantized alone, so a row's result does not depend on the rows beside it in such a
step; it does differ from the float32 product, by about 1e-3 of its scale, so the option is off by
default and its quality is measured (results/int8_activations.md). A run where it cannot apply (not
a float32 run on the CPU) is refused; one where nothing would take it (no kernels built, no matrix
kept in those blocks) is told so and runs as it would without it.
"""

import torch

from flexh2o import native
from flexh2o.common.errors import UsageError

FLAG = "--int8-activations"
FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # the blocks int8_dots.c multiplies


def check(device_type: str, dtype: torch.dtype, stored_formats) -> str | None:
    """Raises UsageError where the option cannot apply to this run; returns a note where no product
    of this model would take it (stored_formats: the spec's (name, format) pairs), else None."""
    if device_type != "cpu":
        raise UsageError(FLAG, f"applies where the CPU computes (--device cpu), not on {device_type}")
    if dtype != torch.float32:
        raise UsageError(FLAG, f"applies to float32 runs (the blocks' product of float32 activations); got "
                         f"--dtype {str(dtype).removeprefix('torch.')}")
    if native.library() is None:
        return f"{FLAG} does not apply here: flexh2o's C kernels are not built, so the blocks are widened to float32"
    if not any(fmt in FORMATS for _, fmt in stored_formats):
        return f"{FLAG} does not apply to this model: none of its matrices is stored as {', '.join(FORMATS)} blocks"
    return None
