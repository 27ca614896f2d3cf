"""A simulated CUDA device on the CPU build, so that the ordinary suite sees stream ordering.

The engine runs its CUDA branches (Tiers.on_cuda) on CPU tensors while this stands in for
torch.cuda's streams, events, non-blocking copies and host registration. Its model of a GPU:

- Every op other than a non-blocking copy runs when it is called, on the calling thread's current
  stream, after that stream's earlier copies have landed (a stream runs in order). Device memory
  is what ops on a stream made (torch.empty(device=...) included); an op touching none of it is a
  host op, on no stream. A blocking copy to or from the host returns once its stream is done.
- A non-blocking copy is queued on its stream: its destination holds a sentinel (NaN, 0xFF bytes,
  an impossible integer) until it lands, and it reads its source when it lands, not when queued.
  Copies land in stream order when an event recorded after them, or their stream, is synchronized;
  now and then earlier, at random (timings jitter, and I/O threads sleep a little at random).
- Ordering is checked with one clock per stream (ticked by each event recorded on it): memory that
  stream S used at tick c may be used on stream T only once T waited for an event of S recorded
  after it, or the host synchronized such an event (or S itself). Touching memory that a copy on
  another stream has not finished with is a race. Both are recorded in `violations`.
- New device and pinned memory holds garbage: the sentinel, which reaches the output where code
  reads memory it never wrote (e.g. 0 * NaN in attention over masked slots).
- cudaHostRegister fails on a page already registered and cudaHostUnregister on one that is not;
  `registered` must be empty when the run is closed. Synchronizing an event made without
  blocking=True is recorded: its waiting thread would spin on a core.

CUDA graphs are simulated too (simulated_graphs.py). Storages are the unit of memory (a view touches its whole storage); metadata and views are not
uses. Host work of I/O threads outside a stream context (disk reads and writes) is not watched.
Tests assert that `violations` stays empty (check()) and that the tokens and scores equal the CPU
run's: a missing wait shows as a violation, or as a sentinel reaching the output.
"""

import bisect
import ctypes
import math
import random
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

import simulated_graphs
from torch.utils._pytree import tree_flatten

ORIGINAL_COPY = torch.Tensor.copy_
ORIGINAL_EMPTY = torch.empty
INT_SENTINEL = -987654
# Ops that read no tensor's data: metadata, and views (an indexing with a tensor index is a gather).
NO_DATA = {"__get__", "size", "dim", "numel", "data_ptr", "element_size", "is_contiguous", "untyped_storage", "stride",
           "storage_offset", "is_floating_point", "__len__", "nelement", "ndimension", "get_device", "is_complex"}
VIEWS = {"__getitem__", "view", "view_as", "permute", "transpose", "unsqueeze", "squeeze", "expand", "expand_as",
         "narrow", "select", "t", "unflatten", "as_strided", "split", "chunk", "unbind", "movedim", "diagonal",
         "detach", "alias"}


class OrderingError(AssertionError):
    pass


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Stream:
    def __init__(self, sim, name: str):
        self.sim, self.name = sim, name
        self.queue = deque()  # (kind, payload) not landed yet, in order
        self.clock = 1        # ticked by each event recorded on this stream
        self.seen = {}        # stream -> the clock of the latest of its events this stream waited for
        self.issued = self.landed = 0
        self.cuda_stream = id(self)  # the handle a call into the CUDA runtime would be given

    def wait_event(self, event):
        self.sim.wait_event(self, event)

    def synchronize(self):
        self.sim.late()
        self.sim.land(self, self.issued, synchronized_clock=self.sim.tick(self))

    def query(self) -> bool:
        return not self.queue

    def __repr__(self):
        return f"<simulated stream {self.name}>"


