"""The CUDA-only layer under Tiers: loads and stores on their own streams, pinned staging.

Every I/O task is queued by the compute thread, which records an event on the compute stream at
that moment; the task's copies wait for that event, so they follow the compute queued before them
(the work that filled what they store, or last used the buffer they fill) and nothing queued
later. Host-to-device copies run on the load stream, device-to-host copies on the store stream.
A copy goes straight between pinned host memory and the device when the host side is pinned and
contiguous, else through a pinned staging block (a CPU memcpy, then the DMA). A load's copies
straight from pinned memory are only queued: the task ends with an event after them, and whoever
waits for the load (Pending.wait) makes its own stream wait for that event, on the device. The I/O
thread is then free at once to queue the next load, with no hand-off between threads between two
loads' copies (blocking until each load landed left the copy engine busy 45% of a decode step
streaming weights on an H200: 0.50 of the pinned-copy bound, now 0.63). So is device-side work on
the load stream (a copy between buffers, a weight's dequantizing). Everything else (copies through
staging, stores) the I/O thread waits for before the task ends, so a finished task means "the data
is there, or queued ahead of anything that waits".
"""

import ctypes
import math
import threading
from contextlib import contextmanager

import torch

from flexh2o.common.messages import say
from flexh2o.offload.slots import slot_grid


