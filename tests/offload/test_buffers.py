"""The buffer pool's bookkeeping of page-locked host memory (filled by cudaHostRegister on CUDA;
here the ranges are noted by hand)."""

import torch

from flexh2o.offload.buffers import Buffers
from flexh2o.offload.cuda_io import pitched_rows


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
    grid = memory[:1200].view(30, 40)
    assert pool.is_pinned(grid[:25, :20])  # a view spans to its last element (24 * 40 + 19): inside
    assert not pool.is_pinned(grid[:26, :20])  # 25 * 40 + 19 is past the range, though it holds 520 bytes
    assert pool.pinned_bytes() == 1500
    pool.free("cpu", [memory[2000:2500]])
    assert not pool.is_pinned(memory[2100:2500]) and pool.is_pinned(memory[:1000])
    pool._registered.clear()  # nothing was really registered: nothing to unregister at exit


def test_pitched_rows_describe_views_that_one_strided_copy_can_fill():
    cache = torch.empty(2, 3, 10, 4)  # [batch, heads, capacity, head_dim]
    assert pitched_rows(cache[:, :, :5]) == (6, 5 * 4 * 4, 10 * 4 * 4)  # the first 5 slots of every (batch, head)
    assert pitched_rows(cache[:, :2]) == (2, 2 * 10 * 4 * 4, 3 * 10 * 4 * 4)
    assert pitched_rows(cache[1:, :1, :7]) == (1, 7 * 4 * 4, 7 * 4 * 4)  # sizes of one are not rows
    assert pitched_rows(cache[:, :2, :5]) is None  # two pitches: heads within a batch, and batches
    assert pitched_rows(torch.empty(4, 5).t()) is None
    assert pitched_rows(torch.empty(1, 5).expand(3, 5)) is None  # rows that overlap
