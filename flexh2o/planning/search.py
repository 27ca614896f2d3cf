"""The search: the policy with the best predicted throughput that the engine's pre-flight admits.

For every batch shape (gpu_batch_size x num_gpu_batches) and switch (activations parked in CPU
memory, CPU attention, compression) it scores every placement of the weights against every
placement of the cache at once: the weights' memory and I/O depend only on the weights' shares,
the cache's only on the cache's, so both are computed once per share and combined as numpy arrays
(cost_model.py writes every term with + and maximum for this). A placement counts only if
engine/preflight.py's projection fits the capacities, the same check the engine makes before it runs.

Among the policies within `tolerance` of the best predicted total throughput it picks the smallest
batch: past the point where the device is busy a larger batch buys little and costs memory and latency.
"""

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from flexh2o.kv.home import batch_split
from flexh2o.engine.preflight import growth_bytes, load_transient, outside_allocator, run_need, weight_need, with_loading
from flexh2o.planning.cost_model import DTYPE_BYTES, Channels, CostModel, Prediction, stage_time

TIERS = ("gpu", "cpu", "disk")
GPU_BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
NUM_GPU_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SEARCH_SAMPLES = 8  # decode steps scored per candidate (the chosen policy is then predicted in full)


@dataclass(frozen=True)
class Plan:
    policy: object
    predicted: Prediction
    candidates: int  # policies scored


def shares(step: float) -> list[tuple[float, float]]:
    """Every (gpu, cpu) percentage pair on a grid of `step`, gpu + cpu <= 100."""
    n = int(round(100 / step))
    return [(g * step, c * step) for g in range(n, -1, -1) for c in range(n - g, -1, -1)]


@functools.cache  # (asked for once per batch shape and switch: the same few batches again and again)
def cache_shares(batch: int, step: float) -> tuple[tuple[float, float], ...]:
    """The cache placements that differ for a gpu-batch: one grid point per distinct split of its
    sequences, the one nearest the split's own percentages (so a split with sequences on disk is
    never shown as a placement without disk)."""
    best = {}
    for g, c in shares(step):
        rows = batch_split(batch, g, c)
        key = (rows["gpu"], rows["cpu"])
        distance = abs(g - 100 * rows["gpu"] / batch) + abs(c - 100 * rows["cpu"] / batch)
        if key not in best or distance < best[key][0]:
            best[key] = (distance, (g, c))
    return tuple(share for _, share in best.values())


def stacked(channels: list[Channels], shape: tuple) -> Channels:
    """Channels whose values are arrays over candidates (reshaped to `shape` for broadcasting)."""
    keys = {key for ch in channels for key in ch}
    out = Channels()
    for key in keys:
        out[key] = np.array([ch.get(key, 0.0) for ch in channels], dtype=np.float64).reshape(shape)
    return out


def fits(need: dict, caps: dict, on_cuda: bool):
    """preflight.check_fits as a mask over candidates (need: tier -> array)."""
    ok = np.ones(np.broadcast(*need.values()).shape, dtype=bool)
    for tier in TIERS:
        ok &= need[tier] <= caps[tier]
    if not on_cuda:
        ok &= need["gpu"] + need["cpu"] <= caps["ram"] - growth_bytes(caps)
    return ok


