"""Where the CPU computes, the I/O threads keep off the compute's cores: their copies run on their
own thread, compressed weights are dequantized by the compute thread when it waits, and disk reads
land in page-aligned buffers directly (no bounce buffer, no extra copy)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flexh2o import Engine, Policy
from flexh2o.offload.disk import ALIGN, DiskStore
from flexh2o.offload.tiers import Tiers, copy_in_memory
from conftest import padded_batch

NEW = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.uint8])
def test_a_copy_off_the_main_thread_equals_torchs(dtype):
    src = (torch.randn(6, 5, 7, 3) * 50).to(dtype)
    with ThreadPoolExecutor(1) as pool:
        for view in (lambda t: t, lambda t: t.permute(2, 0, 1, 3), lambda t: t[:, 1:4]):
            dst = torch.zeros_like(view(src))
            pool.submit(copy_in_memory, dst, view(src)).result()
            assert torch.equal(dst, view(src))
    cast = torch.zeros(6, 5, 7, 3, dtype=torch.float64)  # another dtype: torch's copy_ converts
    with ThreadPoolExecutor(1) as pool:
        pool.submit(copy_in_memory, cast, src).result()
    assert torch.equal(cast, src.to(torch.float64))


def test_cpu_buffers_are_page_aligned_and_disk_reads_go_straight_in(tmp_path, monkeypatch):
    tiers = Tiers("cpu", torch.float32, DiskStore(str(tmp_path), bypass_page_cache=True))
    try:
        for shape in [(3, 1000), (17,), (4096, 3)]:
            assert tiers.buffer(shape).data_ptr() % ALIGN == 0
            assert tiers.alloc("cpu", shape).data_ptr() % ALIGN == 0
        data = torch.randn(64, 256)
        f = tiers.disk.create(data.numel() * 4)
        tiers.disk.write(f, 0, data)
        if tiers.disk.page_cache == "direct":
            monkeypatch.setattr(DiskStore, "_bounce", lambda *a: pytest.fail("read through a bounce buffer"))
        out = tiers.buffer((64, 256))
        tiers.read_disk(f, 0, out)
        assert torch.equal(out, data)
    finally:
        tiers.close()


def run(directory, policy, tmp_path):
    ids, mask = padded_batch(policy.batch_size, 10, pads=[(r * 3) % 8 for r in range(policy.batch_size)], seed=5)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path)) as engine:
        out = engine.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None)
        return out, engine.last_stats, engine.tiers


def test_compressed_weights_in_memory_queue_no_io_task(tiny_models, tmp_path):
    directory, _ = tiny_models["wide"]
    out, stats, _ = run(directory, Policy(4, compress_weight=True), tmp_path)
    assert stats.step_io_tasks == [0] * NEW
    assert all(s > 0 for s in stats.step_dequant_seconds), "the compute thread dequantized every step"
    off, *_ = run(directory, Policy(4, compress_weight=True, overlap=False), tmp_path)
    assert torch.equal(out, off)


@pytest.mark.parametrize("nb", [1, 2])
def test_compressed_weights_on_disk_are_read_by_io_threads_and_dequantized_by_compute(tiny_models, tmp_path,
                                                                                       monkeypatch, nb):
    directory, _ = tiny_models["wide"]
    dequantizing = []
    original = Tiers.dequantize

    def dequantize(self, packed, out, *fmt):
        dequantizing.append(threading.current_thread().name)
        original(self, packed, out, *fmt)
    monkeypatch.setattr(Tiers, "dequantize", dequantize)
    policy = Policy(4 // nb, nb, 0, 30, compress_weight=True)
    out, stats, _ = run(directory, policy, tmp_path)
    assert set(dequantizing) == {"MainThread"}
    assert all(t > 0 for t in stats.step_io_tasks)
    off, *_ = run(directory, Policy(4 // nb, nb, 0, 30, compress_weight=True, overlap=False), tmp_path)
    assert torch.equal(out, off)