class CudaCopies:
    def __init__(self, tiers, stages: int):
        self.tiers = tiers
        self.device = device = tiers.compute
        self.load_stream = torch.cuda.Stream(device)
        self.store_stream = torch.cuda.Stream(device)
        self.stage_count, self.stage_bytes, self.free_stages = stages, 0, []
        self.lock = threading.Lock()
        self.staged = threading.Condition(self.lock)  # signalled when a staging block comes back
        self.local = threading.local()

    @property
    def compute_stream(self) -> torch.cuda.Stream:
        """The stream the compute thread queues on now: looked up when used, so that a caller
        running the engine under its own `torch.cuda.stream(...)` keeps the copies ordered."""
        return torch.cuda.current_stream(self.device)

    # -- set-up -----------------------------------------------------------------------------
    def reserve_staging(self, nbytes: int):
        """Makes sure each staging block holds nbytes. Called while tensors are placed, so that no
        staging memory is allocated once generation runs."""
        with self.lock:
            if nbytes <= self.stage_bytes:
                return
            old, self.free_stages = self.free_stages, []
            self.stage_bytes = nbytes
        self.tiers.free("cpu", old)
        stages = [self.tiers.alloc("cpu", (nbytes,), torch.uint8) for _ in range(self.stage_count)]
        with self.staged:
            self.free_stages = stages
            self.staged.notify_all()

    @contextmanager
    def stage(self, shape, dtype):
        """A pinned, contiguous host tensor of `shape` inside a staging block, for one copy."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.stage_bytes:
            raise RuntimeError(f"staging of {nbytes} bytes was not reserved (blocks hold {self.stage_bytes})")
        with self.staged:  # more threads may stage than there are blocks (loads, stores, compute)
            while not self.free_stages:
                self.staged.wait()
            block = self.free_stages.pop()
        try:
            yield block[:nbytes].view(dtype).view(shape)
        finally:
            with self.staged:
                self.free_stages.append(block)
                self.staged.notify()

    # -- tasks ------------------------------------------------------------------------------
    def queued(self) -> torch.cuda.Event:
        """An event marking the compute queued so far (recorded by the compute thread)."""
        event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning on a core
        event.record(self.compute_stream)
        return event

    @contextmanager
    def task(self, after: torch.cuda.Event):
        """Runs one I/O task's copies after `after`. Yields a Landed whose `event`, once the task
        ends, follows the copies left in flight (None if none are): those of a load from pinned
        memory, and device-side copies on the load stream. After a failure they are waited for here."""
        local = self.local
        local.after, local.ordered, local.in_flight = after, set(), False
        landed = Landed()
        try:
            yield landed
        except BaseException:
            self.drain()
            raise
        else:
            landed.event = self._mark_in_flight()
        finally:
            local.after, local.ordered, local.in_flight = None, None, False

    def wait_loads(self):
        """Blocks until every copy queued on the side streams has finished (before their buffers are freed)."""
        self.load_stream.synchronize()
        self.store_stream.synchronize()

    def _start(self, stream):
        """Orders `stream` after the current task's event, once per task and stream (outside a task:
        after all compute so far)."""
        after = getattr(self.local, "after", None)
        if after is None:
            stream.wait_event(self.queued())
        elif stream not in self.local.ordered:
            stream.wait_event(after)
            self.local.ordered.add(stream)
        return torch.cuda.stream(stream)

    def _finish(self, stream, wait_now: bool):
        """After a copy on `stream`: waits for it now, or (a load stream copy inside a task) leaves
        it in flight, to be marked by one event when the task ends."""
        if not wait_now and getattr(self.local, "after", None) is not None:
            self.local.in_flight = True
            return
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        event.synchronize()

    def _mark_in_flight(self):
        """An event after the copies this task left in flight on the load stream, or None."""
        if not getattr(self.local, "in_flight", False):
            return None
        event = torch.cuda.Event(blocking=True)
        event.record(self.load_stream)
        self.local.in_flight = False
        return event

    # -- copies -----------------------------------------------------------------------------
    def to_device(self, dst: torch.Tensor, src: torch.Tensor):
        """dst on the device <- src in CPU memory."""
        with self._start(self.load_stream):
            if src.is_contiguous() and self.tiers.is_pinned(src):
                dst.copy_(src, non_blocking=True)
                self._finish(self.load_stream, wait_now=False)
                return
            with self.stage(src.shape, src.dtype) as staged:
                staged.copy_(src)
                dst.copy_(staged, non_blocking=True)
                self._finish(self.load_stream, wait_now=True)  # before the block is reused

    def to_host(self, pairs: list):
        """dst in CPU memory <- src on the device, for each (dst, src); returns when every dst holds
        its data. The direct copies are queued back to back and waited for once: waiting after each
        left the copy engine idle a third of a prompt step that stores the cache (H200). A dst of
        another dtype (a cache the CPU attends over, held wider) is converted on the device, into
        one contiguous block: on the host the strided conversion took 74 ms per K per layer."""
        with self._start(self.store_stream):
            queued = False
            for dst, src in pairs:
                if src.dtype != dst.dtype:
                    src = src.to(dst.dtype)
                if self._queue_to_host(dst, src):
                    queued = True
                    continue
                with self.stage(src.shape, src.dtype) as staged:
                    staged.copy_(src, non_blocking=True)
                    self._finish(self.store_stream, wait_now=True)  # also the copies queued before it
                    dst.copy_(staged)
            if queued:
                self._finish(self.store_stream, wait_now=True)

    def _queue_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Queues dst <- src as one DMA where dst is pinned and contiguous (a strided src is
        gathered on the device first) or pinned, pitched rows; False where it must be staged."""
        if not self.tiers.is_pinned(dst):
            return False
        if dst.is_contiguous():
            dst.copy_(src, non_blocking=True)
            return True
        rows = pitched_rows(dst)
        return rows is not None and cuda_runtime() is not None and \
            copy_rows_to_host(dst, src.contiguous(), rows, self.store_stream)

    def on_device(self, fn):
        """Device-side work (a copy, a dequantization) queued on the load stream, after the loads
        queued there before it, and left in flight like a load from pinned memory: what it reads
        must not change before the task's copies land (a resident tensor, or a pooled buffer whose
        every user queues on the load stream)."""
        with self._start(self.load_stream):
            fn()
            self._finish(self.load_stream, wait_now=False)

    def gather_to_host(self, src: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """src, or src at one slot per (sequence, KV head), as a new CPU tensor: small, so gathered
        and copied on the store stream (index tensors made there too) and waited for."""
        with self._start(self.store_stream):
            if slots is not None:
                seq, head = slot_grid(slots)
                src = src[seq, head, slots]
            return src.to("cpu", non_blocking=False)

    def start_host_copy(self, tensors: list, cast) -> "Copied":
        """Queues device-to-host copies of small tensors on the compute stream (they follow what made
        them) into fresh pinned memory; the returned handle's wait() blocks until they landed."""
        out = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=cast(t).dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        done = torch.cuda.Event(blocking=True)
        done.record(self.compute_stream)
        return Copied(out, done)

    def drain(self):
        """Waits for the copies this task has left in flight so far."""
        event = self._mark_in_flight()
        if event is not None:
            event.synchronize()


def pitched_rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, bytes per row, pitch in bytes) when t is rows of contiguous bytes a fixed pitch apart
    (e.g. the first `length` slots of a cache [batch, heads, capacity, head_dim]), else None."""
    dims = [(n, stride) for n, stride in zip(t.shape, t.stride()) if n != 1]
    inner = 1
    while dims and dims[-1][1] == inner:
        inner *= dims.pop()[0]
    if any(outer != stride * n for (_, outer), (n, stride) in zip(dims, dims[1:])):
        return None
    pitch = dims[-1][1] if dims else inner
    if pitch < inner:  # rows that overlap (an expanded view): no such copy
        return None
    return math.prod(n for n, _ in dims), inner * t.element_size(), pitch * t.element_size()


_CUDART = []  # [the CUDA runtime library torch loaded, or None], looked up once


def cuda_runtime():
    """The CUDA runtime library this process loaded (torch's), for the one call torch does not
    wrap; None where it cannot be found (statically linked, or no CUDA at all)."""
    if not _CUDART:
        library = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            for path in sorted(paths):
                library = ctypes.CDLL(path)
                library.cudaMemcpy2DAsync.restype = ctypes.c_int
                library.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
                break
        except (OSError, AttributeError):
            library = None
        _CUDART.append(library)
    return _CUDART[0]


CUDA_MEMCPY_DEVICE_TO_HOST = 2


def copy_rows_to_host(dst: torch.Tensor, src: torch.Tensor, rows: tuple, stream) -> bool:
    """Queues dst (pinned, pitched rows) <- src (contiguous, on the device) as one strided DMA on
    `stream` (cudaMemcpy2DAsync): into the first slots of a cache the CPU attends over, a staging
    block and a strided CPU copy took the prompt step to 2.1x the all-on-GPU one (H200). False,
    with the call given up for the rest of the process, where the runtime refuses it: the caller
    stages instead."""
    library = cuda_runtime()
    if library is None:
        return False
    count, width, pitch = rows
    error = library.cudaMemcpy2DAsync(dst.data_ptr(), pitch, src.data_ptr(), width, width, count,
                                      CUDA_MEMCPY_DEVICE_TO_HOST, stream.cuda_stream)
    if error:
        library.cudaGetLastError()  # not left for torch's next check to report as its own
        _CUDART[0] = None
        say(f"flexh2o: cudaMemcpy2DAsync failed with CUDA error {error}; strided copies to the host are staged "
            "instead")
        return False
    return True


class Landed:
    """What a finished I/O task leaves in flight: `event`, recorded after its last queued copy, or None.
    wait() makes the calling thread's current stream wait for it on the device; the host goes on."""

    def __init__(self):
        self.event = None

    def wait(self):
        if self.event is not None:
            self.event.wait()


class Copied:
    def __init__(self, tensors, event):
        self.tensors, self.event = tensors, event

    def wait(self):
        self.event.synchronize()
        return self.tensors
