"""The cost model: how long a run takes, from the model, the policy and a hardware profile.

It follows the zig-zag schedule (schedule.py). A token step walks the layers; while layer j
computes its gpu-batches, the weights of layer j+1 load and the cache of layer j moves in and out
(one layer's I/O hides behind the other's compute). So a layer's stage takes, with overlap, the
longest of its compute and of each I/O channel's busy time, and without overlap their sum:

- compute: the matrix products at the rate the profile measured for their rows, the engine's
  attention calls as the profile timed them (attention_costs.py; a profile without them: the
  prompt's products at attention_flops, decode reading K and V at the device's bandwidth), 4-bit
  weights multiplied as stored at the rate the profile timed its kernel, or dequantized once per
  load, a 16-bit checkpoint's matrices kept 16-bit (gguf_blocks.keeps_16_bit) widened per
  load where the kernel does not take the step's rows (on CUDA both are widened on the load stream,
  behind their copies, and count as h2d), a fixed cost per (layer, gpu-batch) call,
  and, where the CPU computes, the memory copies the I/O threads make: a thread copying takes a
  core from the compute's two-thread team, whose work waits on its slower thread, so a copy adds
  its whole time;
- h2d / d2h: copies between CPU memory and the GPU (pinned), weights, cache and parked hidden states;
- disk: reads and writes of the offload files, without the page cache (where the CPU computes,
  the cache's count as compute: see _cache_io).

Bytes are counted as the engine places and moves them (placed.split_rows, kv.home.batch_split, the
stored width of compressed rows), and the KV policy's budget sets the slots each step reads. Decode
steps differ only in how many slots they read; long generations are summed over a sample of them.

Every term is written with + and maximum only, so the search (search.py) evaluates thousands of
placements at once by passing numpy arrays where a single prediction passes numbers.
"""

import math
from dataclasses import dataclass

import numpy as np

from flexh2o.host.devices import DTYPES
from flexh2o.kv import POLICIES, budget, slot_bytes
from flexh2o.kv.home import batch_split, cpu_attention_dtype
from flexh2o.compression.gguf_blocks import SIXTEEN_BIT, is_low_bit, keeps_16_bit, keeps_low_bit
from flexh2o.engine.preflight import DTYPE_OF, split_as_placed, stored_formats
from flexh2o.compression.kernel_choice import MAX_ROWS, kernel_for, max_rows
from flexh2o.planning.attention_costs import decode_units, prompt_units
from flexh2o.planning.attention_costs import seconds as attention_seconds
from flexh2o.host.hardware import HardwareProfile

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
PROBS_PASSES = 4        # the prompt's attention probabilities are written and read about this often
DECODE_SAMPLES = 16     # decode steps evaluated when there are more; each stands for its share of steps


@dataclass(frozen=True)
class Prediction:
    prefill_seconds: float
    decode_seconds: float
    batch_size: int
    prompt_len: int
    gen_len: int
    bottleneck: dict        # phase -> what bounds it: one of BOTTLENECKS
    breakdown: dict         # phase -> bottleneck -> seconds of stages it bounds

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def prefill_throughput(self) -> float:  # the report's definitions (report.py)
        return self.batch_size * self.prompt_len / self.prefill_seconds

    @property
    def decode_throughput(self) -> float:
        return self.batch_size * (self.gen_len - 1) / max(self.decode_seconds, 1e-12)

    @property
    def total_throughput(self) -> float:
        return self.batch_size * self.gen_len / self.total_seconds

    def to_dict(self) -> dict:
        return {"prefill_latency_s": self.prefill_seconds, "decode_latency_s": self.decode_seconds,
                "total_latency_s": self.total_seconds, "prefill_throughput": self.prefill_throughput,
                "decode_throughput": self.decode_throughput, "total_throughput": self.total_throughput,
                "bottleneck": self.bottleneck, "breakdown": self.breakdown}


@dataclass(frozen=True)
class Step:
    """One token step: the prompt step, or a decode step reading `length` cached slots; `weight`:
    how many decode steps it stands for."""
    prefill: bool
    length: int
    weight: float


