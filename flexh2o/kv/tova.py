"""TOVA (Oren et al. 2024): evict, per head, the held token the current query attends to least.
Only the new token itself is sure to stay (a window of one)."""

import torch

from flexh2o.kv.eviction import Evicting


class TokenOmission(Evicting):
    name = "tova"

    def always_kept(self, capacity, recent):
        return torch.ones_like(capacity), torch.zeros_like(capacity)

    def contribution(self, logits, probs, real_rows, step, at=None):
        return probs[..., -1, :]  # the current query: the prompt's last row, or the new token's row

    def priority(self, pos, score, current):
        return current
