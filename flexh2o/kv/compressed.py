"""A KV cache held as 4-bit groups (quant.py) where the compute device attends over it in place.

K and V are stored slot-major, [capacity, batch, kv_heads, packed_width(head_dim)] uint8, like
every compressed home (kv/home.py); positions and scores stay exact, as in KVCache, so the
policies work on it unchanged. Writes quantize only what they store: the prompt's tokens once,
then one slot per (sequence, KV head) per decode step. Attention dequantizes the filled slots a
block at a time (`blocks`), so no dequantized copy of the whole cache ever exists.
"""

import time

import torch

from flexh2o.compression.quant import dequantize, packed_width, quantize
from flexh2o.kv.cache import KVCache

# Values of K or V dequantized (or quantized) at once. A CPU's block stays in its caches; a GPU
# launches a few kernels per block, and at 1M values a large cache took ~1.5k launches per layer
# per decode step.
BLOCK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 24}
WORKING_BYTES_PER_VALUE = 12  # the float32 working copies a block takes, at most


def block_values(device) -> int:
    return BLOCK_VALUES["cuda" if torch.device(device).type == "cuda" else "cpu"]


def working_bytes(device) -> int:
    return WORKING_BYTES_PER_VALUE * block_values(device)


def slots_per_block(b: int, kv_heads: int, head_dim: int, device) -> int:
    """Slots of K or V [b, kv_heads, slots, head_dim] that make up one block on `device`."""
    return max(1, block_values(device) // (b * kv_heads * head_dim))


def quantize_slot_major(src: torch.Tensor, dst: torch.Tensor):
    """dst[:s] <- the groups of src [b, kv_heads, s, d], slot-major ([s, b, kv_heads, width]), a
    block at a time so that quantize's float32 copies stay small."""
    b, kv_heads, s, d = src.shape
    step = slots_per_block(b, kv_heads, d, src.device)
    for start in range(0, s, step):
        stop = min(start + step, s)
        dst[start:stop] = quantize(src[:, :, start:stop], check=False).permute(2, 0, 1, 3)


class CompressedKVCache(KVCache):
    clock = None
    lossless = False
    # On CUDA attention dequantizes every slot, the empty ones too (zeros, masked): the same blocks
    # at every step, where the filled ones would give a new last block shape per cache length.
    every_slot = False

    def __init__(self, k, v, pos, score, head_dim: int, length: int = 0):
        super().__init__(k, v, pos, score, length)
        self.capacity, self.head_dim = k.shape[0], head_dim

    @classmethod
    def allocate(cls, tiers, batch, kv_heads, head_dim, capacity, with_score: bool, tier: str = "gpu", dtype=None):
        shape = (capacity, batch, kv_heads, packed_width(head_dim))
        pos, score = cls.allocate_state(tiers, batch, kv_heads, capacity, with_score, tier)
        # Zeroed: all-zero groups are zeros (a policy may count slots no token has filled yet as in
        # use, and attention multiplies their V by probability 0; garbage could be NaN there).
        k, v = (tiers.alloc(tier, shape, torch.uint8, zero=True) for _ in "kv")
        cache = cls(k, v, pos, score, head_dim)
        cache.clock = tiers  # counts the time spent dequantizing
        cache.every_slot = tiers.on_cuda and tier == "gpu"
        return cache

    def rows(self, start: int, stop: int) -> "CompressedKVCache":
        view = CompressedKVCache(self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop],
                                 None if self.score is None else self.score[start:stop], self.head_dim, self.length)
        view.clock, view.every_slot, view.cpu_attended = self.clock, self.every_slot, self.cpu_attended
        return view

    def store_first(self, k, v):
        quantize_slot_major(k, self.k)
        quantize_slot_major(v, self.v)

    def store_slot(self, t, k, v):
        self.k[t] = quantize(k, check=False)
        self.v[t] = quantize(v, check=False)

    def store_through(self, slot, k, v):
        self.k.index_copy_(0, slot, quantize(k, check=False).unsqueeze(0))
        self.v.index_copy_(0, slot, quantize(v, check=False).unsqueeze(0))

    def store_at(self, seq, head, slots, k, v):
        self.k[slots, seq, head] = quantize(k, check=False)
        self.v[slots, seq, head] = quantize(v, check=False)

    def blocks(self, which: str, dtype: torch.dtype):
        """(start, stop, values [b, kv_heads, stop - start, head_dim]) over the filled slots of K or V
        (every slot where every_slot)."""
        groups = self.k if which == "k" else self.v
        _, b, kv_heads, _ = groups.shape
        step = slots_per_block(b, kv_heads, self.head_dim, groups.device)
        filled = self.capacity if self.every_slot else self.length
        for start in range(0, filled, step):
            stop = min(start + step, filled)
            began = time.perf_counter()
            values = torch.empty(b, kv_heads, stop - start, self.head_dim, dtype=dtype, device=groups.device)
            dequantize(groups[start:stop], self.head_dim, values.permute(2, 0, 1, 3))
            if self.clock is not None:
                self.clock.count_dequant(time.perf_counter() - began)
            yield start, stop, values
