"""A placement that fits, for when the user names none.

Everything on the compute device is the default; when the pre-flight projection says it cannot
fit, this picks the first placement that does, preferring fast tiers: the KV cache on the compute
device, else in CPU memory, else on disk; then the largest weight share on the compute device and
the largest of the rest in CPU memory, in steps of 5%. It stands in until the cost-model optimizer
chooses placements by predicted throughput.
"""

import dataclasses

import torch

from flexh2o.common.errors import UsageError
from flexh2o.engine.preflight import check_fits, format_size, projected_need, weight_need

STEP = 5


def fits(spec, policy, dtype_bytes, prompt_len, gen_len, caps, device, weights=None, layers=None) -> bool:
    """Whether the pre-flight projection admits the policy (weights: its weight_need, and layers:
    spec's, if known)."""
    layers = layers if layers is not None else spec.build_layers()
    try:
        check_fits(projected_need(spec, layers, policy, dtype_bytes, prompt_len, gen_len, device, weights), caps, device)
    except UsageError:
        return False
    return True


def candidates(policy):
    """Every placement tried, fast tiers first: the cache on the compute device, in CPU memory, on
    disk; for each, the weights' gpu share from 100 down, then their cpu share from what is left."""
    for cache in ((100, 0), (0, 100), (0, 0)):
        for w_gpu in range(100, -1, -STEP):
            for w_cpu in range(100 - w_gpu, -1, -STEP):
                yield dataclasses.replace(policy, w_gpu_percent=w_gpu, w_cpu_percent=w_cpu,
                                          cache_gpu_percent=cache[0], cache_cpu_percent=cache[1])


class WeightNeeds(dict):
    """(w_gpu, w_cpu) -> weight_need, shared by the three cache placements and by the searches."""

    def __init__(self, spec, dtype_bytes: int, device):
        super().__init__()
        self.layers, self.dtype_bytes, self.device = spec.build_layers(), dtype_bytes, device

    def of(self, policy) -> dict:
        key = policy.w_gpu_percent, policy.w_cpu_percent
        if key not in self:
            self[key] = weight_need(self.layers, self.dtype_bytes, policy, self.device)
        return self[key]


def fitted_placement(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, caps: dict,
                     device: torch.device, weights: WeightNeeds | None = None):
    """The policy itself if it fits, else the same policy with the first placement that fits, or None.
    Every combination is tried: the need is not monotonic in the shares (weights held whole in
    memory need no compute copy)."""
    weights = weights if weights is not None else WeightNeeds(spec, dtype_bytes, device)
    for p in (policy, *candidates(policy)):
        if fits(spec, p, dtype_bytes, prompt_len, gen_len, caps, device, weights=weights.of(p), layers=weights.layers):
            return p
    return None


def smallest_need(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, device, weights: WeightNeeds) -> tuple:
    """(placement, need per tier) of the candidate needing the least memory (gpu + cpu), then disk."""
    least = None
    for p in candidates(policy):
        need = projected_need(spec, weights.layers, p, dtype_bytes, prompt_len, gen_len, device, weights.of(p))
        if least is None or (need["gpu"] + need["cpu"], need["disk"]) < least[0]:
            least = (need["gpu"] + need["cpu"], need["disk"]), p, need
    return least[1:]


def no_fit_error(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, caps: dict, device,
                 weights: WeightNeeds) -> UsageError:
    """The error for a job that no placement fits: what the smallest placement needs and what is free.
    It names the caps given, else the batch when a batch of one would fit, else the model."""
    placement, need = smallest_need(spec, policy, dtype_bytes, prompt_len, gen_len, device, weights)
    one = dataclasses.replace(placement, gpu_batch_size=1, num_gpu_batches=1)
    flag = "/".join(f"--{tier}-mem" for tier in caps.get("given", ())) or (
        "--gpu-batch-size/--num-gpu-batches" if fits(spec, one, dtype_bytes, prompt_len, gen_len, caps, device)
        else "--model")
    free = caps["ram"] if device.type == "cpu" else caps["gpu"] + caps["cpu"]
    return UsageError(flag, f"no placement of {spec.name} with a batch of {policy.batch_size} x {prompt_len}+{gen_len} "
                      f"tokens fits on this machine: the smallest ({describe(placement)}) needs "
                      f"{format_size(need['gpu'] + need['cpu'])} of memory and {format_size(need['disk'])} of disk; "
                      f"{format_size(free)} of memory and {format_size(caps['disk'])} of disk are free")


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
