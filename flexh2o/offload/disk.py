"""The disk tier: tensors in files under the offload dir.

Each run works in its own fresh sub-directory of --offload-dir (offload_dir.py), removed when the
run ends (on close, at interpreter exit, or when the engine is garbage collected), so a crash or
Ctrl-C leaves nothing behind. A write that fails (the disk filled up after the pre-flight) raises
OffloadError, which names the directory.

Whole tensors (weights at load time, the prompt's cache) are written past the page cache where the
filesystem allows it (O_DIRECT, through an aligned bounce block), two halves at once; the per-token
rows of the cache stay buffered (a per-token fdatasync would only measure the sync).

With `bypass_page_cache`, reads miss every cache so benchmarks measure the disk: they use O_DIRECT
where the filesystem allows it, else the pages a read touched are evicted after it, with readahead
off. (An offload dir on tmpfs is memory: nothing to bypass, and the mode says so.) An O_DIRECT read
first flushes the dirty pages of its range, so it sees buffered writes.

With `flush_writes` (a memory limit applies: a cgroup charges the process for its dirty pages until
they reach the disk), written pages are flushed whenever the store has DIRTY_WINDOW bytes not yet
flushed, and large writes go out a window at a time: each writing thread holds at most a window
dirty (host/process_memory.py counts that).
"""

import errno
import os
import shutil
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from flexh2o.host.aligned_memory import ALIGN, aligned_empty
from flexh2o.offload.offload_dir import make_run_dir, remove_empty
from flexh2o.host.process_memory import DIRTY_WINDOW
from flexh2o.common.signals import deferred

MAX_IO = 1 << 30    # bytes per system call; Linux caps a single read/write near 2 GiB
# A write this large goes out as two halves at once: here one stream of buffered writes ran at
# 0.43 GB/s, two at 1.6 (where O_DIRECT writes are refused, and under a memory limit); O_DIRECT
# writes ran at 1.65 GB/s in one stream, 1.69 in two.
PARALLEL_WRITE_BYTES = 8 << 20
BOUNCE = 8 << 20    # largest aligned staging buffer per I/O thread
ROW_READERS = 8     # reads of scattered rows in flight at once (read_rows)

USED = "used"
DIRECT = "bypassed by reads (O_DIRECT)"
EVICTED = "evicted after use (posix_fadvise DONTNEED, readahead off)"
MEMORY = "in memory (the offload dir is on tmpfs: no disk to read)"


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer (works for bfloat16 too)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class OffloadError(OSError):
    """Writing the offload files failed mid-run (most often: the disk is full)."""

    def __init__(self, directory: str, cause: OSError):
        reason = "the disk is full" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else cause.strerror or str(cause)
        super().__init__(cause.errno, f"cannot write the offload files in {directory}: {reason}")


def pread_all(fd: int, view: memoryview, offset: int, path: str):
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done: done + MAX_IO]], offset + done)
        if n <= 0:
            raise OSError(f"short read from {path}")
        done += n


