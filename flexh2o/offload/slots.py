"""One slot picked per (sequence, KV head) of a cache laid out [b, kv_heads, capacity, ...]."""

import torch


def slot_grid(slots):
    """Sequence and head indices [b, 1], [1, kv_heads] that, with slots [b, kv_heads], pick one slot each."""
    b, kv_heads = slots.shape
    return torch.arange(b, device=slots.device)[:, None], torch.arange(kv_heads, device=slots.device)[None, :]
