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
