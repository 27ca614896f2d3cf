"""The KV cache of one (layer, gpu-batch): slots preallocated once, never grown by concatenation."""

import torch


class KVCache:
    """K and V as [batch, kv_heads, capacity, head_dim]; `valid` marks slots holding a real token.

    The prompt fills slots 0..prompt_len-1 (padding slots stay invalid); each decode step writes
    its token into the next free slot. Slots start zeroed: attention runs over all of them with
    the invalid ones masked, and garbage there could turn 0 * NaN into NaN.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, length: int = 0):
        self.k, self.v, self.valid = k, v, valid
        self.capacity = k.shape[2]
        self.length = length

    @classmethod
    def allocate(cls, tiers, batch: int, kv_heads: int, head_dim: int, capacity: int, tier: str = "gpu"):
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(tiers.alloc(tier, shape, zero=True), tiers.alloc(tier, shape, zero=True),
                   tiers.alloc(tier, (batch, capacity), dtype=torch.bool, zero=True))

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor):
        s = k.shape[2]
        if s > self.capacity:
            raise ValueError(f"prompt of {s} tokens exceeds the cache's {self.capacity} slots")
        self.k[:, :, :s] = k
        self.v[:, :, :s] = v
        self.valid[:, :s] = key_valid
        self.length = s

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Writes one new token per sequence into the next free slot."""
        t = self.length
        if t >= self.capacity:
            raise ValueError(f"KV cache full: {self.capacity} slots")
        self.k[:, :, t] = k[:, :, 0]
        self.v[:, :, t] = v[:, :, 0]
        self.valid[:, t] = True
        self.length = t + 1
