"""Memory of a run: allocations per tier with their accounting, and the pool of reusable buffers.

Every tensor flexh2o allocates goes through `alloc`, which counts its bytes on its tier (the
report's tracked peaks, the figure the pre-flight projection is held to) and counts the call
(after the first decode step a run allocates nothing more: tests hold every placement to that).
CPU memory that the GPU copies from or to is pinned on CUDA, page-locked in place with
cudaHostRegister so it costs exactly its size (the caching host allocator would round each block
up to a power of two). Pooled buffers are keyed by shape, dtype and the tier they were asked for,
remembered per buffer, never derived by comparing devices.
"""

import bisect
import threading
import time
import weakref

import torch

from flexh2o.common.messages import say
from flexh2o.host.aligned_memory import aligned_empty

TIERS = ("gpu", "cpu", "disk")
PAGE = 4096
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinning does
# How long asking for a pooled buffer may wait for one to come back. Buffers come back within a
# step unless an I/O task hangs; a failed task wakes every waiter at once (see fail()).
BUFFER_WAIT_SECONDS = 300.0


def compute_device(device) -> torch.device:
    """The one identity of the compute device for a whole run: CUDA always with its index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Buffers:
    def __init__(self, device, dtype: torch.dtype):
        self.compute = compute_device(device)
        self.dtype = dtype
        self.on_cuda = self.compute.type == "cuda"
        self.bytes = {t: 0 for t in TIERS}
        self.peak = {t: 0 for t in TIERS}
        self.allocations = 0  # calls of alloc(), i.e. new tensors, pooled or not
        self.free_buffers: dict[tuple, list] = {}
        self._pool_key: dict[int, tuple] = {}  # data_ptr of every pooled buffer -> its key
        self._made: dict[tuple, int] = {}      # pooled buffers per key
        self._limit: dict[tuple, int] = {}     # keys whose count was fixed by reserve()
        self._registered: dict[int, int] = {}  # data_ptr -> bytes, host memory pinned with cudaHostRegister
        self._host_allocated: dict[int, int] = {}  # data_ptr -> bytes, pinned by torch's allocator instead
        self._starts: list[int] = []  # the data_ptrs of both, sorted: is_pinned's lookup on every copy
        self._lock = threading.Condition()  # the compute thread and the I/O threads share all of this
        self.failure: BaseException | None = None  # the first error of an I/O task in this run
        # Pinned memory must be unregistered before it is freed, also when nobody called close().
        weakref.finalize(self, _unregister_all, self._registered)

    def track(self, tier: str, nbytes: int):
        """Counts bytes allocated (positive) or freed (negative) on a tier, and its peak."""
        with self._lock:
            self.bytes[tier] += nbytes
            self.peak[tier] = max(self.peak[tier], self.bytes[tier])

    def alloc(self, tier: str, shape, dtype=None, zero=False) -> torch.Tensor:
        """A new tensor on the compute device ("gpu") or in CPU memory ("cpu"; pinned on CUDA)."""
        dtype = dtype or self.dtype
        if tier == "cpu" and self.on_cuda:
            t = self._pinned_empty(shape, dtype)
        elif tier == "gpu" and self.on_cuda:
            t = torch.empty(shape, dtype=dtype, device=self.compute)
        else:
            # Page-aligned, so that disk reads into it go straight in (O_DIRECT) rather than through
            # a bounce buffer and a copy (disk.py): cache reads from disk had run at half the disk's speed.
            t = aligned_empty(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)
        nbytes = t.numel() * t.element_size()
        if zero:
            t.zero_()
        self.track(tier, nbytes)
        with self._lock:
            self.allocations += 1
        return t

    def _pinned_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory page-locked in place. It starts on a page of its own and is registered in
        whole pages, so two registrations never share a page (which CUDA would refuse)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size = -(-max(nbytes, 1) // PAGE) * PAGE
        raw = torch.empty(size + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        t = raw[start: start + nbytes].view(dtype).view(shape)
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(raw.data_ptr() + start, size, HOST_REGISTER_PORTABLE))
        if error == 0:
            self.note_pinned(raw.data_ptr() + start, size)
            return t
        # E.g. the memlock limit. Unpinned, every copy would silently turn synchronous: torch's pinned
        # host allocator instead (it rounds each block up to a power of two).
        if hasattr(cudart, "cudaGetLastError"):
            cudart.cudaGetLastError()  # not left for a later kernel launch's check to report
        if not self._host_allocated:
            say(f"flexh2o: cudaHostRegister of {size} bytes failed with CUDA error {error} (is `ulimit -l` too "
                "low?); pinned host memory comes from torch's allocator instead")
        t = torch.empty(shape, dtype=dtype, pin_memory=True)
        self.note_pinned(t.data_ptr(), nbytes, registered=False)
        return t

    def note_pinned(self, ptr: int, size: int, registered: bool = True):
        """Notes a page-locked range: registered by us (unregistered when freed), or torch's."""
        with self._lock:
            (self._registered if registered else self._host_allocated)[ptr] = size
            bisect.insort(self._starts, ptr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether t (a view too: every byte it spans) lies in host memory this run page-locked (a
        binary search)."""
        span = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
        ptr, end = t.data_ptr(), t.data_ptr() + span * t.element_size()
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return False
            start = self._starts[i]
            return end <= start + self._registered.get(start, self._host_allocated.get(start, 0))

    def free(self, tier: str, tensors):
        """Gives back what `alloc` made (not pooled buffers): untracks it and unpins it; the caller
        drops its references afterwards."""
        for t in tensors:
            if t is None:
                continue
            self.track(tier, -t.numel() * t.element_size())
            self._unpin(t.data_ptr())

    def _unpin(self, ptr: int):
        with self._lock:
            pinned = self._registered.pop(ptr, None)
            if pinned or self._host_allocated.pop(ptr, None):
                self._starts.remove(ptr)
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def reserve(self, shape, dtype=None, tier: str = "gpu", count: int = 1, kind: str = ""):
        """Makes `count` pooled buffers of this kind now, before the run, and fixes their number:
        asking for one more then waits until one comes back (buffers freed by an I/O thread come
        back when its task ends, so without a fixed number the pool would grow with the timing).
        A `kind` keeps buffers apart from others of the same shape (see buffer())."""
        key = (tuple(shape), dtype or self.dtype, tier, kind)
        with self._lock:
            self._limit[key] = max(self._limit.get(key, 0), count)
            missing = self._limit[key] - self._made.get(key, 0)
        made = [self._new_buffer(key) for _ in range(missing)]
        with self._lock:
            self.free_buffers.setdefault(key, []).extend(made)
            self._lock.notify_all()

    def buffer(self, shape, dtype=None, tier: str = "gpu", kind: str = "") -> torch.Tensor:
        """A pooled buffer on the compute device, or in CPU memory (pinned on CUDA).
        Its contents are stale but finite: buffers start zeroed. Waiting for one to come back
        raises the error of a failed I/O task at once, and gives up after BUFFER_WAIT_SECONDS.
        Buffers of a `kind` are only ever handed to the asker of that kind: one that goes back to
        the pool with device work still queued on it is safe where every user queues on one stream."""
        key = (tuple(shape), dtype or self.dtype, tier, kind)
        deadline = time.monotonic() + BUFFER_WAIT_SECONDS
        with self._lock:
            while True:
                free = self.free_buffers.get(key)
                if free:
                    return free.pop()
                if self._made.get(key, 0) < self._limit.get(key, 1 << 62):
                    break
                if self.failure is not None:
                    raise self.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"no pooled {tier} buffer {list(shape)} came back in {BUFFER_WAIT_SECONDS:.0f} s: "
                                       "an I/O task hangs or lost it")
                self._lock.wait(left)
        return self._new_buffer(key)

    def fail(self, error: BaseException):
        """Notes an I/O task's error (the first one counts): whoever waits for a buffer, now or
        later in this run, gets it instead of waiting for a buffer the failed task may still hold."""
        with self._lock:
            if self.failure is None:
                self.failure = error
            self._lock.notify_all()

    def _new_buffer(self, key) -> torch.Tensor:
        shape, dtype, tier, _ = key
        with self._lock:
            self._made[key] = self._made.get(key, 0) + 1
        t = self.alloc(tier, shape, dtype, zero=True)
        with self._lock:
            self._pool_key[t.data_ptr()] = key
        return t

    def release(self, tensor: torch.Tensor):
        """Hands a buffer from `buffer` back to the pool, under the key it was made with."""
        with self._lock:
            key = self._pool_key[tensor.data_ptr()]  # a KeyError here means it was never pooled
            self.free_buffers.setdefault(key, []).append(tensor)
            self._lock.notify_all()

    def pooled_count(self) -> int:
        with self._lock:
            return len(self._pool_key)

    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._registered.values()) + sum(self._host_allocated.values())

    def clear_pool(self):
        """Gives back the pooled buffers at the end of a run: a later run, with other shapes,
        reserves its own. (After a failed run some may still be out; they are garbage now.)"""
        with self._lock:
            free, self.free_buffers = self.free_buffers, {}
            self._made, self._limit, self._pool_key = {}, {}, {}
            self.failure = None
        for (_, _, tier, _), buffers in free.items():
            self.free(tier, buffers)

    def unpin_all(self):
        for ptr in list(self._registered):
            self._unpin(ptr)


def _unregister_all(registered: dict):
    for ptr in list(registered):
        torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()
