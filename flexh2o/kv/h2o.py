"""H2O (Zhang et al. 2023): keep the recent window and the heavy hitters, the older tokens that
have received the most attention so far (docs/design.md, "H2O and the other policies")."""

from flexh2o.kv.eviction import Evicting


class HeavyHitters(Evicting):
    name = "h2o"
    accumulates = True

    def priority(self, pos, score, current):
        return score
