"""Keyformer (Adnan et al. 2024): H2O's accumulation with a noisy score. Each step adds the
softmax of (attention logits + Gumbel noise) / tau, with tau rising linearly from 1 at the prompt
to 2 at the last generated token. The attention output itself uses the clean probabilities.

A logit's noise is a hash of where it sits: the layer's seed, its sequence's seed, the query head,
the query's and the key's positions. A sequence so gets the same noise in any batch, on any device
or with its cache split across several, and when it joins a running batch (slot_pool.py): its
record's result equals its result alone."""

import torch

from flexh2o.kv.eviction import Evicting


def _int64(c: int) -> int:
    """A 64-bit constant as the signed value an int64 tensor holds."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """x >> s on the 64 bits as unsigned (torch's >> on int64 keeps the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer: every bit of x reaches every bit of the result (int64 products wrap)."""
    x = (x ^ _shift_right(x, 30)) * MIX1
    x = (x ^ _shift_right(x, 27)) * MIX2
    return x ^ _shift_right(x, 31)


def hashed_uniforms(keys, device) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32, one per element of the broadcast of `keys` (int64 tensors or
    ints, smallest first: each is mixed in at its own shape)."""
    h = torch.zeros((), dtype=torch.int64, device=device)
    for key in keys:
        h = _mix(h + GOLDEN + (key.to(device, torch.int64) if torch.is_tensor(key) else key))
    # 23 bits: (n + 0.5) / 2**23 is exact in float32 and never 0 or 1.
    return (_shift_right(h, 41).float() + 0.5) * (1.0 / (1 << 23))


def by_index(logits: torch.Tensor) -> tuple:
    """(sequence, head, query position, key position) of each logit [b, heads, q, n] or [rows, q, n]
    taken as its indices: for a caller that gives no positions."""
    *lead, q, n = logits.shape
    shape = [1] * logits.dim()
    seq, head = (torch.arange(lead[0]).view(-1, *shape[1:]),
                 torch.arange(lead[1]).view(1, -1, *shape[2:]) if len(lead) == 2 else 0)
    return seq, head, torch.arange(q).view(*shape[:-2], q, 1), torch.arange(n).view(*shape[:-1], n)


class Keyformer(Evicting):
    name = "keyformer"
    accumulates = True

    def temperature(self, i: int) -> float:
        return 1.0 + i / max(self.gen_len - 1, 1)

    def temperatures(self, step, logits: torch.Tensor):
        """tau of the step: 1 at a prompt; where each sequence has its own max_new_tokens (a job's
        records), its own, from the tokens it generated (per sequence where slots are refilled):
        [b, 1, 1, 1]."""
        if step.prefill:
            return 1.0
        if step.row_gen_lens is None:
            return self.temperature(step.i)
        generated = step.i if step.row_slots is None else step.before.to(logits.device, torch.float32) + 1
        last = (step.row_gen_lens.to(logits.device, torch.float32) - 1).clamp_(min=1)
        return (1 + generated / last).view(-1, *[1] * (logits.dim() - 1))

    def contribution(self, logits, probs, real_rows, step, at=None):
        seq, head, query, key = at() if at is not None else by_index(logits)
        seeds = seq if step.row_seeds is None else step.row_seeds.to(seq.device)[seq]
        u = hashed_uniforms((self.seed, seeds, head, query, key), logits.device)
        gumbel = u.log_().neg_().log_().neg_()
        noisy = torch.softmax((logits.float() + gumbel) / self.temperatures(step, logits), dim=-1)
        return (noisy if real_rows is None else noisy * real_rows).sum(-2)

    def priority(self, pos, score, current):
        return score
