"""A placement that fits, for when the user names none.

Everything on the compute device is the default; when the pre-flight projection says it cannot
fit, this picks the first placement that does, preferring fast tiers: the KV cache on the compute
device, else in CPU memory, else on disk; then the largest weight share on the compute device and
the largest of the rest in CPU memory, in steps of 5%. It stands in until the cost-model optimizer
chooses placements by predicted throughput.
"""

import dataclasses

import torch

from .errors import UsageError
from .memory import add, check_fits, run_need, weight_need

STEP = 5


def fits(spec, policy, dtype_bytes, prompt_len, gen_len, caps, device, layers=None, weights=None) -> bool:
    """Whether the pre-flight projection admits the policy (weights: its weight_need, if known)."""
    if weights is None:
        weights = weight_need(layers or spec.build_layers(), dtype_bytes, policy, device)
    try:
        check_fits(add(weights, run_need(spec, policy, dtype_bytes, prompt_len, gen_len, device)), caps, device)
    except UsageError:
        return False
    return True


def fitted_placement(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, caps: dict,
                     device: torch.device):
    """The policy itself if it fits, else the same policy with the first placement that fits, or None.
    Every combination is tried: the need is not monotonic in the shares (weights held whole in
    memory need no compute copy)."""
    layers = spec.build_layers()
    if fits(spec, policy, dtype_bytes, prompt_len, gen_len, caps, device, layers):
        return policy
    weights = {}  # (w_gpu, w_cpu) -> weight_need, shared by the three cache placements
    for cache in ((100, 0), (0, 100), (0, 0)):
        for w_gpu in range(100, -1, -STEP):
            for w_cpu in range(100 - w_gpu, -1, -STEP):
                p = dataclasses.replace(policy, w_gpu_percent=w_gpu, w_cpu_percent=w_cpu,
                                        cache_gpu_percent=cache[0], cache_cpu_percent=cache[1])
                if (w_gpu, w_cpu) not in weights:
                    weights[w_gpu, w_cpu] = weight_need(layers, dtype_bytes, p, device)
                if fits(spec, p, dtype_bytes, prompt_len, gen_len, caps, device, weights=weights[w_gpu, w_cpu]):
                    return p
    return None


def describe(policy) -> str:
    def tiers(kind):
        gpu, cpu = getattr(policy, f"{kind}_gpu_percent"), getattr(policy, f"{kind}_cpu_percent")
        return f"gpu={gpu:g},cpu={cpu:g},disk={100 - gpu - cpu:g}"
    return f"--weights {tiers('w')} --cache {tiers('cache')} --act {tiers('act')}"


def largest(ok, limit: int) -> int:
    """The largest b in 1..limit with ok(b), for ok true up to some b and false after (0 if none):
    the largest batch a pre-flight admits, in O(log limit) checks."""
    lo, hi = 0, 1
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
