"""The disk tier: tensors in files under the offload dir, read and written by a small I/O pool.

Each run works in its own fresh sub-directory of --offload-dir, removed when the run ends (on
close, at interpreter exit, or when the engine is garbage collected), so a crash or Ctrl-C leaves
nothing behind. With `bypass_page_cache` every read is followed by posix_fadvise(DONTNEED) on the
range it read, and every write by fdatasync + DONTNEED, so benchmarks measure the disk itself
rather than the page cache.
"""

import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import UsageError

MAX_IO = 1 << 30  # bytes per system call; Linux caps a single read/write near 2 GiB


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer (works for bfloat16 too)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def ensure_dir(directory: str):
    """Creates the offload dir if needed; a clear error when that is impossible."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise UsageError("--offload-dir", f"cannot write to {directory}: {e.strerror}") from None


class DiskFile:
    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, nbytes)


class DiskStore:
    def __init__(self, offload_dir: str, bypass_page_cache: bool = False, threads: int = 4):
        ensure_dir(offload_dir)
        try:
            self.dir = tempfile.mkdtemp(prefix="flexh2o-run-", dir=offload_dir)
        except OSError as e:
            raise UsageError("--offload-dir", f"cannot write to {offload_dir}: {e.strerror}") from None
        self.bypass = bypass_page_cache
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="flexh2o-io")
        self.files: list[DiskFile] = []
        self.created = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._cleanup = weakref.finalize(self, _remove, self.dir, self.files, self.pool)

    def create(self, nbytes: int) -> DiskFile:
        self.created += 1
        f = DiskFile(os.path.join(self.dir, f"t{self.created:06d}.bin"), nbytes)
        self.files.append(f)
        return f

    def remove(self, f: DiskFile):
        os.close(f.fd)
        os.unlink(f.path)
        self.files.remove(f)

    def read(self, f: DiskFile, offset: int, out: torch.Tensor):
        """Fills the contiguous CPU tensor `out` from the file at `offset` (blocking)."""
        view, done = as_bytes(out), 0
        while done < len(view):
            n = os.preadv(f.fd, [view[done: done + MAX_IO]], offset + done)
            if n <= 0:
                raise OSError(f"short read from {f.path}")
            done += n
        if self.bypass:
            os.posix_fadvise(f.fd, offset, done, os.POSIX_FADV_DONTNEED)
        self.bytes_read += done

    def write(self, f: DiskFile, offset: int, data: torch.Tensor):
        """Writes the contiguous CPU tensor `data` to the file at `offset` (blocking)."""
        view, done = as_bytes(data), 0
        while done < len(view):
            done += os.pwritev(f.fd, [view[done: done + MAX_IO]], offset + done)
        if self.bypass:
            os.fdatasync(f.fd)
            os.posix_fadvise(f.fd, offset, done, os.POSIX_FADV_DONTNEED)
        self.bytes_written += done

    def write_rows(self, f: DiskFile, rows: torch.Tensor, data: torch.Tensor):
        """Writes data[i] (a contiguous CPU tensor [n, ...]) at row rows[i] of a file of equal-sized rows;
        rows sorted ascending. Neighbouring rows go out in one system call."""
        row_bytes = data[0].numel() * data.element_size()
        view = as_bytes(data.contiguous())
        r = rows.tolist()
        breaks = [0] + [i for i in range(1, len(r)) if r[i] != r[i - 1] + 1] + [len(r)]
        for a, b in zip(breaks, breaks[1:]):
            os.pwrite(f.fd, view[a * row_bytes: b * row_bytes], r[a] * row_bytes)
        if self.bypass and r:
            os.fdatasync(f.fd)
            os.posix_fadvise(f.fd, r[0] * row_bytes, (r[-1] + 1 - r[0]) * row_bytes, os.POSIX_FADV_DONTNEED)
        self.bytes_written += len(view)

    def submit(self, fn, *args):
        return self.pool.submit(fn, *args)

    def close(self):
        self._cleanup()


def _remove(directory, files, pool):
    pool.shutdown(wait=True, cancel_futures=True)
    for f in files:
        try:
            os.close(f.fd)
        except OSError:
            pass
    shutil.rmtree(directory, ignore_errors=True)
