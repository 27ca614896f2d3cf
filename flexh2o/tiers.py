"""Where tensors live (compute device "gpu", CPU memory, disk) and how they reach the compute device.

A tensor is placed by rows of its first dimension: some rows on the gpu tier, some in CPU memory,
the rest on disk, so each tier gets the share of bytes the policy asks for. Loading assembles the
rows into a reusable compute buffer; with overlap on, that work runs on the I/O threads and the
caller gets a `Pending` to wait on. Where the compute device is the CPU, the gpu and cpu tiers
are the same memory: a tensor held whole by either is used in place, never copied. A compressed
tensor (quant.py) is placed, and moved, as its uint8 groups, and dequantized into a compute buffer
at the end of every load.
"""

import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from .buffers import TIERS, Buffers
from .disk import OffloadError
from .io_tasks import IOTaskError, IOThreads, Pending
from .kv.cache import slot_grid
from .quant import Packed, dequantize, quantize
from .signals import deferred


def copy_in_memory(dst: torch.Tensor, src: torch.Tensor):
    """dst <- src, both in CPU memory. Off the main thread the copy runs on that thread alone:
    torch's copy_ would start a team of OpenMP threads there beside the compute thread's own team,
    four threads on two cores, and a weight split between two tiers in memory decoded 8% slower."""
    if threading.current_thread() is threading.main_thread() or dst.dtype != src.dtype:
        dst.copy_(src)
        return
    if dst.dtype == torch.bfloat16:  # numpy has none: the same bits as int16
        dst, src = dst.view(torch.int16), src.view(torch.int16)
    np.copyto(dst.numpy(), src.numpy())  # releases the GIL


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


