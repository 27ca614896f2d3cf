"""The device that computes and the dtype it computes in: the defaults, and the flags' values checked."""

import torch

from flexh2o.common.errors import UsageError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device) -> torch.dtype:
    """float16 on CUDA; float32 on every CPU, even one that multiplies bfloat16 in hardware (AMX,
    AVX512-BF16), where bfloat16 is faster: its rounding made a greedy record's text depend on which
    other records shared its batch, while float32's differences between batch shapes, at the level
    of its last bits, changed none (docs/design.md, "Results that do not depend on the batch").
    --dtype bfloat16 still runs it."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UsageError("--dtype", f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError("--device", f"unknown device {device!r}; accepted: cpu, cuda, cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError("--device", f"unsupported device {device!r}; accepted: cpu, cuda, cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "cuda was asked for but torch sees no CUDA device; use --device cpu")
    return dev
