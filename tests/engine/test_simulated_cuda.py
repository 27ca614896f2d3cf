"""The engine's CUDA branches on a simulated device (simulated_cuda.py): copies that land late,
streams checked for ordering, host registrations paired. Tokens equal the CPU run's and scores
agree to 1e-5 over the placement matrix; taking out a wait the ordering needs is caught."""

import ctypes
import math
import threading
import time

import pytest
import torch

from flexh2o import Engine, Policy
from flexh2o.offload import cuda_io
from flexh2o.offload.buffers import Buffers
from flexh2o.engine.preflight import compute_copy_bytes
from flexh2o.offload.cuda_io import Copied, CudaCopies, Landed
from flexh2o.kv.home import CacheHome
from flexh2o.offload.tiers import Tiers
from conftest import padded_batch, sixteen_bit_opt
from simulated_cuda import SimulatedCuda

NEW_TOKENS = 5


def batch_for(policy):
    batch = policy.gpu_batch_size * policy.num_gpu_batches
    return padded_batch(batch, 9, pads=[0, 2, 1, 3, 0, 4][:batch], seed=3)


def generate(directory, policy, offload_dir, generate_kwargs=None, **kwargs):
    ids, mask = batch_for(policy)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(offload_dir), **kwargs) as engine:
        out = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, output_scores=True, eos_token_id=None,
                              **(generate_kwargs or {}))
        return out, engine.last_stats


def cpu_reference(directory, policy, offload_dir):
    """The same run where the CPU is the compute device (before the simulator is installed)."""
    return generate(directory, policy, offload_dir)[0]


def assert_same(reference, out):
    """Same tokens; logits within float32 rounding of each other (a CPU decode of the full cache
    attends by native/attention.c, the CUDA one by PyTorch's fused kernel: sums in another order)."""
    assert torch.equal(reference.sequences, out.sequences)
    for a, b in zip(reference.scores, out.scores):
        assert torch.allclose(a, b, atol=3e-5, rtol=1e-5), (a - b).abs().max()


def policy(weights=(100, 0), cache=(100, 0), act="gpu", batches=2, **kwargs):
    return Policy(gpu_batch_size=3 if batches == 1 else 2, num_gpu_batches=batches,
                  w_gpu_percent=weights[0], w_cpu_percent=weights[1],
                  cache_gpu_percent=cache[0], cache_cpu_percent=cache[1],
                  act_gpu_percent=100 if act == "gpu" else 0, act_cpu_percent=100 if act == "cpu" else 0, **kwargs)


MATRIX = {
    "all-on-gpu": policy(batches=1),
    "weights-cpu": policy((0, 100), batches=1),
    "weights-disk-cache-cpu": policy((0, 0), (0, 100)),
    "mixed-act-cpu": policy((30, 40), (34, 33), "cpu", batches=3),
    "cache-disk-act-cpu-h2o": policy((20, 30), (0, 0), "cpu", batches=3, hh_ratio=0.3),
    "mixed-h2o": policy((50, 50), (50, 0), "cpu", hh_ratio=0.3),
    "cpu-cache-compute": policy((0, 50), (0, 100), "cpu", cpu_cache_compute=True),
    "cpu-cache-compute-mixed-h2o": policy((20, 0), (34, 33), "cpu", batches=3, cpu_cache_compute=True, hh_ratio=0.3),
    "compressed-mixed": policy((30, 40), (34, 33), "cpu", batches=3, compress_weight=True, compress_cache=True),
    "compressed-disk-h2o": policy((0, 0), (0, 0), batches=2, compress_weight=True, compress_cache=True, hh_ratio=0.3),
    "no-overlap-mixed": policy((30, 40), (34, 33), "cpu", overlap=False),
}


def simulated_run(directory, policy, tmp_path, monkeypatch, seed=0, before=None, generate_kwargs=None):
    """The run on the simulated device, checked: no ordering violation, registrations paired."""
    simulated = SimulatedCuda(seed=seed)
    mode = simulated.install(monkeypatch)
    try:
        if before is not None:
            before(simulated)
        out, stats = generate(directory, policy, tmp_path, generate_kwargs)
    finally:
        mode.__exit__(None, None, None)
    simulated.check()
    assert simulated.registered == {}, "host memory left registered"
    return out, stats, simulated


@pytest.mark.parametrize("name", list(MATRIX))
def test_cuda_branches_match_the_cpu_on_a_simulated_device(tiny_models, tmp_path, monkeypatch, name):
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, MATRIX[name], tmp_path)
    out, stats, simulated = simulated_run(directory, MATRIX[name], tmp_path, monkeypatch, seed=len(name))
    assert_same(reference, out)
    assert stats.step_allocations[2:] == [0] * (NEW_TOKENS - 2)
    if name != "all-on-gpu":
        assert simulated.copies > 0  # the copies did go through the simulated streams


