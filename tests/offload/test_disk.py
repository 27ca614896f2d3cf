"""The disk tier: round trips in every page-cache mode, the mode each filesystem gets, padded files,
and whether a read leaves the file's pages in the page cache."""

import ctypes
import errno
import fcntl
import mmap
import os
import threading

import pytest
import torch

from flexh2o.offload import disk
from flexh2o.offload.disk import ALIGN, DIRECT, EVICTED, MEMORY, USED, DiskStore

MODES = ["used", "direct", "evicted"]
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def make_store(tmp_path, mode, monkeypatch):
    """A store in `mode`; the evicted mode is the fallback where O_DIRECT is refused, forced here."""
    if mode != "used" and disk.fs_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("the test's temp dir is in memory: no page cache to bypass")
    if mode == "direct" and not disk.direct_io_works(str(tmp_path)):
        pytest.skip("the test's temp dir does not take O_DIRECT")
    if mode == "evicted":
        monkeypatch.setattr(disk, "direct_io_works", lambda directory: False)
    store = DiskStore(str(tmp_path), bypass_page_cache=mode != "used")
    assert store.page_cache == {"used": USED, "direct": DIRECT, "evicted": EVICTED}[mode]
    return store


def cached_pages(path) -> list[int]:
    """The pages of a file the page cache holds (mincore on a mapping of it, which reads nothing)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
        assert LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        return [page for page, bits in enumerate(vec) if bits & 1]
    finally:
        LIBC.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reads_return_what_was_written(tmp_path, monkeypatch, mode, dtype):
    monkeypatch.setattr(disk, "BOUNCE", 2 * ALIGN)  # several bounce chunks per read
    store = make_store(tmp_path, mode, monkeypatch)
    try:
        data = torch.randn(7001, dtype=torch.float32).to(dtype)  # not a multiple of ALIGN bytes
        f = store.create(data.numel() * data.element_size())
        store.write(f, 0, data)
        whole = torch.empty_like(data)
        store.read(f, 0, whole)
        assert torch.equal(whole, data)
        size, asked = data.element_size(), whole.numel()
        page = ALIGN // size
        for start, stop in [(1, 2), (7, 2500), (page, 7001), (1000, 7001), (2 * page, 3 * page)]:
            part = torch.full((stop - start,), 7.0, dtype=dtype)
            store.read(f, start * size, part)
            assert torch.equal(part, data[start:stop]), (start, stop)
            asked += stop - start
        aligned = disk.aligned_empty(ALIGN).view(dtype)  # aligned address, offset and length: read in place
        store.read(f, ALIGN, aligned)
        assert torch.equal(aligned, data[page: 2 * page])
        assert store.bytes_read == (asked + aligned.numel()) * size  # what was asked, not the widened ranges
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_disk_rows_are_written_in_runs_at_their_offsets(tmp_path, monkeypatch, mode):
    store = make_store(tmp_path, mode, monkeypatch)
    try:
        f = store.create(10 * 3 * 4)
        store.write(f, 0, torch.zeros(10, 3))
        store.write_rows(f, torch.tensor([1, 2, 3, 7]), torch.arange(12, dtype=torch.float32).view(4, 3) + 1)
        back = torch.empty(10, 3)
        store.read(f, 0, back)
        want = torch.zeros(10, 3)
        want[[1, 2, 3, 7]] = torch.arange(12, dtype=torch.float32).view(4, 3) + 1
        assert torch.equal(back, want)
        row = torch.empty(3)
        store.read(f, 7 * 3 * 4, row)
        assert torch.equal(row, want[7])
    finally:
        store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_files_are_padded_and_removed(tmp_path, monkeypatch, mode):
    store = make_store(tmp_path, mode, monkeypatch)
    files = [store.create(n) for n in (1, ALIGN, ALIGN + 1, 10_000)]
    assert [f.nbytes for f in files] == [1, ALIGN, ALIGN + 1, 10_000]
    assert [os.path.getsize(f.path) for f in files] == [ALIGN, ALIGN, 2 * ALIGN, 3 * ALIGN]
    store.remove(files[0])
    assert not os.path.exists(files[0].path) and files[0].fd is None
    run_dir = store.dir
    store.close()
    assert not os.path.exists(run_dir) and os.listdir(tmp_path) == []
    assert all(f.fd is None and f.dfd is None for f in files)


@pytest.mark.parametrize("mode", MODES)
def test_reads_use_o_direct_only_in_the_direct_mode(tmp_path, monkeypatch, mode):
    store = make_store(tmp_path, mode, monkeypatch)
    try:
        f = store.create(100)
        assert not fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        direct = f.dfd is not None and bool(fcntl.fcntl(f.dfd, fcntl.F_GETFL) & os.O_DIRECT)
        assert direct == (mode == "direct")
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_bypassed_reads_leave_no_pages_in_the_page_cache(tmp_path, monkeypatch, mode):
    """A whole-tensor write leaves no page cached in any mode (written past the page cache, O_DIRECT,
    where the filesystem allows it; else evicted with a bypass); with the page cache used, read pages
    stay cached; with either bypass a read leaves none, not even pages readahead would have added."""
    store = make_store(tmp_path, mode, monkeypatch)
    try:
        data = torch.randn(64 * ALIGN // 4)
        f = store.create(data.numel() * 4)
        store.write(f, 0, data)
        assert cached_pages(f.path) == (list(range(64)) if mode == "used" and not store.direct_writes else [])
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold in every mode
        part = torch.empty(ALIGN)
        store.read(f, 12, part)  # 16 KiB at an unaligned offset at the start of the file: pages 0..4
        assert torch.equal(part, data[3: ALIGN + 3])
        pages = cached_pages(f.path)
        if mode == "used":
            assert set(range(5)) <= set(pages)
        else:
            assert pages == []
    finally:
        store.close()


def test_fallback_and_memory_modes(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "fs_type", lambda path: "tmpfs")
    assert disk.page_cache_mode(str(tmp_path)) == MEMORY
    monkeypatch.setattr(disk, "fs_type", lambda path: "ext4")
    monkeypatch.setattr(disk, "direct_io_works", lambda directory: False)
    assert disk.page_cache_mode(str(tmp_path)) == EVICTED
    monkeypatch.undo()
    assert disk.fs_type("/proc/self") == "proc" and disk.fs_type(str(tmp_path)) not in ("", "proc")


@pytest.mark.parametrize("mode", MODES)
def test_making_a_store_starts_no_threads(tmp_path, monkeypatch, mode):
    threads = threading.active_count()
    store = make_store(tmp_path, mode, monkeypatch)
    try:
        assert threading.active_count() == threads
    finally:
        store.close()


def test_a_filesystem_refusing_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    """O_DIRECT writes refused with EINVAL (reads were allowed): the write goes out buffered, and
    every later one too; the data reads back whole."""
    store = DiskStore(str(tmp_path))
    try:
        def refuse(*args):
            raise disk.OffloadError(str(tmp_path), OSError(errno.EINVAL, os.strerror(errno.EINVAL)))
        monkeypatch.setattr(store, "_write_direct", refuse)
        store.direct_writes = True
        data = torch.randn(64 * ALIGN // 4)
        f = store.create(data.numel() * 4)
        store.write(f, 0, data)
        assert not store.direct_writes
        back = torch.empty_like(data)
        store.read(f, 0, back)
        assert torch.equal(back, data)
    finally:
        store.close()


@pytest.mark.parametrize("aligned", [True, False])
def test_aligned_memory_is_written_past_the_page_cache_without_a_bounce_copy(tmp_path, monkeypatch, aligned):
    """O_DIRECT writes take memory at an ALIGN boundary as it is (4-bit groups are made there,
    quant.groups_buffer); only a last partial block, or memory elsewhere, is copied to a bounce block."""
    store = DiskStore(str(tmp_path))
    if not store.direct_writes:
        store.close()
        pytest.skip("the test's temp dir does not take O_DIRECT writes")
    bounced = []
    bounce = store._bounce
    monkeypatch.setattr(store, "_bounce", lambda nbytes: bounced.append(nbytes) or bounce(nbytes))
    try:
        nbytes = 5 * ALIGN + 123
        data = disk.aligned_empty(nbytes + 1)[int(not aligned):][:nbytes]
        data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        f = store.create(nbytes)
        store.write(f, 0, data)
        back = torch.empty_like(data)
        store.read(f, 0, back)
        assert torch.equal(back, data)
        assert sum(bounced) == (ALIGN if aligned else 6 * ALIGN)
    finally:
        store.close()
