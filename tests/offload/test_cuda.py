"""The CUDA layer (side stream, pinned staging, cpu_cache_compute) gives the CPU's output.
Skipped on machines without CUDA."""

import pytest
import torch

from flexh2o import Engine, Policy
from conftest import padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("weights,cache,act,cpu_cache_compute", [
    ((100, 0), (100, 0), "gpu", False),
    ((30, 40), (34, 33), "cpu", False),
    ((0, 50), (0, 100), "gpu", True),
    ((20, 0), (50, 50), "cpu", True),
])
def test_cuda_placements_match_the_cpu(tiny_models, tmp_path, weights, cache, act, cpu_cache_compute):
    directory, _ = tiny_models["wide"]
    ids, mask = padded_batch(6, 10, pads=[0, 1, 2, 3, 4, 5], seed=8)

    def run(device, policy):
        with Engine.from_pretrained(directory, policy=policy, device=device, dtype=torch.float32,
                                    offload_dir=str(tmp_path)) as engine:
            return engine.generate(ids, mask, max_new_tokens=6, output_scores=True, eos_token_id=None)

    cpu = run("cpu", Policy(gpu_batch_size=2, num_gpu_batches=3))
    cuda = run("cuda", Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=weights[0], w_cpu_percent=weights[1],
                              cache_gpu_percent=cache[0], cache_cpu_percent=cache[1],
                              act_gpu_percent=100 if act == "gpu" else 0, act_cpu_percent=100 if act == "cpu" else 0,
                              cpu_cache_compute=cpu_cache_compute))
    assert torch.equal(cpu.sequences, cuda.sequences)
    for a, b in zip(cpu.scores, cuda.scores):
        assert torch.allclose(a, b, atol=1e-3, rtol=0)


@pytest.mark.parametrize("weights,cache", [((30, 40), (34, 33)), ((0, 0), (0, 0)), ((0, 100), (0, 100))])
def test_compressed_cuda_placements_match_compressed_cuda_on_the_gpu(tiny_models, tmp_path, weights, cache):
    """Groups moved to the GPU and dequantized on its load stream give what the same run gives with
    everything on the GPU. Compared with CUDA, not with the CPU: the CPU's BLAS and cuBLAS differ by
    1e-7..1e-6, enough to flip a K/V value on a 4-bit rounding boundary to the next code; between
    CUDA placements the values quantized come from the same kernels."""
    directory, _ = tiny_models["wide"]
    ids, mask = padded_batch(6, 10, pads=[0, 1, 2, 3, 4, 5], seed=8)

    def run(device, w, c):
        policy = Policy(2, 3, *w, *c, hh_ratio=0.3, compress_weight=True, compress_cache=True)
        with Engine.from_pretrained(directory, policy=policy, device=device, dtype=torch.float32,
                                    offload_dir=str(tmp_path)) as engine:
            out = engine.generate(ids, mask, max_new_tokens=6, output_scores=True, eos_token_id=None)
            assert engine.last_stats.step_allocations[2:] == [0] * 4
            return out

    on_gpu, placed = run("cuda", (100, 0), (100, 0)), run("cuda", weights, cache)
    assert torch.equal(on_gpu.sequences, placed.sequences)
    for a, b in zip(on_gpu.scores, placed.scores):
        assert torch.allclose(a, b, atol=1e-3, rtol=0)


def test_the_compute_device_has_one_identity(tiny_models):
    directory, _ = tiny_models["tiny"]
    with Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=2), device="cuda",
                                dtype=torch.float32) as engine:
        assert engine.tiers.compute == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("cache,act,cpu_cache_compute", [((0, 100), "cpu", False), ((0, 0), "cpu", False),
                                                         ((34, 33), "gpu", True)])
def test_no_allocation_after_the_first_decode_step_on_cuda(tiny_models, tmp_path, cache, act, cpu_cache_compute):
    """Our pool stops growing after the first decode step, and the allocator's peak does not grow
    with gen_len when the cache has a fixed budget."""
    directory, _ = tiny_models["wide"]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=20, w_cpu_percent=40,
                    cache_gpu_percent=cache[0], cache_cpu_percent=cache[1],
                    act_gpu_percent=100 if act == "gpu" else 0, act_cpu_percent=100 if act == "cpu" else 0,
                    cpu_cache_compute=cpu_cache_compute, hh_ratio=0.2)
    ids, mask = padded_batch(6, 20, pads=[0, 1, 2, 3, 4, 5], seed=8)
    peaks = []
    with Engine.from_pretrained(directory, policy=policy, device="cuda", dtype=torch.float16,
                                offload_dir=str(tmp_path)) as engine:
        for new in (4, 12):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            engine.generate(ids, mask, max_new_tokens=new, eos_token_id=None)
            assert engine.last_stats.step_allocations[2:] == [0] * (new - 2)
            peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] <= peaks[0] * 1.01 + (1 << 20), peaks


def test_keyformer_noise_is_the_same_on_the_gpu_as_on_the_cpu():
    """A cache split between CPU and GPU attends on both: a logit's noise follows where it sits, not
    the device (int64 products wrap alike on both)."""
    from flexh2o.kv.keyformer import hashed_uniforms
    keys = (123456789, torch.arange(8).view(-1, 1, 1), torch.arange(4).view(1, -1, 1), torch.arange(512))
    assert torch.equal(hashed_uniforms(keys, "cuda").cpu(), hashed_uniforms(keys, "cpu"))
