"""KV cache storage with fixed slots, and the policies that decide which tokens keep a slot.

Adding a policy: one file with an `Evicting` subclass, one line in POLICIES.
"""

from flexh2o.common.errors import UsageError
from flexh2o.compression.quant import packed_width
from flexh2o.kv.cache import KVCache
from flexh2o.kv.eviction import FullCache
from flexh2o.kv.h2o import HeavyHitters
from flexh2o.kv.keyformer import Keyformer
from flexh2o.kv.local import LocalWindow
from flexh2o.kv.sink import AttentionSinks
from flexh2o.kv.tova import TokenOmission

POLICIES = {"full": FullCache, "h2o": HeavyHitters, "local": LocalWindow, "sink": AttentionSinks,
            "keyformer": Keyformer, "tova": TokenOmission}


def budget(policy, prompt_len: int, gen_len: int) -> tuple[int, int]:
    """(capacity, recent window) per sequence and KV head for a job of prompt_len + gen_len tokens.

    heavy = int(hh_ratio * prompt_len), recent = int(recent_ratio * prompt_len) (recent_ratio
    defaults to hh_ratio), each at least 1, capacity = heavy + recent, at most the whole sequence:
    a budget that holds every token evicts nothing and gives the full cache's output. A batch's
    cache is allocated at its longest prompt's budget; each sequence keeps its own (eviction.py).
    """
    total = prompt_len + gen_len
    if policy.kv_policy == "full":
        return total, total
    heavy = max(1, int(policy.hh_ratio * prompt_len))
    recent = max(1, int(policy.effective_recent_ratio * prompt_len))
    return min(heavy + recent, total), recent


def check_budget(policy, prompt_len: int):
    """Refuses ratios that give a prompt of prompt_len no slot of their own (a likely typo: the
    budget would be the one-slot minimum)."""
    if policy.kv_policy == "full":
        return
    if int(policy.hh_ratio * prompt_len) < 1:
        raise UsageError("--hh-ratio", f"{policy.hh_ratio:g} x prompt_len {prompt_len} rounds to 0 heavy-hitter "
                         f"slots; use at least {1 / prompt_len:.4g}")
    if int(policy.effective_recent_ratio * prompt_len) < 1:
        raise UsageError("--recent-ratio", f"{policy.effective_recent_ratio:g} x prompt_len {prompt_len} rounds to "
                         f"0 recent slots (the newest token must stay); use at least {1 / prompt_len:.4g}")


def slot_bytes(spec, policy, dtype_bytes: int) -> int:
    """Bytes K (or V) of one slot of one KV head takes at home: head_dim values, or their 4-bit groups."""
    return packed_width(spec.head_dim) if policy.compress_cache else spec.head_dim * dtype_bytes


def cache_bytes(spec, policy, batch: int, prompt_len: int, gen_len: int, dtype_bytes: int) -> int:
    """Bytes of the whole KV cache of a job as stored: K and V at the policy's capacity (compressed
    or not), plus each slot's position (int32) and, for scoring policies, its score (float32); every layer."""
    capacity, _ = budget(policy, prompt_len, gen_len)
    state = 4 + (4 if POLICIES[policy.kv_policy].accumulates else 0)
    return batch * capacity * spec.num_kv_heads * spec.num_layers * (2 * slot_bytes(spec, policy, dtype_bytes) + state)


def make_policy(policy, prompt_len: int, gen_len: int, seed: int = 0) -> FullCache:
    """The KV policy object of one attention layer, its slots enough for a prompt of prompt_len;
    an evicting policy gives each sequence the budget of its own real prompt length."""
    capacity, recent = budget(policy, prompt_len, gen_len)
    ratios = None if policy.kv_policy == "full" else (policy.hh_ratio, policy.effective_recent_ratio)
    return POLICIES[policy.kv_policy](capacity, recent, gen_len, seed, ratios)


__all__ = ["KVCache", "POLICIES", "budget", "cache_bytes", "check_budget", "make_policy", "slot_bytes"]
