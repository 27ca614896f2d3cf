"""Where tensors live (compute device "gpu", CPU memory, disk) and how they reach the compute device.

A tensor is placed by rows of its first dimension: some rows on the gpu tier, some in CPU memory,
the rest on disk, so each tier gets the share of bytes the policy asks for. Loading assembles the
rows into a reusable compute buffer; with overlap on, that work runs on the I/O threads and the
caller gets a `Pending` to wait on. Where the compute device is the CPU, the gpu and cpu tiers
are the same memory: a tensor held whole by either is used in place, never copied.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

TIERS = ("gpu", "cpu", "disk")


class Pending:
    """A value that an I/O thread may still be filling; wait() returns it once it is ready."""

    def __init__(self, value, future=None):
        self.value, self.future = value, future

    def wait(self):
        if self.future is not None:
            self.future.result()
            self.future = None
        return self.value


@dataclass
class Segment:
    tier: str
    start: int  # rows [start, stop) of dimension 0
    stop: int
    data: torch.Tensor | None = None  # gpu / cpu
    file: object = None               # disk: a DiskFile holding the rows contiguously


@dataclass
class Placed:
    shape: tuple
    dtype: torch.dtype
    segments: list

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


class Tiers:
    def __init__(self, device, dtype: torch.dtype, disk=None, overlap: bool = True, io_threads: int = 2):
        self.compute = torch.device(device)
        self.dtype = dtype
        self.disk = disk
        self.on_cuda = self.compute.type == "cuda"
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="flexh2o-io") if overlap else None
        self.free_buffers: dict[tuple, list] = {}
        self.io_seconds = 0.0  # summed over I/O tasks (with overlap off: time the schedule waits for I/O)
        self._io_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self.bytes = {t: 0 for t in TIERS}
        self.peak = {t: 0 for t in TIERS}
        if self.on_cuda:
            from .cuda_io import CudaCopies
            self.cuda = CudaCopies(self.compute)

    # -- accounting -------------------------------------------------------------------------
    def track(self, tier: str, nbytes: int):
        """Counts bytes allocated (positive) or freed (negative) on a tier, and its peak."""
        with self._io_lock:
            self.bytes[tier] += nbytes
            self.peak[tier] = max(self.peak[tier], self.bytes[tier])

    def alloc(self, tier: str, shape, dtype=None, zero=False) -> torch.Tensor:
        dtype = dtype or self.dtype
        device = self.compute if tier == "gpu" else "cpu"
        pin = tier == "cpu" and self.on_cuda
        t = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) if zero or pin else \
            torch.empty(shape, dtype=dtype, device=device)
        self.track(tier, t.numel() * t.element_size())
        return t

    # -- placement --------------------------------------------------------------------------
    def place(self, tensor: torch.Tensor, rows: dict) -> Placed:
        """Puts a tensor's rows at their home tiers (rows: tier -> number of rows, in tier order)."""
        tensor = tensor.to(self.dtype)
        segments, start = [], 0
        for tier in TIERS:
            n = rows.get(tier, 0)
            if n == 0:
                continue
            part = tensor[start: start + n].contiguous()
            seg = Segment(tier, start, start + n)
            if tier == "disk":
                seg.file = self.disk.create(part.numel() * part.element_size())
                self.disk.write(seg.file, 0, part)
                self.track("disk", seg.file.nbytes)
            else:
                seg.data = self.alloc(tier, part.shape)
                seg.data.copy_(part)
            segments.append(seg)
            start += n
        return Placed(tuple(tensor.shape), self.dtype, segments)

    # -- buffers ----------------------------------------------------------------------------
    def buffer(self, shape, dtype=None, tier: str = "gpu") -> torch.Tensor:
        """A pooled buffer on the compute device (or a CPU staging buffer, pinned on CUDA).
        Its contents are stale but finite: buffers start zeroed."""
        key = (tuple(shape), dtype or self.dtype, tier)
        with self._pool_lock:  # the compute thread and the I/O threads both take and return buffers
            free = self.free_buffers.get(key)
            if free:
                return free.pop()
        return self.alloc(tier, shape, dtype, zero=True)

    def release(self, tensor: torch.Tensor):
        tier = "gpu" if tensor.device == self.compute else "cpu"
        with self._pool_lock:
            self.free_buffers.setdefault((tuple(tensor.shape), tensor.dtype, tier), []).append(tensor)

    # -- moving data ------------------------------------------------------------------------
    def run_io(self, fn, value) -> Pending:
        """Runs fn on an I/O thread (overlap on) or right here (overlap off)."""
        def task():
            start = time.perf_counter()
            with torch.no_grad():
                fn()
            with self._io_lock:
                self.io_seconds += time.perf_counter() - start
        if self.pool is None:
            task()
            return Pending(value)
        return Pending(value, self.pool.submit(task))

    def load(self, placed: Placed) -> Pending:
        """The compute-device tensor of `placed`: the resident tensor itself, or a filled buffer."""
        whole = placed.resident()
        if whole is not None and (placed.segments[0].tier == "gpu" or not self.on_cuda):
            return Pending(whole)
        buf = self.buffer(placed.shape, placed.dtype)
        return self.run_io(lambda: self.fill(buf, placed.segments), buf)

    def fill(self, buf: torch.Tensor, segments: list):
        for seg in segments:
            rows = buf[seg.start: seg.stop]
            if seg.tier == "disk":
                self.read_disk(seg.file, 0, rows)
            else:
                self.copy_to_compute(rows, seg.data)

    def read_disk(self, file, offset: int, out: torch.Tensor):
        """Reads a file range into `out` (contiguous), through a pinned staging buffer on CUDA."""
        if self.on_cuda:
            self.cuda.copy_from_disk(self.disk, file, offset, out)
        else:
            self.disk.read(file, offset, out)

    def write_disk(self, file, offset: int, data: torch.Tensor):
        self.disk.write(file, offset, data.contiguous().cpu())

    def copy_to_compute(self, dst: torch.Tensor, src: torch.Tensor):
        if self.on_cuda:
            self.cuda.copy(dst, src)
        else:
            dst.copy_(src)

    def to_cpu(self, src: torch.Tensor, dst: torch.Tensor):
        """Copies compute-device data back to CPU memory."""
        self.copy_to_compute(dst, src)

    def store_act(self, hidden: torch.Tensor):
        """Parks a hidden state in CPU memory (where that is the compute device: nothing to do)."""
        if not self.on_cuda:
            return hidden
        parked = self.buffer(hidden.shape, hidden.dtype, tier="cpu")
        return self.run_io(lambda: self.to_cpu(hidden, parked), parked)

    def load_act(self, parked):
        """Brings a parked hidden state back to the compute device."""
        if not self.on_cuda:
            return parked
        out = torch.empty(parked.value.shape, dtype=parked.value.dtype, device=self.compute)

        def fill():
            self.copy_to_compute(out, parked.wait())
            self.release(parked.value)
        return self.run_io(fill, out)

    def sync(self):
        if self.on_cuda:
            torch.cuda.synchronize(self.compute)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