class Channels(dict):
    """Seconds per resource (compute, h2d, d2h, disk), each split by what it serves."""

    def add(self, channel: str, what: str, seconds):
        key = (channel, what)
        self[key] = self.get(key, 0.0) + seconds
        return self

    def merged(self, other: "Channels") -> "Channels":
        out = Channels(self)
        for (channel, what), seconds in other.items():
            out.add(channel, what, seconds)
        return out

    def busy(self, channel: str):
        return sum((s for (c, _), s in self.items() if c == channel), 0.0)



CHANNELS = ("compute", "h2d", "d2h", "disk")


def stage_time(stage: Channels, overlap: bool):
    """Seconds of one stage: its busiest channel with overlap, else every channel in turn."""
    busy = [stage.busy(c) for c in CHANNELS]
    if not overlap:
        return sum(busy)
    out = busy[0]
    for b in busy[1:]:
        out = np.maximum(out, b)
    return out


def stage_bound(stage: Channels, overlap: bool) -> str:
    """What bounds a stage: the disk, or what the busiest other channel serves most."""
    if overlap:
        channel = max(CHANNELS, key=stage.busy)
        if channel == "disk":
            return "disk"
        parts = {what: s for (c, what), s in stage.items() if c == channel}
    else:
        parts = {}
        for (channel, what), s in stage.items():
            key = "disk" if channel == "disk" else what
            parts[key] = parts.get(key, 0.0) + s
    return max(parts, key=parts.get) if parts else "compute"


