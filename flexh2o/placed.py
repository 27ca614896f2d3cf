"""A weight as placed: its rows of dimension 0 split over the tiers, and how the split is chosen."""

from dataclasses import dataclass

import torch


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

    def resident(self) -> torch.Tensor | None:
        """The tensor itself when one memory tier holds it whole."""
        s = self.segments
        return s[0].data if len(s) == 1 and s[0].data is not None else None


def split_rows(shapes: list[tuple], row_bytes: list[int], gpu_percent: float, cpu_percent: float) -> list[dict]:
    """Rows of each tensor per tier, so that the tensors together put gpu_percent of their bytes on
    the gpu tier and cpu_percent in CPU memory (to within one row), the rest on disk. Tensors are
    filled in order, gpu first, and a tensor straddling a quota boundary is split by rows."""
    total = sum(s[0] * b for s, b in zip(shapes, row_bytes))
    quota = {"gpu": total * gpu_percent / 100, "cpu": total * (gpu_percent + cpu_percent) / 100}
    used, out = 0, []
    for shape, rb in zip(shapes, row_bytes):
        rows, split = shape[0], {}
        start = 0
        for tier in ("gpu", "cpu"):
            n = max(0, min(rows - start, int(round((quota[tier] - used) / rb))))
            split[tier] = n
            start += n
            used += n * rb
        split["disk"] = rows - start
        used += split["disk"] * rb
        out.append(split)
    return out
