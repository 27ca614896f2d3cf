"""Measures the machine at hand into a HardwareProfile (run by python -m flexh2o.profile).

Each figure comes from one small function. A timing (timing.py) is the median of a few timed runs
after a warm-up run, synchronized on CUDA; a call shorter than MIN_TIMING is repeated within one run.
Sizes come from a short trial wherever a dtype may be slow: bfloat16 products on a CPU without
native bfloat16 ran ~300x slower than float32 (0.2 against 68 GFLOP/s on an AVX2 EPYC), so a size
that takes float32 a tenth of a second would take bfloat16 half a minute.
"""

import dataclasses
import datetime
import itertools
import os
import queue
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

from flexh2o.common.messages import say
from flexh2o.offload.disk import ALIGN, MEMORY, DiskStore
from flexh2o.offload.offload_dir import existing_ancestor
from flexh2o.engine.engine import Engine
from flexh2o.host.devices import default_dtype
from flexh2o.kv.home import cpu_attention_dtype
from flexh2o.host.cpu_limit import fit_threads
from flexh2o.host.cpu_load import LoadMeter
from flexh2o.host.machine import cpu_has_native_bf16, cpu_model
from flexh2o.engine.preflight import capacities
from flexh2o.profiling.memory_growth import calibrate
from flexh2o.models.opt import OPTSpec
from flexh2o.engine.policy import Policy
from flexh2o import native
from flexh2o.compression import int4_tiles
from flexh2o.compression.grouped_weight import GroupedWeight
from flexh2o.compression.quant import dequantize, packed_bytes, quantize
from flexh2o.compression.kernel_choice import MAX_ROWS, kernel_for
from flexh2o.profiling.link import link_rate
from flexh2o.offload.tiers import Tiers, copy_in_memory
from flexh2o.checkpoints.weights import DummyWeights
from flexh2o.planning.attention_costs import DECODE_BATCH, HEAD_DIM, HEADS, measure_attention_costs
from flexh2o.host.hardware import BUSY_SHARE, LOCAL, HardwareProfile
from flexh2o.host.memory_limit import limit_now, process_limit
from flexh2o.host.process_memory import Growth
from flexh2o.profiling.timing import (Sizes, affordable_bytes, beside_compute, random_tensor, scaled_size, seconds_per_call,
                     sizes_for, streamed_weights, synchronizer, trial_seconds, within)

# Every power of two where decode batches lie: interpolating 8 rows between 4 and 16 (in log rows)
# gave 37 GFLOP/s on a 2-core Xeon that multiplies 8 rows at 26, and decode predictions 1.4x fast.
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
MIN_MATMUL_ROWS = 5   # row counts measured even for the slowest dtype
DECODE_ROWS = 32      # (sequence, head) pairs of the decode attention measurement
DISK_THREADS = 2      # as many as the engine's I/O threads
DISK_REPEATS = 5      # files written and read at most (each sized for disk_seconds)
DEQUANT_WIDTH = 4096
TINY_OPT = OPTSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, ffn_dim=256, vocab_size=1000,
                   max_positions=128)
TINY_PROMPT, TINY_NEW_TOKENS = 8, 17


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- compute ------------------------------------------------------------------------------------

