"""Attention sinks (StreamingLLM, Xiao et al. 2023): the first 4 tokens stay, the rest is the
newest tokens."""

from .eviction import Evicting

SINKS = 4


class AttentionSinks(Evicting):
    name = "sink"
    uses_attention = False

    def __init__(self, capacity: int, window: int, gen_len: int, seed: int):
        self.sinks = min(SINKS, capacity - 1)  # at least the new token is kept
        super().__init__(capacity, capacity - self.sinks, gen_len, seed)

    def priority(self, pos, score, current):
        # Positions are absolute and start at 0 at each sequence's first real token.
        return pos.float().masked_fill(pos < self.sinks, float(1 << 30))
