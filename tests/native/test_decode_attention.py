"""native/attention.c: a decode step's attention over each sequence's own filled slots, as accurate
as PyTorch's fused kernel, and each sequence's result the same whatever else is in its batch."""

import pytest
import torch
import torch.nn.functional as F

from flexh2o import native
from flexh2o.kv.cache import KVCache
from flexh2o.models.attention import attend_filled, attend_own_slots

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


def cache_of(b, kv_heads, capacity, d, lengths, holes=(), seed=0) -> KVCache:
    """Sequence r's slots [0, lengths[r]) filled, but for the (row, slot) pairs in holes (padding)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, kv_heads, capacity, d, generator=g), torch.randn(b, kv_heads, capacity, d, generator=g)
    pos = torch.arange(capacity, dtype=torch.int32).repeat(b, kv_heads, 1)
    pos[torch.arange(capacity).expand(b, kv_heads, capacity) >= torch.tensor(lengths)[:, None, None]] = -1
    for row, slot in holes:
        pos[row, :, slot] = -1
    return KVCache(k, v, pos, length=max(lengths))


def by_float64(q, cache, scale):
    n = cache.length
    mask = cache.pos[:, :1, None, :n] >= 0
    return F.scaled_dot_product_attention(q.double(), cache.k[:, :, :n].double(), cache.v[:, :, :n].double(),
                                          attn_mask=mask, scale=scale, enable_gqa=True)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 16), (9, 3, 64), (8, 2, 128)])
def test_as_accurate_as_pytorchs_fused_attention(heads, kv_heads, d):
    lengths = [1, 37, 200, 5, 64, 129]
    cache = cache_of(len(lengths), kv_heads, 256, d, lengths, holes=[(2, 0), (2, 1), (4, 30)])
    q = torch.randn(len(lengths), heads, 1, d, generator=torch.Generator().manual_seed(1))
    want = by_float64(q, cache, d ** -0.5)
    ours = attend_own_slots(q, cache, d ** -0.5)
    n = cache.length
    fused = F.scaled_dot_product_attention(q, cache.k[:, :, :n], cache.v[:, :, :n], attn_mask=cache.pos[:, :1, None, :n] >= 0,
                                           scale=d ** -0.5, enable_gqa=True)
    assert ours is not None and ours.shape == q.shape
    assert (ours.double() - want).abs().max() <= 4 * max((fused.double() - want).abs().max(), 1e-7)


@needs_kernels
def test_a_sequences_result_does_not_depend_on_its_batch():
    lengths = [300, 12, 77, 150]
    cache = cache_of(4, 2, 320, 32, lengths, seed=3)
    q = torch.randn(4, 6, 1, 32, generator=torch.Generator().manual_seed(4))
    together = attend_own_slots(q, cache, 0.2)
    for r in range(4):
        alone = KVCache(*(t[r: r + 1].clone() for t in (cache.k, cache.v, cache.pos)), length=lengths[r])
        assert torch.equal(attend_own_slots(q[r: r + 1], alone, 0.2), together[r: r + 1])


def test_other_widths_and_no_kernels_keep_pytorchs_attention(monkeypatch):
    cache = cache_of(2, 2, 16, 8, [3, 9])
    q = torch.randn(2, 4, 1, 8)
    assert attend_own_slots(q.double(), KVCache(cache.k.double(), cache.v.double(), cache.pos, length=9), 1.0) is None
    monkeypatch.setenv("FLEXH2O_NATIVE", "0")
    assert attend_own_slots(q, cache, 1.0) is None
    assert torch.allclose(attend_filled(q, cache, 1.0, padded=True).double(), by_float64(q, cache, 1.0), atol=1e-6)


@needs_kernels
def test_queries_read_where_a_layers_product_left_them():
    """A decode step's q is a view of the fused q, k, v product (each sequence's heads side by side,
    sequences a row apart): taken as it lies, the same result as from a contiguous copy."""
    b, heads, kv_heads, d = 3, 6, 2, 32
    cache = cache_of(b, kv_heads, 40, d, [40, 7, 19], seed=7)
    qkv = torch.randn(b, 1, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(8))
    q = qkv.view(b, 1, heads + 2 * kv_heads, d).transpose(1, 2)[:, :heads]
    assert not q.is_contiguous()
    assert torch.equal(attend_own_slots(q, cache, 0.3), attend_own_slots(q.contiguous(), cache, 0.3))


@needs_kernels
def test_a_new_token_is_stored_as_torchs_indexing_stores_it(monkeypatch):
    """KVCache.append's one C call writes what its torch operations write, from K and V views of a
    layer's product."""
    b, kv_heads, d, capacity = 3, 2, 16, 10
    k_new, v_new = (torch.randn(b, 1, 3 * kv_heads * d).view(b, 1, 3 * kv_heads, d).transpose(1, 2)[:, i * kv_heads:
                    (i + 1) * kv_heads] for i in (1, 2))
    pos = torch.tensor([[7], [4], [9]])
    caches = [cache_of(b, kv_heads, capacity, d, [5, 5, 5], seed=9) for _ in range(2)]
    assert caches[0].append_natively(5, k_new, v_new, pos)
    monkeypatch.setattr(KVCache, "append_natively", lambda *args: False)
    caches[1].append(k_new, v_new, pos)
    for a, b_ in zip(caches[0].tensors(), caches[1].tensors()):
        assert torch.equal(a, b_)
