"""The CUDA-only layer under Tiers: loads and stores on their own streams, pinned staging.

Every I/O task is queued by the compute thread, which records an event on the compute stream at
that moment; the task's copies wait for that event, so they follow the compute queued before them
(the work that filled what they store, or last used the buffer they fill) and nothing queued
later. Host-to-device copies run on the load stream, device-to-host copies on the store stream.
A copy goes straight between pinned host memory and the device when the host side is pinned and
contiguous, else through a pinned staging block (a CPU memcpy, then the DMA). The I/O thread
(never the compute stream) blocks until its task's copies are done, so a finished task means
"the data is there".
"""

import threading
from contextlib import contextmanager

import torch

from .kv.cache import slot_grid


class CudaCopies:
    def __init__(self, tiers, stages: int):
        self.tiers = tiers
        self.device = device = tiers.compute
        self.load_stream = torch.cuda.Stream(device)
        self.store_stream = torch.cuda.Stream(device)
        self.stage_count, self.stage_bytes, self.free_stages = stages, 0, []
        self.lock = threading.Lock()
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
        with self.lock:
            self.free_stages = stages

    @contextmanager
    def stage(self, shape, dtype):
        """A pinned, contiguous host tensor of `shape` inside a staging block, for one copy."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.stage_bytes:
            raise RuntimeError(f"staging of {nbytes} bytes was not reserved (blocks hold {self.stage_bytes})")
        with self.lock:
            block = self.free_stages.pop()
        try:
            yield block[:nbytes].view(dtype).view(shape)
        finally:
            with self.lock:
                self.free_stages.append(block)

    # -- tasks ------------------------------------------------------------------------------
    def queued(self) -> torch.cuda.Event:
        """An event marking the compute queued so far (recorded by the compute thread)."""
        event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning on a core
        event.record(self.compute_stream)
        return event

    @contextmanager
    def task(self, after: torch.cuda.Event):
        """Runs one I/O task's copies after `after`; returns once they have all finished."""
        self.local.after, self.local.pending = after, []
        try:
            yield
        finally:
            for event in self.local.pending:
                event.synchronize()
            self.local.after, self.local.pending = None, None

    def _start(self, stream):
        """Orders `stream` after the current task's event (outside a task: after all compute so far)."""
        stream.wait_event(getattr(self.local, "after", None) or self.queued())
        return torch.cuda.stream(stream)

    def _finish(self, stream, wait_now: bool):
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        pending = getattr(self.local, "pending", None)
        if wait_now or pending is None:
            event.synchronize()
        else:
            pending.append(event)

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

    def to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """dst in CPU memory <- src on the device; returns when dst holds the data. A dst of another
        dtype (a cache the CPU attends over, held wider) is converted on the device, into one
        contiguous block: on the host the strided conversion took 74 ms per K per layer."""
        with self._start(self.store_stream):
            if src.dtype != dst.dtype:
                src = src.to(dst.dtype)
            if dst.is_contiguous() and self.tiers.is_pinned(dst):
                dst.copy_(src, non_blocking=True)  # a strided src is gathered on the device first
                self._finish(self.store_stream, wait_now=True)
                return
            with self.stage(src.shape, src.dtype) as staged:
                staged.copy_(src, non_blocking=True)
                self._finish(self.store_stream, wait_now=True)
                dst.copy_(staged)

    def on_device(self, dst: torch.Tensor, src: torch.Tensor):
        """A device-side copy on the load stream, after the loads queued there before it."""
        self.on_device_run(lambda: dst.copy_(src))

    def on_device_run(self, fn):
        """Device-side work (a copy, a dequantization) on the load stream, after the loads queued
        there before it; returns once it is done."""
        with self._start(self.load_stream):
            fn()
            self._finish(self.load_stream, wait_now=True)

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
        """Waits for the copies this task has queued so far."""
        pending = getattr(self.local, "pending", None) or []
        for event in pending:
            event.synchronize()
        pending.clear()


class Copied:
    def __init__(self, tensors, event):
        self.tensors, self.event = tensors, event

    def wait(self):
        self.event.synchronize()
        return self.tensors
