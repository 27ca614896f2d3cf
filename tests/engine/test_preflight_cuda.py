"""The pre-flight's CUDA terms, each pinned on a CPU: CUDA's own memory outside torch's allocator
counted once (after the context exists on a device, with it on a profile), cuBLAS's workspaces
inside the projection, the load stream's dequantizing workspace, a padded grouped-query prompt's
expanded K and V, and the wider staging of a CPU-attended cache."""

import pytest
import torch

from flexh2o.compression.gpu_dequant import WORKSPACE_BYTES
from flexh2o.kv.home import batch_split, cpu_attention_dtype
from flexh2o.engine.preflight import (CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, CUDA_LAZY_KERNELS_BYTES, GB, IO_THREADS,
                            capacities, prompt_copy_home_bytes, run_need)
from flexh2o.kv import slot_bytes, budget
from flexh2o.models.llama import PRESETS as LLAMA
from flexh2o.models.opt import PRESETS as OPT
from flexh2o.planning.search import caps_of
from flexh2o.engine.policy import Policy
from test_optimizer import gpu_profile

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def need(spec, policy, device, prompt_len=512, gen_len=32):
    return run_need(spec, policy, 2, prompt_len, gen_len, device)


def test_the_cuda_context_is_counted_once(monkeypatch):
    """On a device the free memory is read once the context exists: only the kernels loaded later
    are set aside. A profile's total has the context still in it."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GB, 16 * GB))
    assert capacities(CUDA, None)["gpu"] == 10 * GB - CUDA_LAZY_KERNELS_BYTES
    assert caps_of(gpu_profile(gpu_mem=16 * GB))["gpu"] == 16 * GB - CUDA_CONTEXT_BYTES - CUDA_LAZY_KERNELS_BYTES


def test_cublas_workspaces_are_in_the_projection():
    """Everything on the device: CUDA adds cuBLAS's workspaces (torch allocates them), nothing else."""
    policy = Policy(gpu_batch_size=8)
    spec = OPT["opt-1.3b"]
    assert need(spec, policy, CUDA)["gpu"] - need(spec, policy, CPU)["gpu"] == CUBLAS_WORKSPACE_BYTES


@pytest.mark.parametrize("weights", [(100, 0), (50, 50)])
def test_the_dequantizing_workspace_is_counted_once(weights):
    """Compressed weights are dequantized on the load stream at every load, resident or streamed: the
    torch path's one workspace (gpu_dequant.py); nothing on the CPU, which dequantizes on its own."""
    spec = OPT["opt-1.3b"]
    plain = Policy(gpu_batch_size=8, w_gpu_percent=weights[0], w_cpu_percent=weights[1])
    compressed = Policy(gpu_batch_size=8, w_gpu_percent=weights[0], w_cpu_percent=weights[1], compress_weight=True)
    assert need(spec, compressed, CUDA)["gpu"] - need(spec, plain, CUDA)["gpu"] == WORKSPACE_BYTES
    assert need(spec, compressed, CPU)["gpu"] == need(spec, plain, CPU)["gpu"]


def test_a_padded_grouped_query_prompt_expands_k_and_v():
    spec = next(s for s in LLAMA.values() if s.num_kv_heads < s.num_heads)
    b, s = 4, 256
    policy = Policy(gpu_batch_size=b)
    expanded = 2 * b * spec.num_heads * s * spec.head_dim * 2
    assert need(spec, policy, CUDA, s)["gpu"] - need(spec, policy, CPU, s)["gpu"] == CUBLAS_WORKSPACE_BYTES + expanded


def test_a_cpu_attended_cache_is_staged_as_wide_as_it_is_held():
    """Under cpu_cache_compute the prompt's K goes home in the CPU-attended cache's dtype (float32
    on a CPU without bfloat16 instructions): its pinned staging blocks are that wide."""
    spec = OPT["opt-1.3b"]
    b, prompt_len, gen_len = 8, 512, 32
    plain = Policy(gpu_batch_size=b, cache_gpu_percent=0, cache_cpu_percent=100)
    attended = Policy(gpu_batch_size=b, cache_gpu_percent=0, cache_cpu_percent=100, cpu_cache_compute=True)
    capacity, _ = budget(plain, prompt_len, gen_len)
    k_bytes = capacity * spec.num_kv_heads * slot_bytes(spec, plain, 2)
    wider = cpu_attention_dtype(torch.float16).itemsize // 2
    rows = batch_split(b, 0, 100)["cpu"]
    held_wider = rows * spec.num_layers * 2 * k_bytes * (wider - 1)  # the home itself
    stages = (IO_THREADS + 1) * rows * k_bytes * (wider - 1)
    assert need(spec, attended, CUDA)["cpu"] - need(spec, plain, CUDA)["cpu"] == held_wider + stages



def test_the_prompts_copy_home_holds_the_slots_kept():
    """The prompt's K or V goes home (CPU memory or disk) through one contiguous device copy per store
    thread: of every prompt slot, of an evicting policy's kept slots only, and none for a
    compressed cache (its groups go instead) or one held on the GPU."""
    spec = OPT["opt-1.3b"]
    b, prompt_len, gen_len = 8, 512, 32

    def copy(cache=(0, 100), **kwargs):
        policy = Policy(gpu_batch_size=b, cache_gpu_percent=cache[0], cache_cpu_percent=cache[1], **kwargs)
        return prompt_copy_home_bytes(spec, policy, 2, prompt_len, gen_len, CUDA)

    slot = spec.num_kv_heads * spec.head_dim * 2  # one slot of one sequence's K, float16
    assert copy() == IO_THREADS * b * prompt_len * slot
    kept = budget(Policy(hh_ratio=0.1), prompt_len, gen_len)[0]
    assert kept < prompt_len and copy(hh_ratio=0.1) == IO_THREADS * b * kept * slot
    assert copy(cache=(0, 0)) == copy()  # on disk, alike
    assert copy(cache=(100, 0)) == copy(compress_cache=True) == 0
    assert prompt_copy_home_bytes(spec, Policy(gpu_batch_size=b, cache_gpu_percent=0, cache_cpu_percent=100), 2,
                                  prompt_len, gen_len, CPU) == 0