class Event:
    def __init__(self, sim, blocking: bool = False, **_):
        self.sim, self.blocking = sim, blocking
        self.stream, self.position, self.clock, self.seen = None, 0, 0, {}

    def record(self, stream=None):
        sim = self.sim
        stream = stream or sim.current()
        with sim.lock:
            self.stream, self.position = stream, stream.issued
            self.clock = sim.tick(stream)
            self.seen = dict(stream.seen)

    def synchronize(self):
        if self.stream is None:
            return
        if not self.blocking:
            self.sim.violations.append("an event made without blocking=True was synchronized (its thread spins)")
        self.sim.late()
        self.sim.land(self.stream, self.position, synchronized_clock=self.clock)

    def query(self) -> bool:
        return self.stream is None or self.stream.landed >= self.position

    def wait(self, stream=None):
        self.sim.wait_event(stream or self.sim.current(), self)


class _Cudart:
    def __init__(self, sim):
        self.sim = sim
        self.fail_register = False  # a test sets it to see the fallback

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        sim = self.sim
        if self.fail_register:
            return 2  # cudaErrorMemoryAllocation
        with sim.lock:
            i = bisect.bisect_right(sim.starts, ptr)
            before = sim.starts[i - 1] if i else None
            if (before is not None and before + sim.pinned[before] > ptr) or \
                    (i < len(sim.starts) and sim.starts[i] < ptr + size):
                sim.violations.append(f"cudaHostRegister of a page already registered ({ptr:#x})")
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            sim.note_pinned(ptr, size)
            sim.registered[ptr] = size
        ctypes.memset(ptr, 0xFF, size)  # what new memory may hold (a NaN in every float dtype)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        sim = self.sim
        with sim.lock:
            if sim.registered.pop(ptr, None) is None:
                sim.violations.append(f"cudaHostUnregister of memory not registered ({ptr:#x})")
                return 713  # cudaErrorHostMemoryNotRegistered
            sim.pinned.pop(ptr)
            sim.starts.remove(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        return 0


class _Mode(TorchFunctionMode):
    """Sees every torch op of a thread while it is active: the main thread all along, an I/O
    thread inside `torch.cuda.stream(...)`."""

    def __init__(self, sim):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if sim.busy():
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in NO_DATA or (name in VIEWS and (name != "__getitem__" or len(inputs) == 1)):
            return func(*args, **kwargs)
        stream = sim.current()
        host = not (kwargs.get("device") is not None and not kwargs.get("pin_memory")) and \
            not any(sim.is_device(t) for t in inputs)
        sim.before_op(stream, inputs, name, host)
        out = func(*args, **kwargs)
        to_host = not host and waits_for_the_host(name, args, kwargs, inputs, sim)
        if to_host and out is args[0]:  # a copy to the host is a copy, not the device tensor itself
            with sim.internal():
                out = out.clone()
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        sim.after_op(stream, inputs, outputs, host=host or to_host, fresh=name in EMPTY)
        if to_host:
            stream.synchronize()
        return out


EMPTY = {"empty", "empty_like", "empty_strided"}


def waits_for_the_host(name, args, kwargs, inputs, sim) -> bool:
    """Whether the op is a blocking copy between the device and host memory, which returns only
    once its stream has finished everything up to it (as torch does)."""
    if name in ("cpu", "item", "tolist", "numpy"):
        return True
    if name == "to":
        return any(str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")])
    if name == "copy_":
        return not all(sim.is_device(t) for t in inputs[:2])
    return False


class SimulatedCuda:
    def __init__(self, seed: int = 0, jitter: float = 0.2):
        self.lock = threading.RLock()
        self.local = threading.local()
        self.rng, self.jitter_p = random.Random(seed), jitter
        self.default = Stream(self, "default")
        self.streams = [self.default]
        self.stamps = {}      # storage -> {stream: clock of its last use there}
        self.in_flight = {}   # storage -> [stream of each copy not landed that reads or writes it]
        self.completed = {}   # stream -> clock up to which the host has seen it finish
        self.pinned, self.starts = {}, []  # page-locked host ranges: start -> size, and the sorted starts
        self.registered = {}  # cudaHostRegister'ed: start -> size
        self.device_storages = set()  # storages that are device memory
        self.violations = []
        self.copies = 0
        self.cudart = _Cudart(self)

    # -- installing ------------------------------------------------------------------------------
    def install(self, monkeypatch):
        """Stands in for torch.cuda and makes every Tiers made from now on take its CUDA branches;
        returns the mode watching the main thread's ops (exit it at the end)."""
        import flexh2o.offload.buffers
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Stream", lambda device=None, **kw: self.new_stream())
        monkeypatch.setattr(cuda, "Event", lambda **kw: Event(self, **kw))
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: self.current())
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: self.synchronize_all())
        monkeypatch.setattr(cuda, "cudart", lambda: self.cudart)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 0)
        monkeypatch.setattr(torch, "empty", self.empty)
        simulated_graphs.install(self, monkeypatch)

        def copy_(dst, src, non_blocking=False):  # a function: a bound method set on the class would not bind
            return self.copy_(dst, src, non_blocking)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        init = flexh2o.offload.buffers.Buffers.__init__

        def simulated_init(buffers, device, dtype):
            init(buffers, device, dtype)
            buffers.on_cuda = True
        monkeypatch.setattr(flexh2o.offload.buffers.Buffers, "__init__", simulated_init)
        mode = _Mode(self)
        mode.__enter__()
        self.local.mode_on = True
        return mode

    def new_stream(self) -> Stream:
        with self.lock:
            s = Stream(self, f"side{len(self.streams)}")
            self.streams.append(s)
        return s

    def current(self) -> Stream:
        return getattr(self.local, "stream", None) or self.default

    @contextmanager
    def stream(self, s):
        if s is None:
            yield
            return
        previous, mode = getattr(self.local, "stream", None), None
        self.local.stream = s
        if not getattr(self.local, "mode_on", False):
            mode = _Mode(self)
            mode.__enter__()
            self.local.mode_on = True
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                self.local.mode_on = False
            self.local.stream = previous

    def busy(self) -> bool:
        return getattr(self.local, "busy", False)

    @contextmanager
    def internal(self):
        """The simulator's own tensor work: not seen as the program's."""
        was = self.busy()
        self.local.busy = True
        try:
            yield
        finally:
            self.local.busy = was

    # -- pinned memory ---------------------------------------------------------------------------
    def note_pinned(self, ptr: int, size: int):
        self.pinned[ptr] = size
        bisect.insort(self.starts, ptr)

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether t is device memory: made by an op on a stream (torch.empty(device=...) included)."""
        return storage_of(t) in self.device_storages

    def empty(self, *args, pin_memory=False, **kwargs):
        """Device or pinned memory, holding garbage as new memory may: the sentinel."""
        if pin_memory:
            kwargs.pop("device", None)  # host memory
        t = ORIGINAL_EMPTY(*args, **kwargs)
        if pin_memory or kwargs.get("device") is not None:
            with self.internal():
                fill_sentinel(t)
        return t

    # -- clocks and checks -----------------------------------------------------------------------
    def tick(self, stream: Stream) -> int:
        """Ticks the stream's clock (an event recorded on it); returns the tick the event marks:
        everything used on the stream before it."""
        with self.lock:
            stream.clock += 1
            return stream.clock - 1

    def note(self, message: str):
        """Records a violation, with where in flexh2o it happened."""
        frames = [f for f in traceback.extract_stack() if "flexh2o" in f.filename and "simulated" not in f.filename]
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        self.violations.append(f"{message} [{where}]")

    def ordered(self, stream: Stream, storage: int, what: str):
        """Whether everything other streams did with `storage` is ordered before `stream`'s use now."""
        for other, clock in self.stamps.get(storage, {}).items():
            if other is stream:
                continue
            if stream.seen.get(other, 0) > clock or self.completed.get(other, 0) > clock:
                continue
            self.note(f"{what} on {stream.name} uses memory that {other.name} used at tick {clock}, "
                                   f"unordered (waited for up to {stream.seen.get(other, 0)}, "
                                   f"host saw {self.completed.get(other, 0)})")

    def racing(self, storage: int, allowed: Stream | None, what: str):
        for other in self.in_flight.get(storage, ()):
            if other is not allowed:
                self.note(f"{what} uses memory that a copy on {other.name} has not finished with")
                return

    def stamp(self, stream: Stream, storages, fresh=()):
        for s in fresh:
            self.stamps[s] = {}
        for s in storages:
            self.stamps.setdefault(s, {})[stream] = stream.clock

    def before_op(self, stream: Stream, inputs, name: str, host: bool):
        """Lands and checks what the op needs. A host op (touching no device memory) is on no stream."""
        if not host:
            self.land(stream, stream.issued)  # in order behind the stream's own copies
            if self.rng.random() < self.jitter_p:
                self.land_some()
        with self.lock:
            storages = {storage_of(t) for t in inputs}
            for s in storages:
                self.racing(s, None if host else stream, f"{name} ({'host' if host else 'device'})")
                if not host:
                    self.ordered(stream, s, name)

    def after_op(self, stream: Stream, inputs, outputs, host: bool, fresh: bool):
        """Stamps what a device op used, and notes which new tensors are device memory. A new
        tensor's memory may have been freed by others: their earlier uses no longer count (an empty
        tensor is not used at all yet)."""
        with self.lock:
            used = {storage_of(t) for t in inputs}
            made = {storage_of(t) for t in outputs} - used
            if host:  # a host op's, or a copy to the host's, new tensors are host memory
                self.device_storages.difference_update(made)
                self.stamp(stream, (), fresh=made)
                return
            self.device_storages.update(made)
            self.stamp(stream, () if fresh else used | made, fresh=made)

    # -- copies ----------------------------------------------------------------------------------
    def copy_(self, dst, src, non_blocking=False):
        if not non_blocking or self.busy() or not isinstance(src, torch.Tensor):
            return ORIGINAL_COPY(dst, src, non_blocking)
        self.late()
        stream = self.current()
        with self.lock, self.internal():
            self.copies += 1
            storages = {storage_of(dst), storage_of(src)}
            for s in storages:
                self.racing(s, stream, "a non-blocking copy")
                self.ordered(stream, s, "a non-blocking copy")
                self.in_flight.setdefault(s, []).append(stream)
            self.stamp(stream, storages)
            fill_sentinel(dst)
            stream.queue.append(("copy", (dst, src, storages)))
            stream.issued += 1
        return dst

    def wait_event(self, stream: Stream, event: Event):
        if event.stream is None or event.stream is stream:
            return
        with self.lock:
            stream.queue.append(("wait", event))
            stream.issued += 1
            for other, clock in list(event.seen.items()) + [(event.stream, event.clock + 1)]:
                stream.seen[other] = max(stream.seen.get(other, 0), clock)

    def land(self, stream: Stream, upto: int, synchronized_clock: int | None = None):
        """Lands the stream's ops before position `upto`; a host synchronize also marks the stream
        finished up to the event's tick."""
        with self.lock, self.internal():
            while stream.landed < upto and stream.queue:
                kind, payload = stream.queue.popleft()
                if kind == "copy":
                    dst, src, storages = payload
                    ORIGINAL_COPY(dst, src)
                    for s in storages:
                        self.in_flight[s].remove(stream)
                        if not self.in_flight[s]:
                            del self.in_flight[s]
                else:
                    self.land(payload.stream, payload.position)
                stream.landed += 1
            if synchronized_clock is not None:
                self.completed[stream] = max(self.completed.get(stream, 0), synchronized_clock + 1)

    def late(self):
        """Jitter: an I/O thread is now and then a little late (queuing a copy, or waiting for one),
        while the compute thread goes on."""
        if threading.current_thread() is not threading.main_thread() and self.rng.random() < self.jitter_p:
            time.sleep(self.rng.random() * 1e-3)

    def land_some(self):
        """Jitter: the oldest op of one stream lands early."""
        with self.lock:
            busy = [s for s in self.streams if s.queue]
            if busy:
                s = self.rng.choice(busy)
                self.land(s, s.landed + 1)

    def synchronize_all(self):
        for s in list(self.streams):
            s.synchronize()

    def check(self):
        """Raises on the first ordering violation seen."""
        if self.violations:
            raise OrderingError(f"{len(self.violations)} ordering violations; first: {self.violations[0]}")


def fill_sentinel(t: torch.Tensor):
    if t.is_floating_point():
        t.fill_(math.nan)
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)  # a group's float16 scale becomes NaN
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(INT_SENTINEL)