class Tiers(Buffers):
    def __init__(self, device, dtype: torch.dtype, disk=None, overlap: bool = True, io_threads: int = 2):
        super().__init__(device, dtype)
        self.disk = disk
        self.io = IOThreads(io_threads) if overlap else None
        self.io_threads = io_threads
        self.io_tasks = 0  # I/O tasks queued (with overlap off: run inline)
        self.parked_slots = 1  # hidden states parked in CPU memory at once: one per gpu-batch (set by the schedule)
        self.io_seconds = 0.0  # summed over I/O tasks (with overlap off: time the schedule waits for I/O)
        self.dequant_seconds = 0.0  # spent dequantizing, on any thread (on CUDA: queueing the kernels)
        self.h2d_bytes = 0  # copied to the compute device (disk reads included), on any thread
        self.cuda = None
        if self.on_cuda:
            from .cuda_io import CudaCopies
            self.cuda = CudaCopies(self, stages=io_threads + 1)

    # -- placement --------------------------------------------------------------------------
    def place(self, tensor: torch.Tensor, rows: dict, compressed: bool = False) -> Placed:
        """Puts a tensor's rows at their home tiers (rows: tier -> number of rows, in tier order),
        as 4-bit groups when compressed (ValueError if it holds inf, NaN or values beyond float16)."""
        if isinstance(tensor, Packed):  # already groups
            decoded, tensor = tensor.shape, tensor.groups
        else:
            tensor = tensor.to(self.dtype)
            decoded = tuple(tensor.shape) if compressed else None
            if compressed:
                tensor = quantize(tensor)
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
                self.reserve_staging(seg.file.nbytes)
                self.track("disk", seg.file.nbytes)
            else:
                seg.data = self.alloc(tier, part.shape, tensor.dtype)
                seg.data.copy_(part)
            segments.append(seg)
            start += n
        return Placed(tuple(tensor.shape), tensor.dtype, segments, decoded)

    # -- moving data ------------------------------------------------------------------------
    def run_io(self, fn, value, what: str, store: bool = False) -> Pending:
        """Runs fn on an I/O thread (overlap on; a store on the store thread) or right here (overlap
        off). On CUDA its copies follow the compute queued up to now, when the task is queued, not
        when a thread takes it. `what` it does names it in the error if it fails (IOTaskError; a
        full disk stays OffloadError)."""
        after = self.cuda.queued() if self.cuda else None

        def task():
            start, landed = time.perf_counter(), None
            try:
                with torch.no_grad():
                    if self.cuda:
                        with self.cuda.task(after) as landed:
                            fn()
                    else:
                        fn()
            except (OffloadError, IOTaskError) as e:  # the cause itself, or an earlier task's that this one waited for
                self.fail(e)
                raise
            except Exception as e:
                error = IOTaskError(what, e)
                self.fail(error)
                raise error from e
            with self._lock:
                self.io_seconds += time.perf_counter() - start
            return landed
        self.io_tasks += 1
        if self.io is None:
            return Pending(value, landed=task())
        return Pending(value, self.io.submit(task, store))

    def io_group(self):
        """The I/O tasks queued inside reach the I/O threads as one hand-off (io_tasks.py)."""
        return self.io.group() if self.io is not None else nullcontext()

    @property
    def handoffs(self) -> int:
        """Hand-offs to the I/O threads so far."""
        return self.io.handoffs if self.io is not None else 0

    def abandon(self, error: BaseException):
        """Ends a failed or interrupted run's I/O: buffer waits raise `error`, tasks not started are
        cancelled, running ones finish (nothing writes into what the run then frees)."""
        self.fail(error)
        if self.io is not None:
            self.io.abandon()

    def used_in_place(self, placed: Placed) -> bool:
        """Whether compute reads `placed` where it lives: held whole by memory the compute device
        uses, and not compressed. Loading it then moves nothing."""
        return placed.decoded_shape is None and self._in_place(placed)

    def _in_place(self, placed: Placed) -> bool:
        return placed.resident() is not None and (placed.segments[0].tier == "gpu" or not self.on_cuda)

    def pooled(self, placed: Placed) -> list[tuple]:
        """(shape, dtype, per I/O thread) of each pooled buffer that load(placed) takes: the values
        of a weight not used in place, and the groups of a compressed one moved (on CUDA an I/O
        thread gives its groups' buffer back once dequantized, so one per thread is made)."""
        in_place = self._in_place(placed)
        if placed.decoded_shape is None:
            return [] if in_place else [(placed.shape, placed.dtype, False)]
        groups = [] if in_place else [(placed.shape, placed.dtype, self.on_cuda)]
        return [(placed.decoded_shape, self.dtype, False)] + groups

    def reserve_loads(self, layers_placed: list[list]):
        """Makes, before a run, every pooled buffer its weight loads take, per layer the `placed`
        tensors it loads. The layer computing and the next one loading (cyclically: the last and the
        first) hold theirs at once, so a shape gets as many as two neighbours ever hold together
        (the pre-flight's count, memory.compute_copy_bytes). Made lazily, the largest (an LM head's)
        came only after the prompt step: a run that cannot hold them failed after its prompt."""
        counts = [Counter(key for p in placed for key in self.pooled(p)) for placed in layers_placed]
        most = Counter()
        for j, count in enumerate(counts):
            for key, n in (count + counts[(j + 1) % len(counts)]).items():
                most[key] = max(most[key], n)
        for (shape, dtype, per_thread), n in most.items():
            self.reserve(shape, dtype, count=self.io_threads if per_thread else n)

    def load(self, placed: Placed) -> Pending:
        """The compute-device tensor of `placed`: the resident tensor itself, or a filled buffer."""
        whole = placed.resident()
        in_place = self._in_place(placed)
        if placed.decoded_shape is not None:
            return self._load_compressed(placed, whole if in_place else None)
        if in_place:
            return Pending(whole)
        buf = self.buffer(placed.shape, placed.dtype)
        return self.run_io(lambda: self.fill(buf, placed.segments), buf, "loading weights")

    def load_all(self, placed: list) -> list[Pending]:
        """load() of each; on CUDA those moved from memory alone go as one I/O task, whose copies
        are queued back to back under one event: per tensor, a task's hand-off and events cost the
        I/O thread more than a bias takes to copy, and left the copy engine idle between them.
        Tensors read from disk keep a task each, so that two threads read at once."""
        grouped = [self.on_cuda and p.decoded_shape is None and not self._in_place(p) and
                   all(seg.tier != "disk" for seg in p.segments) for p in placed]
        if sum(grouped) < 2:
            return [self.load(p) for p in placed]
        buffers = {i: self.buffer(p.shape, p.dtype) for i, p in enumerate(placed) if grouped[i]}
        together = self.run_io(lambda: [self.fill(buffers[i], placed[i].segments) for i in buffers], None,
                               "loading weights")
        return [Pending(buffers[i], then=together.wait) if i in buffers else self.load(p) for i, p in enumerate(placed)]

    def gather_rows(self, placed: Placed, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (a CPU tensor of row indices, any shape) of a placed matrix, as a compute-device
        tensor [*ids.shape, columns]: an embedding's lookup, where only the rows looked up move,
        each once, on the compute thread (a few rows: no I/O task, no pooled buffer). A matrix
        used in place is simply indexed."""
        if self.used_in_place(placed):
            return placed.resident()[ids.to(self.compute)]
        rows, inverse = torch.unique(ids.flatten(), return_inverse=True)  # sorted
        picked = torch.empty(len(rows), placed.shape[1], dtype=placed.dtype)
        on_device = []  # (positions in `rows`, the rows themselves) of a segment on the compute device
        for seg in placed.segments:
            inside = ((rows >= seg.start) & (rows < seg.stop)).nonzero().flatten()
            if not len(inside):
                continue
            local = rows[inside] - seg.start
            if seg.tier == "gpu" and self.on_cuda:
                on_device.append((inside, seg.data[local.to(self.compute)]))
            elif seg.tier == "disk":
                got = torch.empty(len(local), placed.shape[1], dtype=placed.dtype)
                try:
                    self.disk.read_rows(seg.file, local, got)
                except OSError as e:
                    raise IOTaskError("loading weights", e) from e
                picked[inside] = got
            else:
                picked[inside] = seg.data[local]
        moved = len(rows) - sum(len(inside) for inside, _ in on_device)
        self.count_h2d(picked[:moved])  # the rows not on the device already (their bytes, whichever they are)
        picked = picked.to(self.compute)
        for inside, data in on_device:
            picked[inside.to(self.compute)] = data
        if placed.decoded_shape is not None:
            values = torch.empty(len(rows), placed.decoded_shape[1], dtype=self.dtype, device=self.compute)
            picked = dequantize(picked, values.shape[-1], values)
        return picked[inverse.to(self.compute)].view(*ids.shape, -1)

    def _load_compressed(self, placed: Placed, whole) -> Pending:
        """Its groups, moved to the compute device unless they are there, dequantized into a buffer."""
        out = self.buffer(placed.decoded_shape)
        if not self.on_cuda:
            return self._load_compressed_for_cpu(placed, whole, out)
        if whole is None:
            # Its groups go through a buffer that the I/O task gives back once dequantized: at most
            # one per thread is out at once, all made up front (later, timing would decide).
            self.reserve(placed.shape, placed.dtype, count=self.io_threads)

        def task():
            if whole is not None:
                self.dequantize(whole, out)
                return
            packed = self.buffer(placed.shape, placed.dtype)
            try:
                self.fill(packed, placed.segments)
                self.dequantize(packed, out)
            finally:
                self.release(packed)
        return self.run_io(task, out, "loading compressed weights")

    def _load_compressed_for_cpu(self, placed: Placed, whole, out) -> Pending:
        """Where the CPU computes, the compute thread dequantizes, when it waits for the load: on an
        I/O thread the dequantizing took cores from the compute's own threads (opt-350m, 4-bit
        weights on disk: decode as slow as with overlap off, the dequantizing itself 2.5x slower).
        The groups' buffer is taken and given back on the compute thread, in program order, so
        how many the pool makes does not depend on timing."""
        if whole is not None:  # nothing to move: no I/O task at all
            return Pending(out, then=lambda: self.dequantize(whole, out))
        packed = self.buffer(placed.shape, placed.dtype)

        def fill():
            try:
                self.fill(packed, placed.segments)
            except BaseException:  # finish() will not run: the groups' buffer goes back here
                self.release(packed)
                raise

        def finish():
            self.dequantize(packed, out)
            self.release(packed)
        pending = self.run_io(fill, out, "loading compressed weights")
        pending.then = finish
        return pending

    def dequantize(self, packed: torch.Tensor, out: torch.Tensor):
        """out <- the values of `packed`, on the device both are on; on CUDA after the loads queued
        before it, and done when this returns (packed may be a buffer going back to the pool)."""
        start = time.perf_counter()
        if self.on_cuda:  # where both always are on CUDA: only compute buffers are dequantized into
            self.cuda.on_device_run(lambda: dequantize(packed, out.shape[-1], out))
        else:
            dequantize(packed, out.shape[-1], out)
        self.count_dequant(time.perf_counter() - start)

    def count_dequant(self, seconds: float):
        with self._lock:
            self.dequant_seconds += seconds

    def fill(self, buf: torch.Tensor, segments: list):
        for seg in segments:
            rows = buf[seg.start: seg.stop]
            if seg.tier == "disk":
                self.read_disk(seg.file, 0, rows)
            elif seg.tier == "gpu":
                self.copy_on_device(rows, seg.data)
            else:
                self.to_device(rows, seg.data)

    def reserve_staging(self, nbytes: int):
        """On CUDA, host data that is not pinned and contiguous moves through pinned staging
        blocks; each must hold the largest such move (asked for while placing, never mid-run)."""
        if self.cuda:
            self.cuda.reserve_staging(nbytes)

    def read_disk(self, file, offset: int, out: torch.Tensor):
        """Reads a file range into `out` (contiguous): on CUDA through a pinned staging block."""
        if not self.on_cuda:
            self.count_h2d(out)
            self.disk.read(file, offset, out)
            return
        with self.cuda.stage(out.shape, out.dtype) as staged:
            self.disk.read(file, offset, staged)
            self.to_device(out, staged)
            self.cuda.load_stream.synchronize()  # before the block is reused

    def write_disk(self, file, offset: int, data: torch.Tensor):
        """Writes compute-device data to a file range."""
        if not self.on_cuda:
            self.disk.write(file, offset, data.contiguous())
            return
        with self.cuda.stage(data.shape, data.dtype) as staged:
            self.to_host(staged, data)
            self.disk.write(file, offset, staged)

    def count_h2d(self, t: torch.Tensor):
        with self._lock:
            self.h2d_bytes += t.numel() * t.element_size()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor):
        """dst on the compute device <- src in CPU memory."""
        self.count_h2d(dst)
        if self.on_cuda:
            self.cuda.to_device(dst, src)
        else:
            copy_in_memory(dst, src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """dst in CPU memory <- src on the compute device (done when this returns)."""
        self.to_host_all([(dst, src)])

    def to_host_all(self, pairs: list):
        """to_host of each (dst, src); on CUDA the copies are queued together and waited for once."""
        if self.on_cuda:
            self.cuda.to_host(pairs)
        else:
            for dst, src in pairs:
                copy_in_memory(dst, src)

    def copy_on_device(self, dst: torch.Tensor, src: torch.Tensor):
        """dst <- src, both on the compute device, after the loads this task queued before it. On
        CUDA it lands with the task's loads (cuda_io.py): src is a resident tensor, or a pooled
        buffer of a kind only the load stream uses."""
        if self.on_cuda:
            self.cuda.on_device(dst, src)
        else:
            copy_in_memory(dst, src)

    def host(self, src: torch.Tensor) -> torch.Tensor:
        """A small compute-device tensor (e.g. the slots a step wrote) in CPU memory."""
        return self.cuda.gather_to_host(src) if self.on_cuda else src

    def gather_slots(self, src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """src [b, kv_heads, capacity, ...] at one slot per (sequence, KV head), slots [b, kv_heads],
        in CPU memory: [b, kv_heads, ...]."""
        if self.on_cuda:
            return self.cuda.gather_to_host(src, slots)
        seq, head = slot_grid(slots)
        return src[seq, head, slots]

    def start_host_copy(self, tensors: list, dtype: torch.dtype) -> Pending:
        """Starts copying small compute-device tensors to CPU memory (floating ones as `dtype`), in
        the compute stream's order; wait() gives the copies."""
        def cast(t):
            return t.to(dtype) if t.is_floating_point() else t
        if not self.on_cuda:
            return Pending([cast(t) for t in tensors])
        return self.cuda.start_host_copy(tensors, cast)

    def store_act(self, hidden: torch.Tensor):
        """Parks a hidden state in CPU memory (where that is the compute device: nothing to do)."""
        if not self.on_cuda:
            return hidden
        self.reserve(hidden.shape, hidden.dtype, "cpu", count=self.parked_slots)
        parked = self.buffer(hidden.shape, hidden.dtype, tier="cpu")
        return self.run_io(lambda: self.to_host(parked, hidden), parked, "parking a hidden state in CPU memory",
                           store=True)

    def load_act(self, parked):
        """Brings a parked hidden state back to the compute device."""
        if not self.on_cuda:
            return parked
        out = torch.empty(parked.value.shape, dtype=parked.value.dtype, device=self.compute)

        def fill():
            try:
                self.to_device(out, parked.wait())
                self.cuda.drain()  # the copy reads the parked buffer: done before it goes back to the pool
            finally:
                self.release(parked.value)
        return self.run_io(fill, out, "loading a parked hidden state")

    def sync(self):
        """Waits for the compute queued so far (the copies on the side streams go on)."""
        if self.on_cuda:
            self.cuda.compute_stream.synchronize()

    def settle(self):
        """Waits for the copies still queued on the side streams (a load no one waited for: the next
        token's first weights when every sequence ended early, or a failed run's), before the
        buffers they fill are freed."""
        if self.on_cuda:
            self.cuda.wait_loads()

    def close(self):
        with deferred():  # a signal here would leave the disk store open
            self._close()

    def _close(self):
        if self.io is not None:
            self.io.close()
        self.settle()
        if self.disk is not None:
            self.disk.close()
        self.unpin_all()
