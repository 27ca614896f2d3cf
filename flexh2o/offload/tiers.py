"""The tiers of a run (compute device "gpu", CPU memory, disk) and the moves between them.

Tiers holds the run's memory (buffers.py), places and loads weights (weight_io.py), and offers the
moves everything else is built from: I/O tasks on the I/O threads (io_tasks.py; with overlap off
they run inline), copies to and from the compute device (on CUDA through cuda_io.py's streams and
pinned staging), disk reads and writes, and parking hidden states in CPU memory. Where the compute
device is the CPU, the gpu and cpu tiers are the same memory.
"""

import threading
import time
from contextlib import nullcontext

import numpy as np
import torch

from flexh2o.offload.buffers import Buffers
from flexh2o.offload.disk import OffloadError
from flexh2o.compression.gpu_dequant import Workspace
from flexh2o.offload.io_tasks import IOTaskError, IOThreads, Pending
from flexh2o.offload.slots import slot_grid
from flexh2o.common.signals import deferred
from flexh2o.offload.weight_io import WeightIO


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


class Tiers(WeightIO, Buffers):
    def __init__(self, device, dtype: torch.dtype, disk=None, overlap: bool = True, io_threads: int = 2,
                 int8_activations: bool = False):
        super().__init__(device, dtype)
        self.disk = disk
        self.int8_activations = int8_activations  # GGUF blocks multiplied with int8 activations (weight_io.py)
        self.io = IOThreads(io_threads) if overlap else None
        self.io_threads = io_threads
        self.io_tasks = 0  # I/O tasks queued (with overlap off: run inline)
        self.parked_slots = 1  # hidden states parked in CPU memory at once: one per gpu-batch (set by the schedule)
        self.io_seconds = 0.0  # summed over I/O tasks (with overlap off: time the schedule waits for I/O)
        self.dequant_seconds = 0.0  # spent dequantizing, on any thread (on CUDA: queueing the kernels)
        self.dequant_space = Workspace()  # on CUDA without Triton, the load stream's (gpu_dequant.py)
        self.h2d_bytes = 0  # copied to the compute device (disk reads included), on any thread
        self._placer, self._placing = None, []  # the writer of placed 4-bit groups (weight_io.py)
        self.placed_by_name = {}  # (checkpoint name, rows, compressed, tiled) -> Placed (models/layer.py's place_once)
        self.cuda = None
        if self.on_cuda:
            from flexh2o.offload.cuda_io import CudaCopies
            self.cuda = CudaCopies(self, stages=io_threads + 1)

    # -- moving data ------------------------------------------------------------------------
    def run_io(self, fn, value, what: str, store: bool = False) -> Pending:
        """Runs fn on an I/O thread (overlap on; a store on a store thread) or right here (overlap
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
            self.cuda.on_device(lambda: dst.copy_(src))
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
        self.stop_placing()
        if self.io is not None:
            self.io.close()
        self.settle()
        if self.disk is not None:
            self.disk.close()
        self.unpin_all()
