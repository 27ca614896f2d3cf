"""CPU memory at a disk block boundary: what O_DIRECT reads and writes need (offload/disk.py)."""

import torch

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor whose first byte sits at an ALIGN boundary."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip: skip + nbytes]
