"""The buffer pool's bookkeeping of page-locked host memory (filled by cudaHostRegister on CUDA;
here the ranges are noted by hand)."""

import torch

from flexh2o.buffers import Buffers


def test_a_tensor_is_pinned_when_it_lies_whole_in_a_registered_range():
    pool = Buffers("cpu", torch.float32)
    memory = torch.empty(3000, dtype=torch.uint8)
    base = memory.data_ptr()
    pool.note_pinned(base, 1000)
    pool.note_pinned(base + 2000, 500, registered=False)  # torch's pinned allocator's, after a failed register
    assert pool.is_pinned(memory[:1000]) and pool.is_pinned(memory[10:20]) and pool.is_pinned(memory[2100:2500])
    assert not pool.is_pinned(memory[990:1010])   # runs past the end of its range
    assert not pool.is_pinned(memory[1500:1600])  # between the ranges
    assert not pool.is_pinned(memory[2400:2600])
    assert not pool.is_pinned(torch.empty(10))
    assert pool.pinned_bytes() == 1500
    pool.free("cpu", [memory[2000:2500]])
    assert not pool.is_pinned(memory[2100:2500]) and pool.is_pinned(memory[:1000])
    pool._registered.clear()  # nothing was really registered: nothing to unregister at exit
