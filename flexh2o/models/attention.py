"""Attention over the KV slots: where an eviction policy will see the probabilities.

The prompt step uses PyTorch's fused attention. A decode step attends over every slot of the
preallocated cache with a mask of the filled ones: the slots are one contiguous block, which on a
CPU is several times faster than a strided view of the filled part.
"""

import torch
import torch.nn.functional as F


def prompt_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q, k, v [b, heads, s, d]; mask bool [b, 1, s, s] (True = may attend), None for plain causal."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def decode_attention(q, k, v, valid, scale: float) -> torch.Tensor:
    """q [b, heads, 1, d] against all slots k, v [b, heads, capacity, d]; valid bool [b, capacity]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
