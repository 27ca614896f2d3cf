"""What every KV policy does: take the prompt's tokens, then place each new token in a slot.

The attention layer calls a policy twice per step (docs/design.md, "The KV cache"):
`prompt(...)` after the prompt's attention and `decode(...)` after each new token's attention,
handing it the attention logits and probabilities; the policy updates its per-slot state and
writes the token into the slot it chooses. Evicting policies share one rule and differ only in
`priority` (which older token is worth keeping) and, for some, how a step's attention adds to
a running score:

- keep the `window` newest positions (the new token included);
- keep the highest-priority older tokens up to `capacity`; evict the rest;
- padding is never kept; an empty slot is always filled before a token is evicted;
- among tokens of equal priority the older one (lower position) is evicted first.

Budgets are per sequence: given the ratios, a sequence of L real prompt tokens gets
int(hh_ratio * L) + int(recent_ratio * L) slots (at least one of each), whatever padding its
batch gives it, so a prompt keeps the same tokens in any batch as it does alone. The cache is
allocated for the batch's longest prompt; a shorter sequence's slots past its own budget are
marked UNUSED at the prompt step and are never filled or attended.
"""

import torch

INF = float("inf")
EMPTY, UNUSED = -1, -2  # a slot's position when it holds no token: not yet filled / beyond the budget


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
    """Index of the lowest priority along the last dim, never an UNUSED slot; of equal ones, the
    oldest (lowest pos)."""
    usable = pos != UNUSED
    tied = (pri == pri.masked_fill(~usable, INF).amin(-1, keepdim=True)) & usable
    return pos.masked_fill(~tied, torch.iinfo(pos.dtype).max).argmin(-1)


def row_budgets(real_len, hh_ratio: float, recent_ratio: float, capacity: int):
    """Slots and recent window [b] of sequences with real_len [b] prompt tokens (float64, as Python's
    int(ratio * L)), at most `capacity` slots."""
    length = real_len.double()
    heavy = (length * hh_ratio).floor().long().clamp_(min=1)
    recent = (length * recent_ratio).floor().long().clamp_(min=1)
    return (heavy + recent).clamp_(max=capacity), recent


def decode_coordinates(cache, pos, logits) -> tuple:
    """Where a decode step's logits [b, heads, 1, capacity + 1] sit (Evicting.contribution's at()):
    each slot's token, then the new one at pos [b, 1]."""
    b, heads = logits.shape[:2]
    new = pos.to(cache.pos.device, cache.pos.dtype).view(b, 1, 1).expand(b, cache.pos.shape[1], 1)
    keys = torch.cat([cache.pos, new], dim=-1)
    keys = keys.repeat_interleave(heads // keys.shape[1], dim=1).unsqueeze(2)  # [b, heads, 1, capacity + 1]
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(heads).view(1, heads, 1, 1),
            pos[:, :1].view(b, 1, 1, 1), keys)


class FullCache:
    """Keeps every token: capacity prompt_len + gen_len, each new token in the next free slot."""

    name = "full"
    accumulates = False     # keeps no per-slot score
    uses_attention = False  # needs no attention probabilities (the prompt may run fused)
    appends = True          # a new token never evicts: it can be stored before the step attends

    def __init__(self, capacity: int, recent: int, gen_len: int, seed: int, ratios: tuple | None = None):
        """Every policy takes the same arguments: slots, recent window, tokens to generate, seed, and
        the (hh_ratio, recent_ratio) each sequence's own budget comes from (None: every sequence
        has `capacity` and `recent`)."""
        self.capacity, self.recent, self.gen_len, self.seed, self.ratios = capacity, recent, gen_len, seed, ratios

    def prompt(self, cache, k, v, pos, contribution, step):
        cache.fill_prompt(k, v, pos)

    def decode(self, cache, k, v, pos, logits, probs, step):
        if step.row_slots is not None:  # slots refilled: each sequence's new token at its own slot
            slots = step.row_slots
            if slots.device != cache.pos.device:  # (no copy at all where it is there: a CUDA graph captures this)
                slots = slots.to(cache.pos.device)
            cache.put(slots[:, None].expand(-1, k.shape[1]).contiguous(), k, v, pos)
            cache.length = max(cache.length, step.fill)
            return
        cache.append(k, v, pos, None if step.slot is None or cache.cpu_attended else (step.slot, step.slot_index))


