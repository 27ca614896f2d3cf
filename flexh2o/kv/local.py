"""Local window: keep only the newest `capacity` tokens."""

import torch

from flexh2o.kv.eviction import Evicting


class LocalWindow(Evicting):
    name = "local"
    uses_attention = False

    def always_kept(self, capacity, recent):
        return capacity, torch.zeros_like(capacity)

    def priority(self, pos, score, current):
        return pos.float()
