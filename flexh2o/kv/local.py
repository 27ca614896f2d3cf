"""Local window: keep only the newest `capacity` tokens."""

from .eviction import Evicting


class LocalWindow(Evicting):
    name = "local"
    uses_attention = False

    def __init__(self, capacity: int, window: int, gen_len: int, seed: int):
        super().__init__(capacity, capacity, gen_len, seed)

    def priority(self, pos, score, current):
        return pos.float()
