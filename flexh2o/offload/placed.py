"""A weight as placed: its rows of dimension 0 split over the tiers, and how the split is chosen."""

import math
from dataclasses import dataclass

import torch

from flexh2o.offload.disk import ALIGN


@dataclass
class Segment:
    tier: str
    start: int  # rows [start, stop) of dimension 0
    stop: int
    data: torch.Tensor | None = None  # gpu / cpu
    file: object = None               # disk: a DiskFile holding the rows contiguously


@dataclass
class Placed:
    shape: tuple        # as stored
    dtype: torch.dtype  # as stored: uint8 when compressed
    segments: list
    decoded_shape: tuple | None = None  # compressed: the shape it dequantizes to
    tiled: bool = False  # compressed in the int4 kernel's layout (int4_tiles.pack), not quant.py's
    fmt: str = "groups"  # compressed: quant.py's groups, or a GGUF file's blocks (gguf_blocks.py)
    # Compressed: multiplied as stored at every row count where flexh2o's kernel takes it, never
    # widened (an LM head: a row per sequence; models/layer.py).
    any_rows: bool = False

    def resident(self) -> torch.Tensor | None:
        """The tensor itself when one memory tier holds it whole."""
        s = self.segments
        return s[0].data if len(s) == 1 and s[0].data is not None else None


def split_rows(shapes: list[tuple], row_bytes: list[int], gpu_percent: float, cpu_percent: float) -> list[dict]:
    """Rows of each tensor per tier, so that the tensors together put gpu_percent of their bytes on
    the gpu tier and cpu_percent in CPU memory (to within one row, or a few: see aligned_rows), the
    rest on disk; vectors all go on the gpu tier. Tensors are filled in order, gpu first, and a
    tensor straddling a quota boundary is split by rows."""
    total = sum(s[0] * b for s, b in zip(shapes, row_bytes))
    quota = {"gpu": total * gpu_percent / 100, "cpu": total * (gpu_percent + cpu_percent) / 100}
    used, out = 0, []
    for shape, rb in zip(shapes, row_bytes):
        rows, split = shape[0], {}
        if len(shape) == 1:
            # A vector (a bias, a norm's weights) stays on the compute device whatever the shares:
            # from disk each cost a device round trip, queued behind the large reads (0.2-6 ms here,
            # a dozen per layer of OPT-125M), and elsewhere a compute buffer, for a few kilobytes.
            out.append({"gpu": rows, "cpu": 0, "disk": 0})
            used += rows * rb
            continue
        start = 0
        for tier in ("gpu", "cpu"):
            n = max(0, min(rows - start, int(round((quota[tier] - used) / rb))))
            if n < rows - start:
                n = min(aligned_rows(n, rows, rb), rows - start)
            split[tier] = n
            start += n
            used += n * rb
        split["disk"] = rows - start
        used += split["disk"] * rb
        out.append(split)
    return out


def aligned_rows(n: int, rows: int, row_bytes: int) -> int:
    """n rounded to a whole number of disk blocks' worth of rows (disk.ALIGN bytes), where that
    changes the split by at most 1/32 of the tensor: a tensor's disk rows then start on a block boundary in its
    compute buffer, and O_DIRECT reads them straight in instead of through a bounce block and a
    copy (disk.py; a third of the bytes read went that way with OPT-125M's weights 95% on disk)."""
    step = ALIGN // math.gcd(row_bytes, ALIGN)
    if step == 1 or step * 32 > rows:
        return n
    return round(n / step) * step