class Evicting(FullCache):
    """Base of the policies that hold a fixed budget: `capacity` slots per sequence and KV head."""

    uses_attention = True
    appends = False

    # -- what a policy defines -------------------------------------------------------------
    def contribution(self, logits, probs, real_rows, step, at=None):
        """What this step's attention gives each key: logits and probs [..., q, n] -> [..., n].
        real_rows [..., q, 1] is 1 at real query rows, 0 at padding (None: every row is real).
        at(): where each logit sits, (sequence, query head, query position, key position), int
        tensors that broadcast to the logits' shape (None: their indices)."""
        return (probs if real_rows is None else probs * real_rows).sum(-2)

    def priority(self, pos, score, current):
        """Keep-worthiness of each held token, higher = kept: pos and score are the slots' state,
        current this step's contribution (all [b, kv_heads, n])."""
        raise NotImplementedError

    def always_kept(self, capacity, recent):
        """(newest, first) positions kept whatever their priority, [b] each, from a sequence's slots
        and recent budget: the recent window, and no first tokens (attention sinks keep some)."""
        return recent, torch.zeros_like(recent)

    # -- the shared rule --------------------------------------------------------------------
    def budgets(self, real_len):
        """Slots, newest and first positions always kept, [b] each, of sequences with real_len [b]
        prompt tokens."""
        if self.ratios is None:
            capacity, recent = torch.full_like(real_len, self.capacity), torch.full_like(real_len, self.recent)
        else:
            capacity, recent = row_budgets(real_len, *self.ratios, self.capacity)
        return (capacity, *self.always_kept(capacity, recent))

    def ranked(self, pri, pos, newest, window, first):
        """pri with the positions always kept at +inf, then empty slots and padding at -inf."""
        keep = (pos > newest - window[:, None, None]) | (pos < first[:, None, None])
        return pri.masked_fill(keep, INF).masked_fill_(pos < 0, -INF)

    def prompt(self, cache, k, v, pos, contribution, step):
        """k, v [b, kv_heads, s, d]; pos [b, kv_heads, s] (-1 at padding); contribution [b, kv_heads, s].
        Each sequence keeps at most its own budget of tokens, stored in position order."""
        score = contribution if self.accumulates else None
        capacity, window, first = self.budgets((pos[:, 0] >= 0).sum(-1))
        if pos.shape[-1] <= cache.capacity and bool((capacity == cache.capacity).all()):
            cache.fill_prompt(k, v, pos, score)
        else:
            pri = self.ranked(self.priority(pos, contribution, contribution), pos, pos.amax(-1, keepdim=True),
                              window, first)
            keep = highest(pri, pos, min(cache.capacity, pos.shape[-1]))
            kept_pos = pos.gather(-1, keep)
            ranks = torch.arange(keep.shape[-1], device=pos.device)
            kept = (ranks < capacity[:, None, None]) & (kept_pos >= 0)
            # Position order, so that a sequence's slots hold the same tokens in the same order in any batch.
            order = kept_pos.masked_fill(~kept, torch.iinfo(pos.dtype).max).argsort(-1)
            keep, kept = keep.gather(-1, order), kept.gather(-1, order)
            index = keep.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
            cache.fill_prompt(k.gather(2, index), v.gather(2, index), pos.gather(-1, keep).masked_fill(~kept, EMPTY),
                              None if score is None else score.gather(-1, keep).masked_fill(~kept, 0), usable=capacity)
        cache.length = cache.capacity

    def decode(self, cache, k, v, pos, logits, probs, step):
        """The new token (k, v [b, kv_heads, 1, d], position pos [b, 1]) replaces the held token of
        least priority not always kept, or fills an empty slot."""
        held = new = None
        if self.uses_attention:
            at = lambda: decode_coordinates(cache, pos, logits)  # noqa: E731
            current = per_kv_head(self.contribution(logits, probs, None, step, at), k.shape[1])
            held, new = current[..., :-1], current[..., -1]
        if self.accumulates:
            cache.score.add_(held)
        # Decode step i puts the new token at position L + i - 1, L the sequence's real prompt tokens
        # (without ratios every sequence has the same budget and the step is not needed).
        real_len = pos[:, 0].long() - (0 if self.ratios is None else step.generated_before(pos.device))
        _, window, first = self.budgets(real_len)
        pri = self.ranked(self.priority(cache.pos, cache.score, held), cache.pos, pos[:, :, None], window, first)
        cache.put(lowest(pri, cache.pos), k, v, pos, new if self.accumulates else None)