def pwrite_all(fd: int, view: memoryview, offset: int):
    """Writes all of `view`; a short write on a nearly full disk is continued until it fails."""
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done: done + MAX_IO]], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def fs_type(path: str) -> str:
    """The type of the filesystem holding `path` (the deepest mount in /proc/mounts), "" if unknown."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                mnt, typ = line.split()[1:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, typ
    except OSError:
        pass
    return kind


def direct_io_works(directory: str) -> bool:
    """Whether files in `directory` can be read with O_DIRECT (one aligned block, written and read back)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, "probe")
    fd = dfd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, bytes(range(256)) * (ALIGN // 256))
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = aligned_empty(ALIGN)
        return os.preadv(dfd, [as_bytes(buf)], 0) == ALIGN and buf[255].item() == 255
    except OSError:
        return False
    finally:
        for d in (fd, dfd):
            if d is not None:
                os.close(d)
        if os.path.exists(path):
            os.unlink(path)


def page_cache_mode(directory: str) -> str:
    """How reads of files in `directory` can miss the page cache: DIRECT, EVICTED or MEMORY."""
    if fs_type(directory) in ("tmpfs", "ramfs"):
        return MEMORY
    return DIRECT if direct_io_works(directory) else EVICTED


class DiskFile:
    def __init__(self, path: str, nbytes: int, direct: bool, random: bool):
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, -(-nbytes // ALIGN) * ALIGN)  # padded, so widened reads stay inside
        self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT) if direct else None
        self.wfd = None  # O_DIRECT for writing, opened by the first such write
        if random:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def close(self):
        for fd in (self.fd, self.dfd, self.wfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dfd = self.wfd = None


class DiskStore:
    def __init__(self, offload_dir: str, bypass_page_cache: bool = False, flush_writes: bool = False):
        self.files: list[DiskFile] = []
        self.flush_writes = flush_writes
        self._unflushed: dict = {}  # file -> bytes written to it since it was last flushed (with flush_writes)
        with deferred():  # a signal before the finalizer is registered would leave the folders behind
            self.dir, created = make_run_dir(offload_dir)
            self._cleanup = weakref.finalize(self, _remove, self.dir, self.files, created)
        self.page_cache = page_cache_mode(self.dir) if bypass_page_cache else USED
        self.created = 0
        self.bytes_read = 0   # what callers asked for, not the aligned ranges O_DIRECT widens them to
        self.bytes_written = 0
        self._count = threading.Lock()
        self._local = threading.local()  # per I/O thread: its aligned bounce buffer
        self._row_readers = None  # threads of read_rows, started by its first scattered read
        # Whole tensors go out past the page cache where the filesystem allows it (not under a
        # memory limit: those writes are flushed a window at a time, buffered).
        self.direct_writes = not flush_writes and direct_io_works(self.dir)

    @contextmanager
    def _writing(self):
        try:
            yield
        except OSError as e:
            raise OffloadError(os.path.dirname(self.dir), e) from e

    def create(self, nbytes: int) -> DiskFile:
        self.created += 1
        with self._writing():
            f = DiskFile(os.path.join(self.dir, f"t{self.created:06d}.bin"), nbytes,
                         direct=self.page_cache == DIRECT, random=self.page_cache == EVICTED)
        self.files.append(f)
        return f

    def remove(self, f: DiskFile):
        with self._count:
            self._unflushed.pop(f, None)
        f.close()
        os.unlink(f.path)
        self.files.remove(f)

    def read(self, f: DiskFile, offset: int, out: torch.Tensor):
        """Fills the contiguous CPU tensor `out` from the file at `offset` (blocking)."""
        dst = out.view(-1).view(torch.uint8)
        n = dst.numel()
        if self.page_cache == DIRECT:
            self._read_direct(f, offset, dst)
        else:
            pread_all(f.fd, as_bytes(dst), offset, f.path)
            if self.page_cache == EVICTED:
                start, end = _widen(offset, n)
                os.posix_fadvise(f.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        with self._count:
            self.bytes_read += n

    def _read_direct(self, f: DiskFile, offset: int, dst: torch.Tensor):
        if offset % ALIGN == 0 and dst.data_ptr() % ALIGN == 0:
            # Whole blocks straight into dst; only a last partial block goes through the bounce
            # block (a copy there leaves the disk idle, as far as this thread is concerned).
            whole = dst.numel() // ALIGN * ALIGN
            if whole:
                pread_all(f.dfd, as_bytes(dst[:whole]), offset, f.path)
            offset, dst = offset + whole, dst[whole:]
        n = dst.numel()
        if not n:
            return
        start, end = _widen(offset, n)
        for pos in range(start, end, BOUNCE):
            chunk = min(BOUNCE, end - pos)
            bounce = self._bounce(chunk)
            pread_all(f.dfd, as_bytes(bounce), pos, f.path)
            lo, hi = max(pos, offset), min(pos + chunk, offset + n)
            # numpy: one thread, GIL released; torch's copy_ would start a thread team per I/O thread
            np.copyto(dst[lo - offset: hi - offset].numpy(), bounce[lo - pos: hi - pos].numpy())

    def _bounce(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.bounce = aligned_empty(nbytes)
        return buf[:nbytes]

    def write(self, f: DiskFile, offset: int, data: torch.Tensor):
        """Writes the contiguous CPU tensor `data` to the file at `offset` (blocking). Called for
        whole tensors (weights at load time, the prompt's cache): with bypass on, their pages are
        synced and dropped so they do not sit in RAM. A large one goes out as two halves at once
        (not under a memory limit, whose dirty pages are flushed a window at a time)."""
        view = as_bytes(data)
        if len(view) < PARALLEL_WRITE_BYTES or self.flush_writes:
            self._write_range(f, offset, view)
        else:
            half = len(view) // 2 // ALIGN * ALIGN
            failed = []

            def second_half():
                try:
                    self._write_range(f, offset + half, view[half:])
                except BaseException as e:  # raised on the caller's thread below
                    failed.append(e)
            writer = threading.Thread(target=second_half, name="flexh2o-disk-write", daemon=True)
            writer.start()
            try:
                self._write_range(f, offset, view[:half])
            finally:
                writer.join()
            if failed:
                raise failed[0]
        with self._count:
            self.bytes_written += len(view)

    def _write_range(self, f: DiskFile, offset: int, view: memoryview):
        if self.direct_writes and offset % ALIGN == 0 and (len(view) % ALIGN == 0 or offset + len(view) == f.nbytes):
            try:
                self._write_direct(f, offset, view)
                return
            except OffloadError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_writes = False  # a filesystem that reads O_DIRECT but refuses such writes: buffered
        step = DIRTY_WINDOW if self.flush_writes else len(view)
        with self._writing():
            for pos in range(0, len(view), max(step, 1)):
                pwrite_all(f.fd, view[pos: pos + step], offset + pos)
                if self.page_cache in (DIRECT, EVICTED) or self.flush_writes:
                    os.fdatasync(f.fd)
                if self.page_cache in (DIRECT, EVICTED):
                    start, end = _widen(offset + pos, len(view[pos: pos + step]))
                    os.posix_fadvise(f.fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def _write_direct(self, f: DiskFile, offset: int, view: memoryview):
        """Writes past the page cache (O_DIRECT): buffered, placing OPT-1.3B's dummy weights wrote
        at 0.26-0.52 GB/s here, as fast as the kernel wrote dirty pages back. Memory at an ALIGN
        boundary goes out as it is, whole blocks of it; the rest through an aligned bounce block
        (a copy that cost placing 4-bit weights a tenth of its CPU time), a last partial block
        padded with zeros, inside the file's padding."""
        with self._writing():
            if f.wfd is None:
                f.wfd = os.open(f.path, os.O_WRONLY | os.O_DIRECT)
            direct = len(view) // ALIGN * ALIGN if np.frombuffer(view, np.uint8).ctypes.data % ALIGN == 0 else 0
            for pos in range(0, direct, MAX_IO):
                pwrite_all(f.wfd, view[pos: min(pos + MAX_IO, direct)], offset + pos)
            view, offset = view[direct:], offset + direct
            for pos in range(0, len(view), BOUNCE):
                piece = view[pos: pos + BOUNCE]
                padded = -(-len(piece) // ALIGN) * ALIGN
                bounce = as_bytes(self._bounce(padded))
                bounce[:len(piece)] = piece
                bounce[len(piece):] = bytes(padded - len(piece))
                pwrite_all(f.wfd, bounce, offset + pos)

    def read_rows(self, f: DiskFile, rows: torch.Tensor, out: torch.Tensor):
        """Fills out[i] (a contiguous CPU tensor [n, ...]) from row rows[i] of a file of equal-sized
        rows; rows sorted ascending. Neighbouring rows come in one read, and up to ROW_READERS reads
        at once: each is a round trip to the device (an input embedding's 64 rows, one at a time,
        took 13 ms of a 0.35 s decode step)."""
        row_bytes = out[0].numel() * out.element_size()
        pieces = list(runs(rows))
        if len(pieces) == 1:
            a, b, first = pieces[0]
            self.read(f, first * row_bytes, out[a:b])
            return
        if self._row_readers is None:
            self._row_readers = ThreadPoolExecutor(ROW_READERS, thread_name_prefix="flexh2o-rows")
        list(self._row_readers.map(lambda p: self.read(f, p[2] * row_bytes, out[p[0]:p[1]]), pieces))

    def write_rows(self, f: DiskFile, rows: torch.Tensor, data: torch.Tensor):
        """Writes data[i] (a contiguous CPU tensor [n, ...]) at row rows[i] of a file of equal-sized rows;
        rows sorted ascending. Neighbouring rows go out in one system call. One token's slots: buffered,
        never synced here (see the module note)."""
        row_bytes = data[0].numel() * data.element_size()
        view = as_bytes(data.contiguous())
        with self._writing():
            for a, b, first in runs(rows):
                pwrite_all(f.fd, view[a * row_bytes: b * row_bytes], first * row_bytes)
            if self.flush_writes:
                self._flush_past_window(f, len(view))
        with self._count:
            self.bytes_written += len(view)

    def _flush_past_window(self, f: DiskFile, nbytes: int):
        """Counts `nbytes` written to f; once the store holds DIRTY_WINDOW unflushed, flushes them all."""
        with self._count:
            self._unflushed[f] = self._unflushed.get(f, 0) + nbytes
            if sum(self._unflushed.values()) < DIRTY_WINDOW:
                return
            files, self._unflushed = list(self._unflushed), {}
        for g in files:
            if g.fd is not None:
                os.fdatasync(g.fd)

    def close(self):
        if self._row_readers is not None:
            self._row_readers.shutdown()
        self._cleanup()


def runs(rows: torch.Tensor):
    """(a, b, rows[a]) for each run rows[a:b] of consecutive row numbers (rows sorted ascending)."""
    r = rows.tolist()
    breaks = [0] + [i for i in range(1, len(r)) if r[i] != r[i - 1] + 1] + [len(r)]
    for a, b in zip(breaks, breaks[1:]):
        yield a, b, r[a]


def _widen(offset: int, nbytes: int) -> tuple[int, int]:
    """The ALIGN-aligned byte range [start, end) that covers [offset, offset + nbytes)."""
    return offset - offset % ALIGN, -(-(offset + nbytes) // ALIGN) * ALIGN


def _remove(directory, files, created):
    with deferred():
        for f in files:
            f.close()
        shutil.rmtree(directory, ignore_errors=True)
        remove_empty(created)