class CostModel:
    """Predictions for one model, prompt and generation length on one profile (dtype: the run's,
    by default the profile's)."""

    def __init__(self, spec, prompt_len: int, gen_len: int, profile: HardwareProfile, dtype: str | None = None,
                 layers=None):
        """layers: the ones a process runs (a pipeline stage's slice), by default all of spec's."""
        self.spec, self.prompt_len, self.gen_len, self.hw = spec, prompt_len, gen_len, profile
        self.dtype = dtype or profile.dtype
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        self.on_cuda = profile.device == "cuda"
        self.layers = spec.build_layers() if layers is None else layers
        self.kinds = [type(layer).__name__ for layer in self.layers]
        # The 2-D weights each layer multiplies by, as (out, in).
        self.matrices = [[shape for _, shape in layer.weight_specs() if len(shape) == 2] for layer in self.layers]
        # Per matrix, the format its checkpoint stores it in (gguf_blocks.py): 16-bit ones are kept so
        # where keeps_16_bit holds, low-bit blocks where keeps_low_bit does.
        self.stored_formats = [[fmt for (_, shape), fmt in zip(layer.weight_specs(), layer.stored_formats())
                                if len(shape) == 2] for layer in self.layers]
        self.keeps_low_bit = keeps_low_bit(self.dtype_bytes)  # asked once, not at every step the search prices
        self.stages = self._distinct_stages()

    def _distinct_stages(self) -> list[tuple[int, int]]:
        """(j, count): the stages of a token step that differ, as layer j's compute and cache beside
        layer j+1's weight load (alike layers make alike stages), and how often each occurs."""
        n, seen = len(self.layers), {}
        for j in range(n):
            key = (self.kinds[j], tuple(shape for _, shape in self.layers[(j + 1) % n].weight_specs()), j == n - 1)
            first, count = seen.get(key, (j, 0))
            seen[key] = (first, count + 1)
        return sorted(seen.values())

    # -- the steps ----------------------------------------------------------------------------
    def steps(self, samples: int = DECODE_SAMPLES) -> list[Step]:
        """The prompt step and the decode steps (or `samples` of them, each the middle of an equal
        run of steps and weighted by its length), with the slots each reads."""
        count = self.gen_len - 1
        if count <= samples:
            decode = [Step(False, i, 1.0) for i in range(1, self.gen_len)]
        else:
            width = count / samples
            decode = [Step(False, 1 + int((s + 0.5) * width), width) for s in range(samples)]
        return [Step(True, 0, 1.0)] + decode

    def cache_length(self, policy, i: int) -> int:
        """Slots in use when decode step i (1-based) starts: the prompt's within the budget, one more per step."""
        capacity, _ = budget(policy, self.prompt_len, self.gen_len)
        return min(capacity, self.prompt_len + i - 1)

    # -- weights --------------------------------------------------------------------------------
    def weight_io(self, policy) -> list[Channels]:
        """Per layer: what its weights cost to reach the compute device, once per token step."""
        memo, out = {}, []
        for layer in self.layers:
            key = tuple(shape for _, shape in layer.weight_specs())
            if key not in memo:
                memo[key] = self._layer_weight_io(layer, policy)
            out.append(memo[key])
        return out

    def _layer_weight_io(self, layer, policy) -> Channels:
        hw, ch = self.hw, Channels()
        if self.on_cuda:  # widened at every load on the load stream, where the next copy waits for it (weight_io.py)
            for shape, fmt in stored_formats(layer, self.dtype_bytes, policy)[layer.gathered:]:
                if fmt in SIXTEEN_BIT:  # read 2 bytes, write 4
                    ch.add("h2d", "weight I/O", math.prod(shape) * 6 / hw.device_bandwidth)
                elif fmt is not None:
                    ch.add("h2d", "weight I/O", math.prod(shape) / hw.dequant)
        # A table looked up by rows (an input embedding) moves a few rows: left out.
        for shape, _, row_bytes, rows in split_as_placed(layer, self.dtype_bytes, policy)[layer.gathered:]:
            whole = [tier for tier, n in rows.items() if n == shape[0]]
            in_place = bool(whole) and (whole[0] == "gpu" or (whole[0] == "cpu" and not self.on_cuda))
            if in_place:  # (compressed, it is still dequantized or multiplied as stored: see compute())
                continue
            moved = {tier: n * row_bytes for tier, n in rows.items()}
            if moved["disk"]:
                ch.add("disk", "weight I/O", moved["disk"] / hw.disk_read)
            if self.on_cuda:
                ch.add("h2d", "weight I/O", (moved["cpu"] + moved["disk"]) / hw.h2d)
            else:  # an I/O thread assembles the buffer in memory, on the cores that compute
                ch.add("compute", "weight I/O", sum(moved.values()) / hw.memcpy)
        return ch

    # -- cache and attention ----------------------------------------------------------------------
    def cache_stage(self, policy, step: Step, rows: dict | None = None) -> Channels:
        """One attention layer's cache traffic and attention arithmetic in a step, all gpu-batches.
        rows: sequences of a gpu-batch per tier (default: the policy's split); every term is linear
        in them, so the search passes arrays of splits to score them all at once."""
        if rows is None:
            rows = batch_split(policy.gpu_batch_size, policy.cache_gpu_percent, policy.cache_cpu_percent)
        return self._cache_io(policy, step, rows).merged(self._attention(policy, step, rows))

    def _cache_io(self, policy, step: Step, rows: dict) -> Channels:
        hw, spec, nb = self.hw, self.spec, policy.num_gpu_batches
        capacity, _ = budget(policy, self.prompt_len, self.gen_len)
        slot = 2 * spec.num_kv_heads * slot_bytes(spec, policy, self.dtype_bytes)  # K and V of a slot, as stored
        values = 2 * spec.num_kv_heads * spec.head_dim
        state = spec.num_kv_heads * capacity * (8 if POLICIES[policy.kv_policy].accumulates else 4)
        if step.prefill:  # slots read and written by each sequence
            read, written = 0, min(capacity, self.prompt_len)
        else:
            read, written = self.cache_length(policy, step.length), 1
        ch = Channels()
        # Where the CPU computes, a disk part's reads, copies and row writes take the cores the
        # compute needs: they did not overlap it (H2O 10% + 10%, cache on disk, opt-125m, 2-core Xeon:
        # 143-186 ms a decode step with overlap, 151-165 without), so they add to the compute.
        disk_channel = "disk" if self.on_cuda else "compute"
        ch.add(disk_channel, "cache I/O", nb * rows["disk"] * slot * (read / hw.disk_read + written / hw.disk_write))
        if self.on_cuda:
            moved = rows["disk"] + (0 if policy.cpu_cache_compute else rows["cpu"])
            home = rows["disk"] + rows["cpu"] if step.prefill else moved  # the prompt's cache is made on the GPU
            ch.add("h2d", "cache I/O", nb * moved * (read * slot + state) / hw.h2d)
            ch.add("d2h", "cache I/O", nb * home * written * slot / hw.d2h)
        else:  # a block read from disk is copied into its compute buffer; positions and scores come in
            ch.add("compute", "cache I/O", nb * rows["disk"] * (read * values * self.dtype_bytes + state) / hw.memcpy)
        if policy.compress_cache and not step.prefill:  # every slot read is dequantized, in place or loaded
            ch.add("compute", "cache I/O", nb * policy.gpu_batch_size * read * values / hw.dequant)
        return ch

    def _attention(self, policy, step: Step, rows: dict) -> Channels:
        b, nb, spec, hw = policy.gpu_batch_size, policy.num_gpu_batches, self.spec, self.hw
        kv = POLICIES[policy.kv_policy]
        calls = hw.attention_costs
        if step.prefill:
            s = self.prompt_len
            if calls is not None:
                line = calls["prompt_observed" if kv.uses_attention else "prompt_fused"]
                seconds = attention_seconds(line, prompt_units(b, spec.num_heads, s, spec.head_dim))
            else:
                products = 4 * b * spec.num_heads * s * s * spec.head_dim
                probs = b * spec.num_heads * s * s * 4 * PROBS_PASSES
                seconds = products / hw.attention_flops[self.dtype] + probs / hw.device_bandwidth
            return Channels().add("compute", "compute", nb * seconds)
        attended = self.cache_length(policy, step.length) + 1
        on_cpu = rows["cpu"] if self.on_cuda and policy.cpu_cache_compute else 0
        evicting = not kv.appends
        # decode_attention, and on CUDA every decode attention (the same shapes at every step),
        # reads every slot, filled or not
        every_slot = budget(policy, self.prompt_len, self.gen_len)[0] + 1
        device_attended = every_slot if self.on_cuda or (evicting and not policy.compress_cache) else attended
        if calls is not None and (evicting or not policy.compress_cache):
            line = calls["decode_evicting" if evicting else "decode_fused"]
            on_device = attention_seconds(line, decode_units(b - on_cpu, spec.num_heads, device_attended,
                                                             spec.head_dim))
        else:  # separate kernels over the slots, as the profile's decode_bandwidth measured them
            on_device = (b - on_cpu) * self._decode_bytes(kv, device_attended, self.dtype_bytes) / hw.device_bandwidth
        wide = cpu_attention_dtype(DTYPE_OF[self.dtype_bytes]).itemsize
        seconds = on_device + on_cpu * self._decode_bytes(kv, attended, wide) / hw.cpu_attention_bandwidth
        return Channels().add("compute", "compute", nb * seconds)

    def _decode_bytes(self, kv, attended: int, value_bytes: int) -> int:
        """Bytes one sequence's decode attention reads: K and V of its slots, and its logits and
        probabilities (passed again by a policy that scores them)."""
        spec = self.spec
        scores = spec.num_heads * attended * 4 * (3 if kv.uses_attention else 1)
        return 2 * spec.num_kv_heads * spec.head_dim * attended * value_bytes + scores

    # -- the rest of a layer ------------------------------------------------------------------------
    def act_io(self, policy, step: Step) -> Channels:
        """Hidden states parked in CPU memory between layers (CUDA, --act cpu=100, several gpu-batches)."""
        ch = Channels()
        if self.on_cuda and policy.act_gpu_percent < 100 and policy.num_gpu_batches > 1:
            seq = self.prompt_len if step.prefill else 1
            nbytes = policy.num_gpu_batches * self.spec.hidden_bytes(policy.gpu_batch_size, seq, self.dtype_bytes)
            ch.add("d2h", "activation I/O", nbytes / self.hw.d2h).add("h2d", "activation I/O", nbytes / self.hw.h2d)
        return ch

    def compute(self, policy, step: Step, j: int) -> Channels:
        """Layer j's matrix products for every gpu-batch of the step, and the fixed cost of each call.
        Compressed (weight_io moves the groups), a matrix is multiplied as stored where a kernel takes
        it at this many rows (kernel_choice.py), else dequantized once per load, on the compute device,
        wherever its groups are (on CUDA on the load stream: _layer_weight_io), and multiplied in full
        width."""
        b, spec, hw = policy.gpu_batch_size, self.spec, self.hw
        rows = b * (self.prompt_len if step.prefill else 1)
        matrices = self.matrices[j]
        if self.kinds[j] == "InputEmbed":  # lookups, then (where embed_dim differs: opt-350m) a projection
            projection = (spec.hidden_size, spec.embed_dim)
            matrices = [projection] if spec.embed_dim != spec.hidden_size else []
        elif self.kinds[j] == "OutputEmbed":
            rows = b  # only the last position predicts
        full_width, seconds, widened, widened_16_bit = 0, hw.layer_overhead, 0, 0
        # The input embedding's matrix here (a projection) is not one the checkpoint stores in blocks.
        formats = self.stored_formats[j] if self.kinds[j] != "InputEmbed" else [None] * len(matrices)
        sixteen_bit, low_bit = keeps_16_bit(policy, self.dtype_bytes), self.keeps_low_bit
        any_rows = self.layers[j].one_of_a_kind and not self.on_cuda  # the head: never widened (WeightIO.multiplied_as_stored)
        for shape, fmt in zip(matrices, formats):
            flops = 2 * rows * shape[0] * shape[1]
            stored_16_bit = sixteen_bit and fmt in SIXTEEN_BIT
            as_stored = policy.compress_weight or low_bit and is_low_bit(fmt)
            rate = self.as_stored_rate(shape, rows, any_rows) if as_stored else None
            if rate is not None:
                seconds += flops / rate
                continue
            full_width += flops  # 16-bit values multiplied as they are (native/blocks.c): about float32's rate
            if self.on_cuda:  # widened on the load stream instead: see _layer_weight_io
                continue
            widened += shape[0] * shape[1] if as_stored else 0
            if stored_16_bit and rows > max_rows("groups", fmt) and not any_rows:
                widened_16_bit += shape[0] * shape[1]
        seconds += full_width / hw.matmul_rate(rows, self.dtype) if full_width else 0.0
        ch = Channels().add("compute", "compute", policy.num_gpu_batches * seconds)
        if widened_16_bit:  # read 2 bytes, write 4, once per load
            ch.add("compute", "weight I/O", widened_16_bit * 6 / hw.memcpy)
        return ch.add("compute", "weight I/O", widened / hw.dequant) if widened else ch

    def as_stored_rate(self, shape, rows: int, any_rows: bool = False) -> float | None:
        """FLOP/s of a compressed matrix multiplied as stored in a step of `rows` rows; None where it
        is widened instead (no kernel for it, more rows than its kernel's limit unless `any_rows`
        (the LM head, with flexh2o's own kernel), or not measured)."""
        measured = self.hw.int4_matmul_rate(1, self.dtype) is not None
        kernel = kernel_for(shape, DTYPES[self.dtype], not self.on_cuda, measured)
        if kernel is None or rows > MAX_ROWS[kernel] and not (any_rows and kernel == "groups"):
            return None
        return self.hw.int4_matmul_rate(rows, self.dtype)

    # -- putting them together --------------------------------------------------------------------
    def stage(self, policy, step: Step, j: int, weights: list[Channels], cache: Channels) -> Channels:
        """Layer j's stage: its compute (and cache, for attention) beside layer j+1's weight load."""
        n = len(self.layers)
        out = self.compute(policy, step, j).merged(weights[(j + 1) % n])
        if self.kinds[j] == "SelfAttention":
            out = out.merged(cache)
        if j < n - 1:
            out = out.merged(self.act_io(policy, step))
        return out

    def predict(self, policy) -> Prediction:
        weights = self.weight_io(policy)
        seconds = {"prefill": 0.0, "decode": 0.0}
        breakdown = {"prefill": {}, "decode": {}}
        for step in self.steps():
            phase = "prefill" if step.prefill else "decode"
            cache = self.cache_stage(policy, step)
            for j, count in self.stages:
                stage = self.stage(policy, step, j, weights, cache)
                t = float(stage_time(stage, policy.overlap)) * count * step.weight
                seconds[phase] += t
                bound = stage_bound(stage, policy.overlap)
                breakdown[phase][bound] = breakdown[phase].get(bound, 0.0) + t
        bottleneck = {phase: max(parts, key=parts.get) if parts else "compute" for phase, parts in breakdown.items()}
        return Prediction(seconds["prefill"], seconds["decode"], policy.batch_size, self.prompt_len, self.gen_len,
                          bottleneck, breakdown)


def predict(spec, policy, prompt_len: int, gen_len: int, profile: HardwareProfile, dtype: str | None = None):
    return CostModel(spec, prompt_len, gen_len, profile, dtype).predict(policy)