@pytest.mark.parametrize("simulated", [False, True])
@pytest.mark.parametrize("name", ["weights-cpu", "mixed-act-cpu", "compressed-mixed", "compressed-disk-h2o",
                                  "16-bit-weights-cpu", "16-bit-mixed-act-cpu"])
def test_weight_buffers_are_made_before_the_run_as_the_preflight_counts(tiny_models, tmp_path, monkeypatch, name,
                                                                       simulated):
    """Every pooled buffer a weight load takes is made before the prompt step (made on first use,
    an LM head's came after it, when the prompt's work was already done), and they add up to the
    pre-flight's compute copies; none of those shapes is made again during the run. 16-bit: a
    float16 checkpoint, kept 16-bit (gguf_blocks.keeps_16_bit)."""
    directory = sixteen_bit_opt(tmp_path, torch.float16) if name.startswith("16-bit") else tiny_models["wide"][0]
    name = name.removeprefix("16-bit-")
    made, seen = [], {}
    original_new, original_reserve, original_generate = Buffers._new_buffer, Tiers.reserve_loads, Engine.generate

    def new_buffer(pool, key):
        made.append(key)
        return original_new(pool, key)

    def reserve_loads(tiers, layers):
        original_reserve(tiers, layers)
        seen.update(tiers=tiers, keys=set(made), bytes=sum(math.prod(k[0]) * k[1].itemsize for k in made))
        made.clear()

    def generate_recording_layers(engine, *args, **kwargs):
        seen["layers"] = engine.layers
        return original_generate(engine, *args, **kwargs)
    monkeypatch.setattr(Buffers, "_new_buffer", new_buffer)
    monkeypatch.setattr(Tiers, "reserve_loads", reserve_loads)
    monkeypatch.setattr(Engine, "generate", generate_recording_layers)
    if simulated:
        simulated_run(directory, MATRIX[name], tmp_path, monkeypatch)
    else:
        generate(directory, MATRIX[name], tmp_path)
    device = torch.device("cuda" if simulated else "cpu")  # the simulated device computes on CPU tensors
    assert seen["bytes"] == compute_copy_bytes(seen["layers"], seen["tiers"].dtype.itemsize, MATRIX[name], device)
    # on the CPU, CPU memory is used in place (16-bit weights are not: widened into buffers)
    assert (seen["bytes"] > 0) == (simulated or name != "weights-cpu" or directory != tiny_models["wide"][0])
    assert not seen["keys"] & set(made)


SLOW_STORES = {
    "weights-disk-cache-cpu": MATRIX["weights-disk-cache-cpu"],
    "compressed-disk-h2o": MATRIX["compressed-disk-h2o"],
    # No other I/O task queues behind the stores: the CPU-attended homes are waited for themselves.
    "cpu-cache-compute-weights-on-gpu": policy((100, 0), (0, 100), cpu_cache_compute=True),
}


@pytest.mark.parametrize("name", list(SLOW_STORES))
def test_a_slow_cache_store_is_waited_for(tiny_models, tmp_path, monkeypatch, name):
    """The next load of a part (or a step attending over a home in place) waits for its last store,
    however late that store's writes are: here the prompt's."""
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, SLOW_STORES[name], tmp_path)
    write = CacheHome._write

    def slow_write(home, part, buf, groups):
        if isinstance(buf.written, str):
            time.sleep(0.15)
        write(home, part, buf, groups)
    monkeypatch.setattr(CacheHome, "_write", slow_write)
    out, _, _ = simulated_run(directory, SLOW_STORES[name], tmp_path, monkeypatch)
    assert_same(reference, out)


def test_the_copies_follow_a_stream_of_the_callers(tiny_models, tmp_path, monkeypatch):
    """A caller running the engine under its own current stream: the copies wait for the compute
    queued on that stream, not on the default one."""
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, MATRIX["mixed-act-cpu"], tmp_path)
    simulated = SimulatedCuda(seed=5)
    mode = simulated.install(monkeypatch)
    try:
        ids, mask = batch_for(MATRIX["mixed-act-cpu"])
        with Engine.from_pretrained(directory, policy=MATRIX["mixed-act-cpu"], device="cpu", dtype=torch.float32,
                                    offload_dir=str(tmp_path)) as engine:
            with torch.cuda.stream(torch.cuda.Stream()):
                out = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, output_scores=True, eos_token_id=None)
    finally:
        mode.__exit__(None, None, None)
    simulated.check()
    assert_same(reference, out)


