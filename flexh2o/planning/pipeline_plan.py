"""Planning a pipeline (pipeline.py): each stage's placement searched for its own slice of the layers
within its own memory, and the pipeline's throughput projected from the stages' times and the link.

A block's K gpu-batches go through the S stages as M = min(K, S) micro-batches. A stage runs the
zig-zag over its slice once per micro-batch, its weights loaded per visit; its memory holds the
KV cache of all K gpu-batches. If stage s takes t_s for one micro-batch's token step, a token step
of the pipeline takes max(M * max_s t_s, sum_s t_s + the hidden states' trips between stages):
the busiest stage, or, with fewer micro-batches than stages, one micro-batch's round trip (micro-
batch m's next step starts at the first stage once the last has chosen its tokens: the bubble).
Summed over the run's token steps with each stage's prediction (cost_model.py) of its whole run.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np

from flexh2o.models.cached_attention import CachedAttention
from flexh2o.engine.pipeline import micro_batches, model_slices
from flexh2o.planning.cost_model import DTYPE_BYTES
from flexh2o.planning.search import GPU_BATCH_SIZES, NUM_GPU_BATCHES, Search


@dataclass
class StagePlan:
    layers: range          # its slice of the model's layers
    policy: object         # its placement (the batch shape is the pipeline's)
    seconds: float         # one micro-batch through its layers, summed over the run's token steps


@dataclass
class PipelinePlan:
    stages: list
    micro_batches: int
    batch: int
    gen_len: int
    link_seconds: float    # one micro-batch's hidden states between every pair of stages, over the run
    seconds: float         # the run

    @property
    def throughput(self) -> float:
        return self.batch * self.gen_len / self.seconds

    @property
    def bubble_share(self) -> float:
        """Of the run, the share the busiest stage idles (waiting for a micro-batch's round trip)."""
        busiest = self.micro_batches * max(s.seconds for s in self.stages)
        return 1 - busiest / self.seconds


def stage_parts(spec, stages: int, dtype_bytes: int) -> list:
    """(spec counting only the slice's attention layers, its layers, their range) per stage."""
    layers = spec.build_layers()
    parts = []
    for piece in model_slices(layers, dtype_bytes, stages):
        mine = [layers[j] for j in piece]
        attention = sum(isinstance(layer, CachedAttention) for layer in mine)
        parts.append((dataclasses.replace(spec, num_layers=attention), mine, piece))
    return parts


def link_seconds(spec, batch: int, micro: int, stages: int, prompt_len: int, gen_len: int, dtype_bytes: int,
                 link_bandwidth: float) -> float:
    """One micro-batch's hidden states across the stages' boundaries, over the run (the tokens back
    are a few bytes a sequence)."""
    rows = batch / micro
    per_boundary = rows * (prompt_len + gen_len - 1) * spec.hidden_size * dtype_bytes
    return (stages - 1) * per_boundary / link_bandwidth


def best_stage(search: Search, shape, micro_shape, allow_compression: bool):
    """(seconds, policy) of the stage's best placement for a batch shape: the cache of every
    gpu-batch must fit; time is one micro-batch's. None if nothing fits."""
    best = None
    for variant in search.variants(shape, allow_compression):
        _, ok, cache = search.score(variant)
        if not ok.any():
            continue
        seconds, _, _ = search.score(dataclasses.replace(variant, num_gpu_batches=micro_shape.num_gpu_batches))
        seconds = np.where(ok, seconds, np.inf)
        w, c = np.unravel_index(int(np.argmin(seconds)), seconds.shape)
        g, cp = search.weight_shares[w]
        found = (float(seconds[w, c]), dataclasses.replace(cache[c], w_gpu_percent=g, w_cpu_percent=cp))
        if best is None or found[0] < best[0]:
            best = found
    return best


def plan_pipeline(spec, prompt_len: int, gen_len: int, profile, caps: dict, base, stages: int, link_bandwidth: float,
                  dtype: str | None = None, allow_compression: bool = False, max_batch: int | None = None,
                  total_batch: int | None = None, step: float = 5) -> PipelinePlan | None:
    """The batch shape, and each stage's placement, with the best projected throughput, every stage
    within `caps` (each stage a machine like `profile`); None if no shape fits every stage."""
    dtype = dtype or profile.dtype
    dtype_bytes = DTYPE_BYTES[dtype]
    parts = stage_parts(spec, stages, dtype_bytes)
    searches = [Search(part_spec, prompt_len, gen_len, profile, caps, dtype, step, layers=layers)
                for part_spec, layers, _ in parts]
    best = None
    for nb in NUM_GPU_BATCHES:
        micro = len(micro_batches(nb, stages))
        if nb % micro:
            continue  # micro-batches of equal gpu-batch counts only
        for b in GPU_BATCH_SIZES:
            if (max_batch is not None and b * nb > max_batch) or (total_batch is not None and b * nb != total_batch):
                continue
            shape = dataclasses.replace(base, gpu_batch_size=b, num_gpu_batches=nb)
            micro_shape = dataclasses.replace(shape, num_gpu_batches=nb // micro)
            found = [best_stage(s, shape, micro_shape, allow_compression) for s in searches]
            if any(f is None for f in found):
                break  # a larger gpu-batch needs more memory still
            link = link_seconds(spec, b * nb, micro, stages, prompt_len, gen_len, dtype_bytes, link_bandwidth)
            times = [seconds for seconds, _ in found]
            seconds = max(micro * max(times), sum(times) + link)
            plan = PipelinePlan([StagePlan(piece, policy, t) for (_, _, piece), (t, policy) in zip(parts, found)],
                                micro, b * nb, gen_len, link, seconds)
            if best is None or plan.throughput > best.throughput:
                best = plan
    return best
