"""Timing on the machine at hand: the sizes a measurement uses, a call's median seconds, and work
done beside compute as the engine's I/O threads do it (for measure.py)."""

import dataclasses
import itertools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch

MIN_TIMING = 0.02     # seconds; a shorter call is repeated within one timed run


@dataclass(frozen=True)
class Sizes:
    matmul_k: int
    matmul_n: int
    attention_seq: int
    kv_bytes: int          # K and V together, read by one decode attention call
    copy_bytes: int        # one CPU memcpy or host-device copy
    disk_bytes: int        # the largest file written and read
    disk_chunk: int        # bytes per read or write call, about what the engine reads at once
    dequant_rows: int      # of DEQUANT_WIDTH values
    trial_target: float    # seconds of one call that a trial sizes a measurement for
    max_call: float        # seconds past which the matmul table stops (once it has MIN_MATMUL_ROWS)
    disk_seconds: float    # seconds a file write is sized for
    timing_budget: float   # seconds the timed runs of one measurement may take together
    repeats: int           # timed runs at most
    stream_bytes: int      # weights the matmul table cycles through
    attention_bytes: int   # the tensors of one prompt attention measurement


CPU_SIZES = Sizes(matmul_k=1024, matmul_n=4096, attention_seq=512, kv_bytes=256 << 20, copy_bytes=256 << 20,
                  disk_bytes=512 << 20, disk_chunk=4 << 20, dequant_rows=1024, trial_target=0.4, max_call=0.75,
                  disk_seconds=1.0, timing_budget=2.0, repeats=7, stream_bytes=256 << 20, attention_bytes=1 << 30)
CUDA_SIZES = Sizes(matmul_k=8192, matmul_n=8192, attention_seq=2048, kv_bytes=2 << 30, copy_bytes=512 << 20,
                   disk_bytes=512 << 20, disk_chunk=64 << 20, dequant_rows=4096, trial_target=0.4, max_call=0.75,
                   disk_seconds=1.0, timing_budget=2.0, repeats=7, stream_bytes=1 << 30, attention_bytes=1 << 30)
QUICK_CPU_SIZES = Sizes(matmul_k=256, matmul_n=1024, attention_seq=128, kv_bytes=8 << 20, copy_bytes=8 << 20,
                        disk_bytes=8 << 20, disk_chunk=2 << 20, dequant_rows=64, trial_target=0.02, max_call=0.04,
                        disk_seconds=0.05, timing_budget=0.1, repeats=3, stream_bytes=8 << 20,
                        attention_bytes=1 << 30)
QUICK_CUDA_SIZES = Sizes(matmul_k=2048, matmul_n=2048, attention_seq=512, kv_bytes=64 << 20, copy_bytes=64 << 20,
                         disk_bytes=8 << 20, disk_chunk=2 << 20, dequant_rows=512, trial_target=0.02, max_call=0.04,
                         disk_seconds=0.05, timing_budget=0.1, repeats=3, stream_bytes=64 << 20,
                         attention_bytes=1 << 30)


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda":
        return QUICK_CUDA_SIZES if quick else CUDA_SIZES
    return QUICK_CPU_SIZES if quick else CPU_SIZES


# Where a memory limit applies, the bytes one measurement's largest buffer may take, of the room left
# under it: the memory copy beside compute holds three such at once (source, destination and the
# weights the compute streams), and the rest is for the process's own growth.
ROOM_SHARE = 1 / 8


def within(sizes: Sizes, room: int | None) -> Sizes:
    """`sizes`, with every buffer a measurement makes at once held to ROOM_SHARE of `room`, the bytes
    the process may still add under its memory limit (None: no limit applies)."""
    if room is None:
        return sizes
    most = max(1 << 20, int(room * ROOM_SHARE))
    return dataclasses.replace(sizes, **{name: min(getattr(sizes, name), most) for name in
                                         ("kv_bytes", "copy_bytes", "disk_bytes", "stream_bytes", "attention_bytes")})


def synchronizer(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn, sync, calls: int = 1) -> float:
    """Seconds per call over `calls` calls in a row."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def trial_seconds(fn, sync) -> float:
    """One call after a warm-up call: enough to size a measurement."""
    timed(fn, sync)
    return timed(fn, sync)


def seconds_per_call(fn, sync, sizes: Sizes) -> float:
    """The median seconds of a call after a warm-up call, over as many timed runs (1 to sizes.repeats)
    as fit sizes.timing_budget."""
    first = trial_seconds(fn, sync)
    calls = max(1, int(MIN_TIMING / max(first, 1e-9)))
    runs = max(1, min(sizes.repeats, int(sizes.timing_budget / (first * calls))))
    times = [first] if calls == 1 else []
    times += [timed(fn, sync, calls) for _ in range(runs - len(times))]
    return statistics.median(times)


def scaled_size(trial_size: int, trial: float, target: float, largest: int) -> int:
    """The size a call of `target` seconds covers at the rate a trial of `trial_size` ran, within [1, largest]."""
    return max(1, min(largest, int(trial_size * target / max(trial, 1e-9))))


def random_tensor(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)


def affordable_bytes(nbytes: int, device: torch.device) -> int:
    """nbytes, or a quarter of the memory free on `device` where that is less."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    return max(1 << 20, min(nbytes, free // 4))


def beside_compute(fn, device: torch.device, sizes: Sizes):
    """fn() on a thread of its own while, where the CPU computes, the main thread multiplies as a
    decode step does: what the engine's I/O threads get done beside compute. On this project's
    2-core VM a thread copying memory beside compute ran at 4.4-9 GB/s against 10 alone, and 16-64 MB
    disk reads at 0.6-1.05 GB/s against 0.9-1.25. (On a GPU the compute leaves the CPU alone: fn runs alone.)"""
    if device.type != "cpu":
        return fn()
    x, weights = random_tensor((8, sizes.matmul_k), torch.float32, device), streamed_weights(sizes)
    with ThreadPoolExecutor(1, thread_name_prefix="flexh2o-profile-beside") as pool:
        running = pool.submit(fn)
        for w in itertools.cycle(weights):
            if running.done():
                return running.result()
            torch.nn.functional.linear(x, w)


def streamed_weights(sizes: Sizes, dtype=torch.float32, device=torch.device("cpu")) -> list:
    """[N, K] matrices covering sizes.stream_bytes. A decode step streams every weight once, so
    consecutive products use different matrices, well past the caches: one matrix used again and
    again stayed in the CPU's cache and looked 3x faster at few rows than the engine's products ran."""
    k, n = sizes.matmul_k, sizes.matmul_n
    copies = max(1, -(-sizes.stream_bytes // (k * n * dtype.itemsize)))
    return [random_tensor((n, k), dtype, device) for _ in range(copies)]
