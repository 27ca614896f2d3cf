"""Attention sinks (StreamingLLM, Xiao et al. 2023): the first 4 tokens stay, the rest is the
newest tokens."""

from flexh2o.kv.eviction import Evicting

SINKS = 4


class AttentionSinks(Evicting):
    name = "sink"
    uses_attention = False

    def always_kept(self, capacity, recent):
        # Positions are absolute and start at 0 at each sequence's first real token.
        sinks = (capacity - 1).clamp(max=SINKS)  # at least the new token is kept
        return capacity - sinks, sinks

    def priority(self, pos, score, current):
        return pos.float()