def test_pinning_falls_back_when_cuda_host_register_fails(tiny_models, tmp_path, monkeypatch, capsys):
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, MATRIX["mixed-h2o"], tmp_path)

    def refuse(simulated):
        simulated.cudart.fail_register = True
    out, _, simulated = simulated_run(directory, MATRIX["mixed-h2o"], tmp_path, monkeypatch, before=refuse)
    assert_same(reference, out)
    lines = [line for line in capsys.readouterr().err.splitlines() if "cudaHostRegister" in line]
    assert len(lines) == 1 and "pinned host memory comes from torch's allocator instead" in lines[0]


def test_staged_copies_wait_before_their_block_is_reused(monkeypatch):
    """Host data that is not pinned goes through a staging block: a second copy through the same
    block must not overwrite it before the first copy read it."""
    simulated = SimulatedCuda(seed=1)
    mode = simulated.install(monkeypatch)
    try:
        tiers = Tiers("cpu", torch.float32, io_threads=1)
        tiers.reserve_staging(64 * 4)
        sources = [torch.arange(64, dtype=torch.float32) + 100 * i for i in range(3)]  # not pinned
        targets = [tiers.alloc("gpu", (64,)) for _ in sources]

        def copies():
            for dst, src in zip(targets, sources):
                tiers.to_device(dst, src)
        tiers.run_io(copies, None, "test copies").wait()
        for dst, src in zip(targets, sources):
            assert torch.equal(dst, src)
        tiers.close()
    finally:
        mode.__exit__(None, None, None)
    simulated.check()


def test_more_threads_than_staging_blocks_wait_for_one(monkeypatch):
    """Loads, stores and the compute thread may all stage at once: one more than there are blocks
    waits until a block comes back, and then gets it."""
    simulated = SimulatedCuda(seed=2)
    mode = simulated.install(monkeypatch)
    try:
        tiers = Tiers("cpu", torch.float32, io_threads=1)
        tiers.reserve_staging(64)
        copies = tiers.cuda
        held = [copies.stage((16,), torch.float32) for _ in range(copies.stage_count)]
        blocks = [h.__enter__() for h in held]
        got = []
        waiter = threading.Thread(target=lambda: got.append(copies.stage((16,), torch.float32).__enter__()))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not got, "a stager with no free block waits"
        held[0].__exit__(None, None, None)
        waiter.join(10)
        assert got and got[0].data_ptr() == blocks[0].data_ptr()
        tiers.close()
    finally:
        mode.__exit__(None, None, None)


def skip_stream_wait(monkeypatch):
    monkeypatch.setattr(CudaCopies, "_start", lambda copies, stream: torch.cuda.stream(stream))


def skip_copy_waits(monkeypatch):
    monkeypatch.setattr(CudaCopies, "_finish", lambda copies, stream, wait_now: None)


def skip_host_copy_wait(monkeypatch):
    monkeypatch.setattr(Copied, "wait", lambda copied: copied.tensors)


def skip_landed_wait(monkeypatch):
    monkeypatch.setattr(Landed, "wait", lambda landed: None)


@pytest.mark.parametrize("name,remove", [("mixed-act-cpu", skip_stream_wait), ("cache-disk-act-cpu-h2o", skip_copy_waits),
                                         ("cpu-cache-compute", skip_host_copy_wait), ("weights-cpu", skip_landed_wait),
                                         ("weights-disk-cache-cpu", skip_landed_wait)])
def test_the_simulated_device_catches_a_missing_wait(tiny_models, tmp_path, monkeypatch, name, remove):
    """The check can fail: with one wait taken out of the CUDA layer, the run is caught (an
    ordering violation, or tokens and scores that differ)."""
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, MATRIX[name], tmp_path)
    remove(monkeypatch)
    with pytest.raises(AssertionError):  # OrderingError is one
        out, _, _ = simulated_run(directory, MATRIX[name], tmp_path, monkeypatch)
        assert_same(reference, out)


class RowCopies:
    """cudaMemcpy2DAsync done at once, row by row (the simulated device's memory is host memory)."""

    def __init__(self):
        self.calls = 0

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert kind == cuda_io.CUDA_MEMCPY_DEVICE_TO_HOST
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        self.calls += 1
        return 0


def test_the_prompts_cache_goes_to_a_cpu_attended_home_as_one_pitched_copy(tiny_models, tmp_path, monkeypatch):
    """The first slots of every (sequence, head) of a home the CPU attends over are one strided
    DMA per K or V (cudaMemcpy2DAsync's rows and pitches), giving the CPU run's tokens."""
    directory, _ = tiny_models["wide"]
    reference = cpu_reference(directory, MATRIX["cpu-cache-compute"], tmp_path)
    runtime = RowCopies()
    monkeypatch.setattr(cuda_io, "cuda_runtime", lambda: runtime)
    out, _, _ = simulated_run(directory, MATRIX["cpu-cache-compute"], tmp_path, monkeypatch)
    assert_same(reference, out)
    assert runtime.calls > 0
