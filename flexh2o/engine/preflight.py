"""Pre-flight: what a policy needs on each tier, against what each tier holds.

The projection counts the weights' shares, the double-buffered compute copies of off-device
weights and cache, the KV cache's shares, and the hidden states and working set of a step; it is
checked before anything is allocated, so an impossible policy fails in a second, not an hour in.
"""

import dataclasses
import math
import re
import shutil
from collections import Counter

import numpy as np
import psutil
import torch

from flexh2o.offload.offload_dir import existing_ancestor
from flexh2o.common.errors import UsageError
from flexh2o.kv import POLICIES, budget, cache_bytes, slot_bytes
from flexh2o.kv.compressed import working_bytes
from flexh2o.kv.home import IN_FLIGHT, batch_split, cpu_attention_dtype
from flexh2o.host.devices import default_dtype
from flexh2o.host.hardware import LOCAL, load_profile
from flexh2o.host.memory_limit import process_limit
from flexh2o.common.names import tier_label
from flexh2o.host.process_memory import DEFAULT_GROWTH, Growth, process_growth
from flexh2o.models.attention import PROBS_CHUNK_BYTES, observed_chunk_bytes
from flexh2o.compression.gguf_blocks import BLOCK_BYTES, SIXTEEN_BIT, applies, keeps_16_bit, keeps_low_bit
from flexh2o.compression.gpu_dequant import WORKSPACE_BYTES
from flexh2o.compression.quant import BLOCK_VALUES, compressible, stored_row_bytes
from flexh2o.offload.placed import split_rows
from flexh2o.compression.kernel_choice import multiplied_as_stored
from flexh2o.offload.held_weights import most_held

