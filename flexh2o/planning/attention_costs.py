"""What the engine's own attention calls cost, measured on the machine and fitted to a line.

The attention arithmetic is small next to the matrix products, but the calls are not: on a CPU
the observed prompt path (a KV policy that needs the probabilities: chunked products, a masked
softmax, the policy's column sums) ran twice as long as the fused kernel the full cache uses, and
an evicting policy's decode call (separate kernels over every slot, then scoring and choosing a
victim) ran 3-5x as long as the full cache's fused call over the same slots. Proxies (a bare
product's FLOP/s, a fixed bookkeeping cost from a tiny model) missed both by up to 0.7 ms per call
on opt-125m.

So the profile times the very functions the engine calls, each at a small and a large size with
HEAD_DIM-wide heads, and keeps a line through the two: seconds = fixed + units * per_unit, where
a unit is one (sequence, query head) pair times one query-key product (prompt: s * s of them,
decode: one per slot), times head_dim / HEAD_DIM.

| call | where the engine makes it |
|---|---|
| prompt_fused | the prompt's attention under a policy that needs no probabilities (the full cache) |
| prompt_observed | the prompt's attention under one that does (H2O's column sums stand for all) |
| decode_fused | a full-cache decode step over its filled slots |
| decode_evicting | an evicting policy's decode step and bookkeeping (H2O's: the costliest but Keyformer's) |
"""

import itertools

import torch

from flexh2o.kv.cache import KVCache
from flexh2o.kv.h2o import HeavyHitters
from flexh2o.models.attention import attend_filled, decode_attention, prompt_attention, prompt_attention_observed
from flexh2o.host.hardware import ATTENTION_CALLS

HEAD_DIM = 64
HEADS = 12              # query heads, all with their own KV head, of the measured calls
DECODE_BATCH = 8        # sequences of a measured decode call
SMALL_PROMPT, SMALL_DECODE = 32, 16  # tokens, slots of the small calls
CALLS = ATTENTION_CALLS


def seconds(line, units: float):
    """A fitted line [fixed, per_unit] at `units` (a number, or a numpy array in the search)."""
    fixed, per_unit = line
    return fixed + units * per_unit


def prompt_units(batch: int, heads: int, seq: int, head_dim: int) -> float:
    return batch * heads * seq * seq * head_dim / HEAD_DIM


def decode_units(batch: int, heads: int, slots, head_dim: int):
    return batch * heads * slots * head_dim / HEAD_DIM


# -- the calls, as the engine makes them ----------------------------------------------------------

def _qkv(batch: int, n: int, dtype, device):
    return [torch.empty(batch, HEADS, n, HEAD_DIM, dtype=dtype, device=device).uniform_(-1, 1) for _ in range(3)]


def prompt_call(observed: bool, seq: int, dtype, device):
    q, k, v = _qkv(1, seq, dtype, device)
    if not observed:
        return lambda: prompt_attention(q, k, v, None, HEAD_DIM ** -0.5)
    real = torch.ones(1, seq, dtype=torch.bool, device=device)
    policy = HeavyHitters(seq, seq, 1, 0)
    return lambda: prompt_attention_observed(q, k, v, None, real, HEAD_DIM ** -0.5,
                                             lambda logits, probs, rows, at: policy.contribution(logits, probs, rows, None))


def decode_call(evicting: bool, slots: int, dtype, device, stream_bytes: int = 0):
    """A decode step over a cache with `slots` filled: the full cache's fused attention over them
    plus the new token, or decode_attention and H2O's choice of a victim among them. Calls go round
    as many caches as cover stream_bytes: the engine reads each layer's cache once per step, from
    memory, where one cache read again and again would sit in the CPU's caches."""
    slot_bytes = 2 * DECODE_BATCH * HEADS * HEAD_DIM * dtype.itemsize
    caches = []
    for _ in range(max(1, -(-stream_bytes // (slots * slot_bytes)))):
        k, v, _ = _qkv(DECODE_BATCH, slots, dtype, device)
        pos = torch.arange(slots, dtype=torch.int32, device=device).expand(DECODE_BATCH, HEADS, slots).contiguous()
        caches.append(KVCache(k, v, pos, torch.rand(DECODE_BATCH, HEADS, slots, device=device), length=slots))
    turn = itertools.cycle(caches)
    q, k_new, v_new = _qkv(DECODE_BATCH, 1, dtype, device)
    new_pos = torch.full((DECODE_BATCH, 1), slots + 1, device=device)
    scale = HEAD_DIM ** -0.5
    if not evicting:
        return lambda: attend_filled(q, next(turn), scale, padded=False)
    policy = HeavyHitters(slots, max(1, slots // 2), 1, 0)

    def step():
        cache = next(turn)
        out, logits, probs = decode_attention(q, cache, k_new, v_new, scale)
        policy.decode(cache, k_new, v_new, new_pos, logits, probs, None)
        return out
    return step


def fitted(time_call, make, small: int, large: int, units) -> list:
    """[fixed, per_unit] through the calls at sizes small and large (per_unit at least 0, fixed too)."""
    t_small, t_large = time_call(make(small)), time_call(make(large))
    u_small, u_large = units(small), units(large)
    per_unit = max(0.0, (t_large - t_small) / (u_large - u_small))
    return [max(0.0, t_small - u_small * per_unit), per_unit]


def measure_attention_costs(time_call, dtype, device, prompt_seq: int, decode_slots: int, stream_bytes: int) -> dict:
    """CALLS -> [fixed, per_unit]; time_call(fn) gives seconds per call. The large sizes are the
    prompt's prompt_seq tokens and decode_slots slots; the small ones, SMALL_PROMPT and SMALL_DECODE,
    are near nothing, so the fixed part is what the smallest call takes (noise in the large call
    moves the slope, hardly the fixed part)."""
    def prompt_units_at(seq):
        return prompt_units(1, HEADS, seq, HEAD_DIM)

    def decode_units_at(slots):
        return decode_units(DECODE_BATCH, HEADS, slots, HEAD_DIM)
    costs = {}
    for name, observed in (("prompt_fused", False), ("prompt_observed", True)):
        costs[name] = fitted(time_call, lambda seq: prompt_call(observed, seq, dtype, device),
                             min(SMALL_PROMPT, prompt_seq // 2), prompt_seq, prompt_units_at)
    for name, evicting in (("decode_fused", False), ("decode_evicting", True)):
        costs[name] = fitted(time_call, lambda slots: decode_call(evicting, slots, dtype, device, stream_bytes),
                             min(SMALL_DECODE, decode_slots // 2), decode_slots, decode_units_at)
    return costs
