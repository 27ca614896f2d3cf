"""What every KV policy does: take the prompt's tokens, then place each new token in a slot.

The attention layer calls a policy twice per step (DESIGN.md, "KV cache slots and eviction"):
`prompt(...)` after the prompt's attention and `decode(...)` after each new token's attention,
handing it the attention logits and probabilities; the policy updates its per-slot state and
writes the token into the slot it chooses. Evicting policies share one rule and differ only in
`priority` (which older token is worth keeping) and, for some, how a step's attention adds to
a running score:

- keep the `window` newest positions (the new token included);
- keep the highest-priority older tokens up to `capacity`; evict the rest;
- padding is never kept; an empty slot is always filled before a token is evicted;
- among tokens of equal priority the older one (lower position) is evicted first.
"""

import torch

INF = float("inf")


def per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, ..., n] -> [b, kv_heads, ..., n], summing the query heads of each group."""
    b, heads = x.shape[:2]
    if heads == kv_heads:
        return x
    return x.view(b, kv_heads, heads // kv_heads, *x.shape[2:]).sum(2)


def highest(pri, pos, n: int):
    """Indices of the n highest priorities along the last dim; of equal ones, the newer (higher pos) first."""
    newest_first = pos.argsort(dim=-1, descending=True)
    ranked = pri.gather(-1, newest_first).sort(dim=-1, descending=True, stable=True).indices
    return newest_first.gather(-1, ranked[..., :n])


def lowest(pri, pos):
    """Index of the lowest priority along the last dim; of equal ones, the oldest (lowest pos)."""
    tied = pri == pri.amin(-1, keepdim=True)
    return pos.masked_fill(~tied, torch.iinfo(pos.dtype).max).argmin(-1)


class FullCache:
    """Keeps every token: capacity prompt_len + gen_len, each new token in the next free slot."""

    name = "full"
    accumulates = False     # keeps no per-slot score
    uses_attention = False  # needs no attention probabilities (the prompt may run fused)
    appends = True          # a new token never evicts: it can be stored before the step attends

    def __init__(self, capacity: int, window: int, gen_len: int, seed: int):
        """Every policy takes the same arguments: slots, recent window, tokens to generate, seed."""
        self.capacity, self.window, self.gen_len, self.seed = capacity, window, gen_len, seed

    def prompt(self, cache, k, v, pos, contribution, step):
        cache.fill_prompt(k, v, pos)

    def decode(self, cache, k, v, pos, logits, probs, step):
        cache.append(k, v, pos)


class Evicting(FullCache):
    """Base of the policies that hold a fixed budget: `capacity` slots per sequence and KV head."""

    uses_attention = True
    appends = False

    # -- what a policy defines -------------------------------------------------------------
    def contribution(self, logits, probs, real_rows, step):
        """What this step's attention gives each key: logits and probs [..., q, n] -> [..., n].
        real_rows [..., q, 1] is 1 at real query rows, 0 at padding (None: every row is real)."""
        return (probs if real_rows is None else probs * real_rows).sum(-2)

    def priority(self, pos, score, current):
        """Keep-worthiness of each held token, higher = kept: pos and score are the slots' state,
        current this step's contribution (all [b, kv_heads, n])."""
        raise NotImplementedError

    # -- the shared rule --------------------------------------------------------------------
    def prompt(self, cache, k, v, pos, contribution, step):
        """k, v [b, kv_heads, s, d]; pos [b, kv_heads, s] (-1 at padding); contribution [b, kv_heads, s]."""
        score = contribution if self.accumulates else None
        keep = None
        if pos.shape[-1] > cache.capacity:
            newest = pos.amax(-1, keepdim=True)
            pri = self.priority(pos, contribution, contribution)
            pri = pri.masked_fill(pos > newest - self.window, INF).masked_fill(pos < 0, -INF)
            keep = highest(pri, pos, cache.capacity)
        cache.fill_prompt(k, v, pos, score, keep)
        cache.length = cache.capacity

    def decode(self, cache, k, v, pos, logits, probs, step):
        """The new token (k, v [b, kv_heads, 1, d], position pos [b, 1]) replaces the held token of
        least priority outside the window, or fills an empty slot."""
        held = new = None
        if self.uses_attention:
            current = per_kv_head(self.contribution(logits, probs, None, step), k.shape[1])
            held, new = current[..., :-1], current[..., -1]
        if self.accumulates:
            cache.score.add_(held)
        pri = self.priority(cache.pos, cache.score, held)
        in_window = cache.pos > (pos - self.window).to(cache.pos.dtype)[:, :, None]
        pri = pri.masked_fill(in_window, INF).masked_fill_(cache.pos < 0, -INF)
        cache.put(lowest(pri, cache.pos), k, v, pos, new if self.accumulates else None)