GB = 1 << 30
# CUDA memory outside torch's allocator: the context, then the kernels loaded lazily as first used.
# The free memory read on a device comes after its context exists; a profile's total comes before.
CUDA_CONTEXT_BYTES = 512 << 20
CUDA_LAZY_KERNELS_BYTES = 256 << 20
# Inside the allocator (so in the projection checked against its reserved peak): cuBLAS's and
# cuBLASLt's workspaces, made per (handle, stream) that multiplies: the compute thread's.
CUBLAS_WORKSPACE_BYTES = 64 << 20
IO_THREADS = 2             # Tiers' default I/O threads that load, and as many that store
DTYPE_OF = {2: torch.float16, 4: torch.float32}  # a run's dtype from its size (2 bytes: float16 on CUDA)
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": GB, "gb": GB, "gib": GB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str, flag: str) -> int:
    """'16GB', '512MiB', '1.5g' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise UsageError(flag, f"expected a size such as 16GB or 512MB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def capacities(device: torch.device, offload_dir: str | None, gpu_mem=None, cpu_mem=None, disk_mem=None,
               max_memory=None, dtype: str | None = None, growth: Growth | None = None) -> dict:
    """Bytes each tier may use: the caps given, else what the machine reports free; "ram", the
    memory free now, which the gpu and cpu tiers share when the CPU computes (measured once, before
    anything is loaded, so a later check does not count the loaded weights twice), within the
    process's memory limit where one applies (its cgroup's, or max_memory: "limit", memory_limit.py);
    "given", the tiers whose cap was given (a tier over a given cap is blamed on its --<tier>-mem flag);
    "process", its RSS now; and "growth", what it may grow by beyond the projection (host/process_memory.py)
    for a run in `dtype` (default: the device's) with torch's threads, unless `growth` is given."""
    limit = process_limit(max_memory)
    available = psutil.virtual_memory().available
    if limit is not None:
        available = max(0, min(available, limit.room))
    given = tuple(tier for tier, cap in (("gpu", gpu_mem), ("cpu", cpu_mem), ("disk", disk_mem)) if cap is not None)
    if gpu_mem is None:
        gpu_mem = torch.cuda.mem_get_info(device)[0] - outside_allocator(True) if device.type == "cuda" else available
    if disk_mem is None:
        disk_mem = shutil.disk_usage(existing_ancestor(offload_dir)).free if offload_dir else 0
    return {"gpu": gpu_mem, "cpu": available if cpu_mem is None else cpu_mem, "disk": disk_mem, "ram": available,
            "given": given, "limit": limit, "process": psutil.Process().memory_info().rss,
            "growth": growth if growth is not None else local_growth(device, dtype)}


def local_growth(device: torch.device, dtype: str | None) -> Growth:
    """The process growth the local profile calibrated for this run's dtype and torch's threads."""
    try:
        profile = load_profile(LOCAL)
    except UsageError:
        profile = None
    if profile is not None and profile.device != device.type:
        profile = None
    if dtype is None:
        dtype = str(default_dtype(device)).removeprefix("torch.")
    return process_growth(profile, dtype, torch.get_num_threads())


def growth_bytes(caps: dict) -> int:
    growth = caps.get("growth")
    return DEFAULT_GROWTH if growth is None else growth.bytes


def outside_allocator(context_exists: bool) -> int:
    """GPU memory a run takes outside torch's allocator, beyond what was free when read."""
    return CUDA_LAZY_KERNELS_BYTES + (0 if context_exists else CUDA_CONTEXT_BYTES)


_PREPARED = {}  # (layer class, weight shapes, formats) -> the (shape, format) of each tensor prepare() makes


def cat_shapes(shapes: list[tuple]) -> tuple:
    """The shape torch.cat (along dim 0) makes of tensors of these shapes. (Meta tensors would do,
    but their cat pulls in torch._dynamo: 75 MB the pre-flight's own process does not need.)"""
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def cat_formats(formats: list) -> str | None:
    """The format quant.join gives Packed weights of these formats (None: not kept as stored)."""
    return formats[0] if len(set(formats)) == 1 else None


def stored_formats(layer, dtype_bytes: int, policy) -> list[tuple]:
    """(shape, format) of each tensor a layer places (after prepare): its format as stored where not
    in the run's width: "groups" (compress_weight: quant.py's), or the checkpoint's own low-bit or
    16-bit blocks where gguf_blocks.applies; None in the run's width."""
    key = type(layer), tuple(shape for _, shape in layer.weight_specs()), layer.stored_formats()
    if key not in _PREPARED:
        _PREPARED[key] = list(zip(layer.prepare([tuple(s) for s in key[1]], cat=cat_shapes),
                                  layer.prepare(list(key[2]), cat=cat_formats)))
    out, sixteen_bit = [], keeps_16_bit(policy, dtype_bytes)
    low_bit = policy.compress_weight or keeps_low_bit(dtype_bytes)
    for shape, fmt in _PREPARED[key]:
        compressed = policy.compress_weight and compressible(shape)
        kept = fmt if dtype_bytes == 4 and applies(fmt, compressible(shape), sixteen_bit, low_bit) else None
        out.append((shape, kept or ("groups" if compressed else None)))
    return out


def stored_shapes(layer, dtype_bytes: int, policy) -> list[tuple]:
    """(shape, compressed, bytes of a row as stored) of each tensor a layer places (after prepare);
    compressed: not in the run's width (stored_formats)."""
    return [(shape, fmt is not None, stored_row_bytes(shape, dtype_bytes, fmt is not None, fmt or "groups"))
            for shape, fmt in stored_formats(layer, dtype_bytes, policy)]


def layer_bytes(layers, dtype_bytes: int, policy) -> list[int]:
    """Bytes each layer's weights take as stored (compressed ones as their 4-bit groups)."""
    return [sum(shape[0] * rb for shape, _, rb in stored_shapes(layer, dtype_bytes, policy)) for layer in layers]


def weight_need(layers, dtype_bytes: int, policy, device) -> dict:
    """The weights' shares per tier, plus their compute copies on the gpu tier."""
    need = {"gpu": 0, "cpu": 0, "disk": 0}
    for placed in per_layer(layers, lambda layer: split_as_placed(layer, dtype_bytes, policy)):
        for _, _, rb, rows in placed:  # whole rows per tier, as placed (not the percentages themselves)
            for tier in need:
                need[tier] += rows[tier] * rb
    need["gpu"] += compute_copy_bytes(layers, dtype_bytes, policy, device)
    if device.type == "cuda":  # disk reads go through pinned staging blocks (cuda_io.py)
        need["cpu"] += (IO_THREADS + 1) * largest_disk_segment(layers, dtype_bytes, policy)
    return need


def per_layer(layers, fn) -> list:
    """fn(layer) for every layer, computed once per kind: layers with the same weight shapes are alike."""
    kinds = {}
    out = []
    for layer in layers:
        kind = tuple(shape for _, shape in layer.weight_specs()), layer.stored_formats()
        if kind not in kinds:
            kinds[kind] = fn(layer)
        out.append(kinds[kind])
    return out


def split_as_placed(layer, dtype_bytes: int, policy):
    """(shape, compressed, row bytes, rows per tier) of each tensor, split as init_weight splits."""
    stored = stored_shapes(layer, dtype_bytes, policy)
    splits = split_rows([shape for shape, _, _ in stored], [rb for _, _, rb in stored], *layer.weight_shares(policy))
    return [(*item, rows) for item, rows in zip(stored, splits)]


def largest_disk_segment(layers, dtype_bytes: int, policy) -> int:
    """Bytes of the largest run of rows any weight keeps on disk."""
    placed = per_layer(layers, lambda layer: split_as_placed(layer, dtype_bytes, policy))
    return max(rows["disk"] * rb for tensors in placed for _, _, rb, rows in tensors)


def buffered(layer, dtype_bytes: int, policy, device) -> Counter:
    """The pooled compute buffers a layer's weight loads take, as (kind, bytes) -> count: every
    weight the layer cannot use in place, and every compressed one (dequantized into a buffer,
    its groups first moved into one unless they are on the compute device), but the LM head's
    where the kernel multiplies it at every row count (kernel_choice.multiplied_as_stored)."""
    out = Counter()
    placed = split_as_placed(layer, dtype_bytes, policy)
    formats = stored_formats(layer, dtype_bytes, policy)
    for (shape, compressed, rb, rows), (_, fmt) in list(zip(placed, formats))[layer.gathered:]:
        whole = [tier for tier, n in rows.items() if n == shape[0]]
        in_place = bool(whole) and (whole[0] == "gpu" or (whole[0] == "cpu" and device.type == "cpu"))
        as_stored = compressed and layer.one_of_a_kind and multiplied_as_stored(shape, DTYPE_OF[dtype_bytes],
                                                                         device.type == "cpu", fmt)
        if (compressed or not in_place) and not as_stored:
            out[("values", shape), math.prod(shape) * dtype_bytes] += 1
        if compressed and not in_place:
            out[("groups", shape), shape[0] * rb] += 1
    return out


def compute_copy_bytes(layers, dtype_bytes: int, policy, device) -> int:
    """Bytes of the pooled compute buffers. The pool keeps buffers per shape, and at any time the
    layer computing, the next one loading and any loaded ahead (offload/held_weights.py) hold one
    each, so a shape needs as many buffers as such a group ever holds. On CUDA a buffer
    of groups goes back as soon as its dequantizing is queued, on its I/O thread: one per thread is made;
    where the CPU computes, the compute thread dequantizes when it waits, so they count as values
    do (weight_io.py)."""
    counts = per_layer(layers, lambda layer: buffered(layer, dtype_bytes, policy, device))
    most = most_held(counts, layers)
    for key in most:
        if key[0][0] == "groups" and device.type == "cuda":
            most[key] = IO_THREADS
    return sum(nbytes * count for (_, nbytes), count in most.items())


def load_transient(layers, dtype_bytes: int, policy) -> int:
    """Host memory loading takes beyond the placed weights, at its peak: one layer's tensors as read
    (in the run's width, weights.py, or as stored where kept so: gguf_blocks.applies), the
    concatenations prepare() makes of them, with compress_weight the layer's groups and a block's
    float32 temporaries, in a 16-bit run the float32 copy a GGUF file's low-bit matrix is dequantized
    into before it is narrowed (one at a time), and the tensors not in the run's width of the two
    layers before, which may still be being written (weight_io.py)."""
    def nbytes(shape, fmt):  # as stored
        return shape[0] * stored_row_bytes(shape, dtype_bytes, fmt is not None, fmt or "groups")

    def layer(layer):
        sixteen_bit, read, widened = keeps_16_bit(policy, dtype_bytes), 0, 0
        low_bit = policy.compress_weight or keeps_low_bit(dtype_bytes)
        for (_, shape), fmt in zip(layer.weight_specs(), layer.stored_formats()):
            as_stored = dtype_bytes == 4 and applies(fmt, compressible(shape), sixteen_bit, low_bit)
            read += nbytes(shape, fmt if as_stored else None)
            if dtype_bytes < 4 and fmt in BLOCK_BYTES and fmt not in SIXTEEN_BIT:
                widened = max(widened, math.prod(shape) * 4)
        shapes = [tuple(shape) for _, shape in layer.weight_specs()]
        stored = stored_formats(layer, dtype_bytes, policy)
        # A concatenation of kept blocks is made as stored; one to quantize, in the run's width.
        made = sum(nbytes(shape, None if fmt == "groups" else fmt) for shape, fmt in stored if shape not in shapes)
        quantized = sum(nbytes(shape, fmt) for shape, fmt in stored if fmt == "groups")
        not_run_width = sum(nbytes(shape, fmt) for shape, fmt in stored if fmt is not None)
        return read + made + widened + (quantized + 8 * BLOCK_VALUES if quantized else 0), not_run_width
    held = per_layer(layers, layer)
    return max(h + sum(g for _, g in held[max(i - 2, 0): i]) for i, (h, _) in enumerate(held))


def with_loading(need: dict, run: dict, transient, on_cuda: bool) -> dict:
    """`need` (weights and run together) with what loading needs beyond the run's host share: while
    the weights load, the run's cache and buffers do not exist yet, but one layer's tensors do."""
    host = run["cpu"] if on_cuda else run["gpu"] + run["cpu"]
    return {**need, "cpu": need["cpu"] + np.maximum(transient - host, 0)}


def projected_need(spec, layers, policy, dtype_bytes: int, prompt_len: int, gen_len: int, device,
                   weights: dict | None = None) -> dict:
    """What the pre-flight checks: the weights (`weights`, their weight_need, if known), one generate
    call's cache, activations and working set, and loading's transient beyond those."""
    weights = weights if weights is not None else weight_need(layers, dtype_bytes, policy, device)
    run = run_need(spec, policy, dtype_bytes, prompt_len, gen_len, device)
    return with_loading(add(weights, run), run, load_transient(layers, dtype_bytes, policy), device.type == "cuda")


def run_need(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, device,
             output_scores: bool = False, io_threads: int = IO_THREADS) -> dict:
    """Cache, activations and working set of one generate call."""
    b, nb = policy.gpu_batch_size, policy.num_gpu_batches
    on_cuda = device.type == "cuda"
    rows = batch_split(b, policy.cache_gpu_percent, policy.cache_cpu_percent)
    # One sequence's cache in one layer, as stored (a spec may count no layer: a slice without attention).
    per_row = cache_bytes(dataclasses.replace(spec, num_layers=1), policy, 1, prompt_len, gen_len, dtype_bytes)
    need = {tier: rows[tier] * per_row * nb * spec.num_layers for tier in rows}
    # Parts a step loads into pooled compute buffers (kv/home.py): IN_FLIGHT sets of each, plus a
    # slot-major block of K per I/O thread; on CUDA a CPU part under cpu_cache_compute is loaded
    # for the prompt only, but its buffers stay pooled. A compressed home the compute device reads
    # is attended in place, dequantized a block at a time (kv/compressed.py).
    loaded = rows["disk"] + (rows["cpu"] if on_cuda else 0)
    capacity, _ = budget(policy, prompt_len, gen_len)
    k_values = capacity * spec.num_kv_heads * spec.head_dim * dtype_bytes  # K of one sequence, computed on
    k_bytes = capacity * spec.num_kv_heads * slot_bytes(spec, policy, dtype_bytes)  # as stored
    state = per_row - 2 * k_bytes
    disk_state = rows["disk"] * state * nb * spec.num_layers  # a disk part's positions and scores: in CPU memory
    need["disk"] -= disk_state
    need["cpu"] += disk_state
    if on_cuda and policy.cpu_cache_compute:  # the CPU-attended part may be held in a wider dtype
        wider = cpu_attention_dtype(DTYPE_OF[dtype_bytes]).itemsize - dtype_bytes
        need["cpu"] += rows["cpu"] * nb * spec.num_layers * 2 * k_bytes * wider // dtype_bytes
    need["gpu"] += IN_FLIGHT * loaded * (2 * k_values + state)
    moved = [n for n in (rows["disk"], 0 if policy.cpu_cache_compute else rows["cpu"] if on_cuda else 0) if n]
    need["gpu"] += io_threads * sum(n * k_bytes for n in set(moved))
    wide = home_value_bytes(policy, dtype_bytes)
    if on_cuda and (rows["cpu"] or rows["disk"]):  # pinned staging blocks: a K part, as it goes home
        need["cpu"] += (io_threads + 1) * max(rows["cpu"] * wide // dtype_bytes, rows["disk"]) * k_bytes
    if policy.compress_cache:  # loaded parts' K and V groups on their way home; the working copies of one block
        need["gpu"] += IN_FLIGHT * loaded * 2 * k_bytes + working_bytes(device)
    hidden = spec.hidden_bytes(b, prompt_len, dtype_bytes)
    # The prompt's attention works in blocks: fused kernels, or (observed, for a policy that scores
    # keys) a chunk of logits, probabilities and weighted probabilities at once.
    observed = POLICIES[policy.kv_policy].uses_attention
    attention = observed_chunk_bytes(b * spec.num_heads, prompt_len, dtype_bytes) if observed else \
        min(b * spec.num_heads * prompt_len * prompt_len * 4, PROBS_CHUNK_BYTES)
    working = (b * prompt_len * (3 * spec.hidden_size + spec.mlp_working_width) * dtype_bytes + attention
               + b * spec.vocab_size * 4)
    if observed:  # the observed prompt attention reshapes q, k, v: copies
        working += hidden
    need["gpu"] += working + nb * b * prompt_len * prompt_len  # every gpu-batch's prompt mask (bool) exists at once
    need["gpu"] += prompt_copy_home_bytes(spec, policy, dtype_bytes, prompt_len, gen_len, device, io_threads)
    if policy.act_gpu_percent == 100 or nb == 1:
        need["gpu"] += nb * hidden
    else:  # parked in CPU memory; on the device the one computing, the one loading, and up to two storing
        need["gpu"] += min(4, nb) * hidden
        need["cpu"] += nb * hidden
    if output_scores:  # one [batch, vocab] float32 row of logits per generated token, kept in CPU memory
        need["cpu"] += gen_len * nb * b * spec.vocab_size * 4
    if on_cuda:
        need["gpu"] += CUBLAS_WORKSPACE_BYTES
        # Weights (wherever they are) and loaded cache parts are dequantized on the load stream, in one
        # workspace where Triton is missing (gpu_dequant.py; with it, nothing: counted all the same).
        if policy.compress_weight or (policy.compress_cache and loaded):
            need["gpu"] += WORKSPACE_BYTES
        if spec.num_kv_heads != spec.num_heads:  # a padded prompt's attention expands K and V (attention.py)
            need["gpu"] += 2 * b * spec.num_heads * prompt_len * spec.head_dim * dtype_bytes
    return need


def home_value_bytes(policy, dtype_bytes: int) -> int:
    """Bytes per value of the cache on its way home: the CPU-attended cache's dtype under
    cpu_cache_compute (possibly wider than the run's), else the run's."""
    return cpu_attention_dtype(DTYPE_OF[dtype_bytes]).itemsize if policy.cpu_cache_compute else dtype_bytes


def prompt_copy_home_bytes(spec, policy, dtype_bytes: int, prompt_len: int, gen_len: int, device,
                           io_threads: int = IO_THREADS) -> int:
    """On CUDA the prompt's K or V goes home (CPU memory or disk) through a contiguous copy on the
    device, one per store thread, in the CPU-attended cache's dtype where that is wider: of the
    slots kept (an evicting policy keeps its capacity, fewer than the prompt). A compressed cache's
    groups go instead (counted with the loaded parts' groups)."""
    rows = batch_split(policy.gpu_batch_size, policy.cache_gpu_percent, policy.cache_cpu_percent)
    if device.type != "cuda" or policy.compress_cache or not (rows["cpu"] or rows["disk"]):
        return 0
    capacity, _ = budget(policy, prompt_len, gen_len)
    wide = home_value_bytes(policy, dtype_bytes)
    slots = min(prompt_len, capacity) * spec.num_kv_heads * slot_bytes(spec, policy, dtype_bytes)
    return io_threads * max(rows["cpu"], rows["disk"]) * slots * wide // dtype_bytes


def format_size(n: float) -> str:
    """Bytes in a unit that shows them: 326.43 GB, 5.00 MB, 12.0 KB, 700 bytes."""
    for unit, size in (("TB", 1 << 40), ("GB", GB), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def check_fits(need: dict, caps: dict, device, flag: str = "--percent"):
    """Refuses, in one line with both numbers, a policy some tier cannot hold. The error names the
    tier's --<tier>-mem flag where that cap was given, else `flag` (the placement's)."""
    for tier in ("gpu", "cpu", "disk"):
        if need[tier] > caps[tier]:
            given = tier in caps.get("given", ())
            raise UsageError(f"--{tier}-mem" if given else flag,
                             f"the policy needs {format_size(need[tier])} on the {tier_label(tier, device.type)} "
                             "tier, which holds "
                             f"{format_size(caps[tier])} ({holds(tier, given, caps.get('limit'), device)})")
    if device.type == "cpu":
        growth = growth_bytes(caps)
        ram = (caps.get("ram") or psutil.virtual_memory().available) - growth
        if need["gpu"] + need["cpu"] > ram:
            limit = caps.get("limit")
            under = f", under the memory limit of {limit.describe()}" if limit is not None else ""
            raise UsageError(flag, f"the policy needs {format_size(need['gpu'] + need['cpu'])} of memory "
                             f"(the compute device (CPU) and cpu tiers are both RAM here), {format_size(max(ram, 0))} "
                             "is available "
                             f"(free memory less {format_size(growth)} for the process's own growth{under})")


def holds(tier: str, given: bool, limit, device) -> str:
    """Where a tier's capacity came from, for an error line."""
    if given:
        return f"--{tier}-mem"
    if limit is not None and (tier == "cpu" or device.type == "cpu" and tier == "gpu"):  # RAM, within the limit
        return f"free within the memory limit of {limit.describe()}"
    return "detected"


def add(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