def matmul_table(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> dict:
    """FLOP/s of [rows, K] @ [K, N] by rows."""
    weights = streamed_weights(sizes, dtype, device)
    return rows_table(MATMUL_ROWS, weights, torch.nn.functional.linear, device, dtype, sizes, sync)


def rows_table(row_counts, weights: list, product, device: torch.device, dtype: torch.dtype, sizes: Sizes,
               sync) -> dict:
    """FLOP/s of product(x [rows, K], weight) by rows, each call on the next of `weights` ([N, K]
    each, cycled). A slow product stops once the next row count, at the rate of the last, would take
    longer than sizes.max_call."""
    k, n = sizes.matmul_k, sizes.matmul_n
    table, rate = {}, None
    for rows in row_counts:
        flop = 2 * rows * k * n
        if len(table) >= MIN_MATMUL_ROWS and flop / rate > sizes.max_call:
            break
        x = random_tensor((rows, k), dtype, device)
        turn = itertools.cycle(weights)
        rate = flop / seconds_per_call(lambda: product(x, next(turn)), sync, sizes)
        table[str(rows)] = rate
    return table


def int4_matmul_table(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> dict | None:
    """FLOP/s of [rows, K] times a 4-bit [N, K] weight multiplied as stored, by rows up to its kernel's
    limit (kernel_choice.py); None where no kernel takes `dtype` here. The weights cycle through
    sizes.stream_bytes of groups, as matmul_table's do."""
    k, n = sizes.matmul_k, sizes.matmul_n
    kernel = kernel_for((n, k), dtype, device.type == "cpu", native.library() is not None)
    if kernel is None:
        return None
    weights = []
    for _ in range(max(1, -(-sizes.stream_bytes // packed_bytes((n, k))))):
        groups = quantize(random_tensor((n, k), torch.float32, device), check=False)
        weights.append(int4_tiles.TiledWeight(int4_tiles.pack(groups, k), k, None) if kernel == "tiles"
                       else GroupedWeight(groups, k, None))
    return rows_table([r for r in MATMUL_ROWS if r <= MAX_ROWS[kernel]], weights, lambda x, w: w.matmul(x),
                      device, dtype, sizes, sync)


def prompt_products(heads: int, seq: int, dtype: torch.dtype, device: torch.device):
    """A call of the prompt's two attention products, Q K^T and P V, over `heads` (sequence, head) pairs."""
    q, k, v = (random_tensor((heads, seq, HEAD_DIM), dtype, device) for _ in range(3))
    probs = random_tensor((heads, seq, seq), dtype, device).softmax(-1)
    scores = torch.empty(heads, seq, seq, dtype=dtype, device=device)
    out = torch.empty(heads, seq, HEAD_DIM, dtype=dtype, device=device)
    return lambda: (torch.bmm(q, k.transpose(1, 2), out=scores), torch.bmm(probs, v, out=out))


def attention_rate(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> float:
    """FLOP/s of the prompt's attention products; the head count comes from a one-head trial."""
    seq = sizes.attention_seq
    per_head = (2 * seq * seq + 4 * seq * HEAD_DIM) * dtype.itemsize  # scores and P; q, k, v and the output
    most_heads = max(1, min(256, affordable_bytes(sizes.attention_bytes, device) // per_head))
    trial = trial_seconds(prompt_products(1, seq, dtype, device), sync)
    heads = scaled_size(1, trial, sizes.trial_target, most_heads)
    seconds = seconds_per_call(prompt_products(heads, seq, dtype, device), sync, sizes)
    return heads * 2 * (2 * seq * seq * HEAD_DIM) / seconds


def decode_step(slots: int, dtype: torch.dtype, device: torch.device):
    """A call of one decode step's attention over `slots` cached tokens of DECODE_ROWS (sequence, head) pairs."""
    k, v = (random_tensor((DECODE_ROWS, slots, HEAD_DIM), dtype, device) for _ in range(2))
    q = random_tensor((DECODE_ROWS, 1, HEAD_DIM), dtype, device)

    def step():
        # K q^T, as models/attention.py computes it: on a CPU that streams K's rows in order
        logits = torch.matmul(k, q.transpose(1, 2)).transpose(1, 2).float()
        return torch.matmul(torch.softmax(logits, -1).to(dtype), v)
    return step


def decode_bandwidth(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> float:
    """Bytes/s of K and V that decode attention reads; the slot count comes from a trial on 1/16 of them."""
    slot_bytes = 2 * DECODE_ROWS * HEAD_DIM * dtype.itemsize
    most_slots = max(16, affordable_bytes(sizes.kv_bytes, device) // slot_bytes)
    trial_slots = most_slots // 16
    trial = trial_seconds(decode_step(trial_slots, dtype, device), sync)
    slots = max(trial_slots, scaled_size(trial_slots, trial, sizes.trial_target, most_slots))
    return slots * slot_bytes / seconds_per_call(decode_step(slots, dtype, device), sync, sizes)


def dequant_kernel(device: torch.device) -> str:
    """What dequantizes on `device`: flexh2o's C kernels where the CPU computes and has them, its Triton
    kernel on CUDA where Triton works (gpu_dequant.py), else torch."""
    if device.type == "cuda":
        from flexh2o.compression import gpu_dequant
        return "triton" if gpu_dequant.kernel() is not None else "torch"
    return "native" if device.type == "cpu" and native.library() is not None else "torch"


def dequant_rate(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> float:
    """Values/s that flexh2o.compression.quant.dequantize turns from 4-bit groups into `dtype` on `device`."""
    rows = sizes.dequant_rows
    packed = quantize(random_tensor((rows, DEQUANT_WIDTH), torch.float32, device), check=False)
    out = torch.empty(rows, DEQUANT_WIDTH, dtype=dtype, device=device)
    return rows * DEQUANT_WIDTH / seconds_per_call(lambda: dequantize(packed, DEQUANT_WIDTH, out=out), sync, sizes)


# -- memory ------------------------------------------------------------------------------------

def memcpy_rate(sizes: Sizes) -> float:
    """Bytes/s of a CPU copy as an I/O thread makes it where the CPU computes: tiers.copy_in_memory,
    beside compute (each byte counted once)."""
    cpu = torch.device("cpu")
    nbytes = affordable_bytes(sizes.copy_bytes, cpu)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return nbytes / beside_compute(lambda: seconds_per_call(lambda: copy_in_memory(dst, src), lambda: None, sizes),
                                   cpu, sizes)


def cuda_copy_rates(device: torch.device, sizes: Sizes, sync) -> dict:
    """Bytes/s of host-device copies, from and to pinned and pageable host memory."""
    nbytes = affordable_bytes(sizes.copy_bytes, device)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for suffix, pinned in (("", True), ("_pageable", False)):
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        rates["h2d" + suffix] = nbytes / seconds_per_call(lambda: gpu.copy_(host, non_blocking=pinned), sync, sizes)
        rates["d2h" + suffix] = nbytes / seconds_per_call(lambda: host.copy_(gpu, non_blocking=pinned), sync, sizes)
    return rates


# -- disk --------------------------------------------------------------------------------------

def write_file(store: DiskStore, pool, data: torch.Tensor, chunks: int):
    """A new file of `chunks` copies of data, written by the pool's threads and synced; (file, seconds)."""
    f = store.create(chunks * data.numel())
    start = time.perf_counter()
    list(pool.map(lambda offset: store.write(f, offset, data), range(0, f.nbytes, data.numel())))
    os.fdatasync(f.fd)
    return f, time.perf_counter() - start


def read_file(store: DiskStore, pool, f, buffers: queue.Queue, chunk: int) -> float:
    """Seconds to read the whole file in chunks (each into a free one of `buffers`), by the pool's threads."""
    def read_chunk(offset):
        out = buffers.get()
        try:
            store.read(f, offset, out)
        finally:
            buffers.put(out)
    start = time.perf_counter()
    list(pool.map(read_chunk, range(0, f.nbytes, chunk)))
    return time.perf_counter() - start


def disk_chunk_and_size(store: DiskStore, sizes: Sizes) -> tuple[int, int]:
    """The chunk and the largest file, shrunk where the disk has less than four files' worth free."""
    largest = min(sizes.disk_bytes, shutil.disk_usage(store.dir).free // 4)
    chunk = min(sizes.disk_chunk, largest // (2 * DISK_THREADS) // ALIGN * ALIGN)
    return max(ALIGN, chunk), largest


def disk_rates(offload_dir: str, sizes: Sizes, log, device: torch.device) -> tuple[float, float]:
    """(read, write) bytes/s of the engine's disk store with the page cache bypassed, DISK_THREADS
    threads reading or writing chunks at once, beside compute on `device`. The file size comes from
    a trial of one chunk per thread."""
    return beside_compute(lambda: _disk_rates(offload_dir, sizes, log), device, sizes)


def _disk_rates(offload_dir: str, sizes: Sizes, log) -> tuple[float, float]:
    store = DiskStore(offload_dir, bypass_page_cache=True)
    try:
        if store.page_cache == MEMORY:
            log(f"note: {offload_dir} is on tmpfs: the disk figures measure memory")
        chunk, largest = disk_chunk_and_size(store, sizes)
        data = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
        buffers = queue.Queue()
        for _ in range(DISK_THREADS):
            buffers.put(torch.zeros(chunk, dtype=torch.uint8))
        with ThreadPoolExecutor(DISK_THREADS, thread_name_prefix="flexh2o-profile-io") as pool:
            f, trial = write_file(store, pool, data, DISK_THREADS)  # also the warm-up
            read_file(store, pool, f, buffers, chunk)
            store.remove(f)
            chunks = scaled_size(DISK_THREADS, trial, sizes.disk_seconds, max(1, largest // chunk))
            reads, writes = [], []
            for _ in range(min(sizes.repeats, DISK_REPEATS)):
                f, seconds = write_file(store, pool, data, chunks)
                writes.append(seconds)
                reads.append(read_file(store, pool, f, buffers, chunk))
                store.remove(f)
        nbytes = chunks * chunk
        return nbytes / statistics.median(reads), nbytes / statistics.median(writes)
    finally:
        store.close()


# -- the engine --------------------------------------------------------------------------------

def tiny_engine(device: torch.device, dtype: torch.dtype) -> Engine:
    """TINY_OPT with dummy weights, everything on the compute device (Engine.from_pretrained takes
    a preset name or a checkpoint directory, not a spec)."""
    policy = Policy(gpu_batch_size=1)
    source = DummyWeights(seed=0)
    layers = TINY_OPT.build_layers()
    tiers = Tiers(device, dtype, overlap=policy.overlap)
    try:
        for layer in layers:
            layer.init_weight(source, tiers, policy)
    except BaseException:
        tiers.close()
        raise
    # The growth the pre-flight allows a run is no concern of a measurement's (the default, before the
    # profile has calibrated it, is half of a 1 GB container).
    caps = capacities(device, None, growth=Growth(0, "a measurement's own engine"))
    return Engine(TINY_OPT, layers, policy, tiers, source.describe(), caps)


def layer_overhead(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> float:
    """Seconds per (layer, gpu-batch) call of the tiny OPT's decode steps (full cache), whose
    arithmetic is negligible: what a call costs beyond its arithmetic and I/O."""
    ids = torch.randint(3, TINY_OPT.vocab_size, (1, TINY_PROMPT))
    engine = tiny_engine(device, dtype)

    def per_layer_call():
        engine.generate(ids, max_new_tokens=TINY_NEW_TOKENS, eos_token_id=None)
        stats = engine.last_stats
        return stats.decode_seconds / ((stats.steps_done - 1) * len(engine.layers))
    try:
        per_layer_call()  # warm-up
        return statistics.median(per_layer_call() for _ in range(sizes.repeats))
    finally:
        engine.close()


def attention_costs(device: torch.device, dtype: torch.dtype, sizes: Sizes, sync) -> dict:
    """The engine's attention calls, fitted (attention_costs.py); the decode calls read up to sizes.kv_bytes."""
    slots = max(64, affordable_bytes(sizes.kv_bytes, device)
                // (2 * DECODE_BATCH * HEADS * HEAD_DIM * dtype.itemsize))
    return measure_attention_costs(lambda fn: seconds_per_call(fn, sync, sizes), dtype, device,
                                   sizes.attention_seq, slots, sizes.stream_bytes)


# The link's two interpreters (spawned, with torch and gloo): 221 MB of RSS each, 146 MB of it their own.
LINK_ROOM = 512 << 20


def link_within(quick: bool, log, max_memory: int | None) -> float | None:
    """link_rate, where the memory left under a limit holds its two interpreters; else None, with one
    line saying so."""
    limit = limit_now(max_memory)
    if limit is not None and limit.room < LINK_ROOM:
        log(f"note: the link between processes is not measured: its two interpreters take about {LINK_ROOM >> 20} MB, "
            f"and {max(0, limit.room) >> 20} MB is left under the memory limit of {limit.describe()}; pipeline stages "
            "measure it when they plan (flexh2o.plan: --link-bandwidth)")
        return None
    return logged(log, "link between processes", link_rate, quick)


# -- the profile -------------------------------------------------------------------------------

def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (host: {cpu_model()})"
    return cpu_model()


def source_line(device: torch.device, quick: bool) -> str:
    line = f"measured by python -m flexh2o.profile on {machine_name(device)}, {datetime.date.today().isoformat()}"
    return line + (" with --quick (small sizes: rough figures)" if quick else "")


def process_growth(device: torch.device, offload_dir: str, quick: bool, log,
                   max_memory: int | None = None) -> dict | None:
    """What a run's process grows by beyond its projection, per dtype, at torch's thread count
    (host/process_memory.py); where the CPU computes, as only there do the tiers share the process's memory.
    The default dtype, and bfloat16 where the CPU computes it natively: elsewhere its probes took over a
    minute, for runs no one makes (the pre-flight allows its default growth there). quick: one probe,
    of the default dtype. A dtype whose probes could not all be measured is left out (its default applies)."""
    if device.type != "cpu":
        return None
    threads = torch.get_num_threads()
    dtypes = [default_dtype(device)] + ([torch.bfloat16] if not quick and cpu_has_native_bf16() else [])
    table = {}
    for d in dtypes:
        growth = calibrate(dtype_name(d), threads, offload_dir, log, quick, max_memory)
        if growth is not None:
            table[dtype_name(d)] = {str(threads): growth}
    return table or None


def matmul_dtypes(device: torch.device) -> tuple:
    return (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float32, torch.bfloat16)


def warn_if_others_were_busy(others: float, log):
    """torch's threads wait on each other when another process takes a core: figures measured meanwhile
    came out up to 30x low (the engine's per-layer overhead most of all)."""
    if others > BUSY_SHARE:
        log(f"note: other processes kept {others:.0%} of the CPU busy while measuring: the figures may come out "
            "low; the profile is marked, and measured again by the first run that finds the machine quiet")


def logged(log, what: str, fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    log(f"profile: {what} measured in {time.perf_counter() - start:.1f} s")
    return value


def measure(device: torch.device, offload_dir: str, quick: bool = False, log=say,
            max_memory: int | None = None) -> HardwareProfile:
    """Measures this machine with `device` computing and disk files in `offload_dir`. quick: small
    sizes, well under a minute in all, rough figures (for tests). Every measurement is sized to the
    memory the process may use: free memory, within its memory cgroup's limit or `max_memory`
    (bytes, --max-memory)."""
    device = torch.device(device)
    fit_threads()  # the threads runs will use
    meter, start = LoadMeter(), time.perf_counter()
    with torch.no_grad():
        profile = _measure(device, offload_dir, quick, log, max_memory)
    # The measurement's engines read the memory limit's room while measuring: the run's pre-flight
    # reads it again, as it stands before the run loads anything (memory_limit.process_limit).
    process_limit.cache_clear()
    others = meter.result()["others_cpu_share"]
    warn_if_others_were_busy(others, log)
    profile = dataclasses.replace(profile, measure_seconds=time.perf_counter() - start)
    # A quick profile's figures are rough anyway (tests): it is not marked for measuring again.
    return profile if quick else dataclasses.replace(profile, others_cpu_share=others)


def _measure(device: torch.device, offload_dir: str, quick: bool, log, max_memory: int | None) -> HardwareProfile:
    cpu = torch.device("cpu")
    dtype = default_dtype(device)
    limit = limit_now(max_memory)
    room = None if limit is None else limit.room
    if limit is not None:
        log(f"note: measuring within the memory limit of {limit.describe()}: {max(0, room) >> 20} MB left to use")
    # On CUDA the device's own sizes are held to its free memory (affordable_bytes), not to the host's limit.
    sizes, host_sizes = within(sizes_for(device, quick), room if device.type == "cpu" else None), \
        within(sizes_for(cpu, quick), room)
    sync = synchronizer(device)
    ram = psutil.virtual_memory().total
    disk_free = shutil.disk_usage(existing_ancestor(offload_dir)).free  # before the trial files take any
    matmul = {dtype_name(d): logged(log, f"matmul {dtype_name(d)}", matmul_table, device, d, sizes, sync)
              for d in matmul_dtypes(device)}
    attention = {dtype_name(d): logged(log, f"attention {dtype_name(d)}", attention_rate, device, d, sizes, sync)
                 for d in matmul_dtypes(device)}
    int4 = {dtype_name(d): logged(log, f"4-bit matmul {dtype_name(d)}", int4_matmul_table, device, d, sizes, sync)
            for d in matmul_dtypes(device)}
    bandwidth = logged(log, "decode attention", decode_bandwidth, device, dtype, sizes, sync)
    if device.type == "cuda":
        cpu_bandwidth = logged(log, "decode attention on the CPU", decode_bandwidth, cpu,
                               cpu_attention_dtype(dtype), host_sizes, lambda: None)
        copies = logged(log, "host-device copies", cuda_copy_rates, device, sizes, sync)
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    else:
        cpu_bandwidth = bandwidth
        copies = dict.fromkeys(("h2d", "d2h", "h2d_pageable", "d2h_pageable"), 0.0)
        gpu_mem = ram
    disk_read, disk_write = logged(log, "disk", disk_rates, offload_dir, host_sizes, log, device)
    overhead = logged(log, "layer overhead", layer_overhead, device, dtype, sizes)
    growth = logged(log, "process growth", process_growth, device, offload_dir, quick, log, max_memory)
    calls = logged(log, "attention calls", attention_costs, device, dtype, sizes, sync)
    return HardwareProfile(
        name=LOCAL, source=source_line(device, quick), device=device.type, dtype=dtype_name(dtype),
        gpu_mem=gpu_mem, cpu_mem=ram, disk_mem=disk_free, matmul_flops=matmul, attention_flops=attention,
        device_bandwidth=bandwidth, cpu_attention_bandwidth=cpu_bandwidth, **copies,
        memcpy=logged(log, "memcpy", memcpy_rate, host_sizes), disk_read=disk_read, disk_write=disk_write,
        dequant=logged(log, "dequantize", dequant_rate, device, dtype, sizes, sync),
        dequant_kernel=dequant_kernel(device), kernels_build=native.build() if device.type == "cpu" else None,
        int4_matmul_flops={d: t for d, t in int4.items() if t} or None,
        layer_overhead=overhead, attention_costs=calls, process_growth=growth,
        link_bandwidth=link_within(quick, log, max_memory))