class Search:
    def __init__(self, spec, prompt_len: int, gen_len: int, profile, caps: dict, dtype: str | None = None,
                 step: float = 5, samples: int = SEARCH_SAMPLES, weight_shares=None, layers=None):
        """layers: a pipeline stage's slice (pipeline_plan.py; spec then counts its attention layers)."""
        self.model = CostModel(spec, prompt_len, gen_len, profile, dtype, layers)
        self.spec, self.prompt_len, self.gen_len, self.caps = spec, prompt_len, gen_len, caps
        self.device = torch.device(profile.device)
        self.on_cuda = profile.device == "cuda"
        self.dtype_bytes = DTYPE_BYTES[self.model.dtype]
        self.step, self.steps = step, self.model.steps(samples)
        self.weight_shares = shares(step) if weight_shares is None else list(weight_shares)
        self._weights = {}

    def weights(self, policy):
        """Per distinct weight-compression: the weights' memory need, per-layer I/O and loading's
        transient (preflight.load_transient) for every share."""
        key = policy.compress_weight
        if key not in self._weights:
            policies = [replace(policy, w_gpu_percent=g, w_cpu_percent=c) for g, c in self.weight_shares]
            layers = self.model.layers
            needs = [weight_need(layers, self.dtype_bytes, p, self.device) for p in policies]
            need = {t: np.array([n[t] for n in needs], dtype=np.float64)[:, None] for t in TIERS}
            per_policy = [self.model.weight_io(p) for p in policies]
            io = [stacked([ios[j] for ios in per_policy], (-1, 1)) for j in range(len(layers))]
            # Per share: where the weights are not all on the compute tier, a 16-bit checkpoint's
            # matrices stay 16-bit, and loading holds those copies too.
            transient = np.array([load_transient(layers, self.dtype_bytes, p) for p in policies], dtype=np.float64)
            self._weights[key] = need, io, transient[:, None]
        return self._weights[key]

    def score(self, policy):
        """(seconds [W, C], fits [W, C], cache shares) of every placement of a policy's batch shape."""
        need_w, io_w, transient = self.weights(policy)
        cache = [replace(policy, cache_gpu_percent=g, cache_cpu_percent=c)
                 for g, c in cache_shares(policy.gpu_batch_size, self.step)]
        splits = [batch_split(p.gpu_batch_size, p.cache_gpu_percent, p.cache_cpu_percent) for p in cache]
        rows = {t: np.array([r[t] for r in splits], dtype=np.float64)[None, :] for t in TIERS}
        needs = [run_need(self.spec, p, self.dtype_bytes, self.prompt_len, self.gen_len, self.device) for p in cache]
        need_c = {t: np.array([n[t] for n in needs], dtype=np.float64)[None, :] for t in TIERS}
        need = with_loading({t: need_w[t] + need_c[t] for t in TIERS}, need_c, transient, self.on_cuda)
        ok = fits(need, self.caps, self.on_cuda)
        total = np.zeros(ok.shape)
        if ok.any():
            for step in self.steps:
                io_c = self.model.cache_stage(policy, step, rows)
                for j, count in self.model.stages:
                    stage = self.model.stage(policy, step, j, io_w, io_c)
                    total = total + stage_time(stage, policy.overlap) * (count * step.weight)
        return total, ok, cache

    def variants(self, policy, allow_compression: bool):
        """The switches tried for a batch shape: activations parked, CPU attention, compression."""
        acts = [(100, 0)] + ([(0, 100)] if self.on_cuda and policy.num_gpu_batches > 1 else [])
        cpu_attention = [True] if policy.cpu_cache_compute else [False, True] if self.on_cuda else [False]
        weight = [False, True] if allow_compression else [policy.compress_weight]
        cache = [False, True] if allow_compression else [policy.compress_cache]
        for act, ccc, cw, cc in itertools.product(acts, cpu_attention, weight, cache):
            if ccc and cc:
                continue  # the policy refuses the pair
            yield replace(policy, act_gpu_percent=act[0], act_cpu_percent=act[1], cpu_cache_compute=ccc,
                          compress_weight=cw, compress_cache=cc)

    def best_of(self, policy):
        """(throughput, policy) of the best placement of one batch shape and variant; None if none fits."""
        total, ok, cache = self.score(policy)
        if not ok.any():
            return None
        throughput = np.where(ok, policy.batch_size * self.gen_len / np.maximum(total, 1e-12), -1.0)
        w, c = np.unravel_index(int(np.argmax(throughput)), throughput.shape)
        g, cp = self.weight_shares[w]
        return float(throughput[w, c]), replace(cache[c], w_gpu_percent=g, w_cpu_percent=cp)


def search(spec, prompt_len: int, gen_len: int, profile, caps: dict, base, dtype: str | None = None,
           allow_compression: bool = False, max_batch: int | None = None, total_batch: int | None = None,
           tolerance: float = 0.02, step: float = 5, gpu_batch_sizes=GPU_BATCH_SIZES,
           num_gpu_batches=None, weight_shares=None) -> Plan | None:
    """The best policy for the job, keeping base's KV policy and overlap (and its compression unless
    allow_compression); num_gpu_batches: the gpu-batch counts tried (default NUM_GPU_BATCHES); total_batch:
    only batch shapes of exactly that many sequences; weight_shares: the (gpu, cpu) percentages of the
    weights tried (default: all on the grid; one for weights already placed). None if nothing fits."""
    s = Search(spec, prompt_len, gen_len, profile, caps, dtype, step, weight_shares=weight_shares)
    if total_batch is not None:  # the gpu-batch counts asked for (any, by default) that divide it
        counts = range(1, total_batch + 1) if num_gpu_batches is None else num_gpu_batches
        num_gpu_batches = [nb for nb in counts if total_batch % nb == 0]
        gpu_batch_sizes = sorted(total_batch // nb for nb in num_gpu_batches)
        max_batch = total_batch if max_batch is None else min(max_batch, total_batch)
    elif num_gpu_batches is None:
        num_gpu_batches = NUM_GPU_BATCHES
    found, scored = [], 0
    for nb in num_gpu_batches:
        any_fit = False
        for b in gpu_batch_sizes:
            if max_batch is not None and b * nb > max_batch:
                break
            if total_batch is not None and b * nb != total_batch:
                continue
            shape = replace(base, gpu_batch_size=b, num_gpu_batches=nb)
            variants = list(s.variants(shape, allow_compression))
            results = [r for r in map(s.best_of, variants) if r is not None]
            scored += len(variants) * len(s.weight_shares) * len(cache_shares(b, step))
            if not results:
                break  # a larger gpu-batch needs more memory still
            any_fit = True
            found += results
        if not any_fit and total_batch is None:
            break  # more gpu-batches of one sequence need more memory still
    if not found:
        return None
    best = max(t for t, _ in found)
    chosen = min((p.batch_size, -t, i, p) for i, (t, p) in enumerate(found) if t >= (1 - tolerance) * best)[3]
    return Plan(chosen, CostModel(spec, prompt_len, gen_len, profile, dtype).predict(chosen), scored)


def caps_of(profile, gpu_mem=None, cpu_mem=None, disk_mem=None) -> dict:
    """A profile's capacities as preflight.capacities gives them, with the caps given in their place."""
    device_total = profile.gpu_mem - (outside_allocator(False) if profile.device == "cuda" else 0)
    caps = {"gpu": device_total if gpu_mem is None else gpu_mem,
            "cpu": profile.cpu_mem if cpu_mem is None else cpu_mem,
            "disk": profile.disk_mem if disk_mem is None else disk_mem,
            "given": tuple(t for t, v in (("gpu", gpu_mem), ("cpu", cpu_mem), ("disk", disk_mem)) if v is not None)}
    caps["ram"] = caps["cpu"]
    return caps
