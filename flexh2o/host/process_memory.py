"""The process's own memory: what a run grows by beyond the pre-flight's projection.

The pre-flight projects weights, cache, buffers and working sets; the process also holds what no
projection lists: allocator slack (small freed blocks the allocator keeps, one arena per thread;
large ones go back to the system, malloc.py), the math libraries' scratch per thread, I/O thread
stacks, and the dirty pages of buffered writes, which a memory cgroup charges to the process until
they reach the disk. The interpreter, torch, the tokenizer and whatever else the run loaded before
its pre-flight are in use when the free memory (or a limit's room) is read: not counted again.

flexh2o.profile measures the growth (profiling/memory_growth.py) and stores the largest per dtype
and thread count; the pre-flight uses it (`process_growth`), or DEFAULT_GROWTH where the profile
has no figure for the run.
"""

from dataclasses import dataclass

# Where no calibration applies: the most scripts/bench_memory_limit.py measured before malloc.py
# (0.40 GB of peak RSS beyond the projection, opt-125m in cgroups of 1-3 GB), rounded up.
DEFAULT_GROWTH = 512 << 20
# A measured growth is used with this margin on top, and never below FLOOR: runs vary, the probes
# do not see a run's outputs, report or Python objects, and being killed costs more than a slightly
# smaller batch.
MARGIN = 1.5
FLOOR = 64 << 20
# Bytes of buffered writes the kernel holds dirty before a run flushes them (disk.py flushes at this
# many under a memory limit); one such window per I/O thread and the compute thread. Small, as the
# allowance comes out of the batch's memory: a decode step's new cache slots are few (OPT-125M,
# batch 64, all on disk: 4.7 MB a step), and flushing 8 MB at a time cost nothing measurable (that
# run, 32 + 48 under --max-memory: decode 192 and 195 tok/s with 8 MB, 189 and 198 with 32).
DIRTY_WINDOW = 8 << 20

@dataclass(frozen=True)
class Growth:
    bytes: int
    source: str  # how it was found: calibrated for which dtype and threads, or why the default applies


def process_growth(profile, dtype: str, threads: int, io_threads: int = 2) -> Growth:
    """What the pre-flight allows the process beyond its projection, for a run in `dtype` with
    `threads` torch threads: the profile's calibration with MARGIN (for these threads, else for the
    fewest more: growth is per-thread arenas and scratch, so more threads bound fewer; a torchrun
    world gives each process one thread), else DEFAULT_GROWTH; plus the dirty pages buffered
    writes may hold."""
    dirty = (io_threads + 1) * DIRTY_WINDOW
    table = {} if profile is None else {int(t): n for t, n in (profile.process_growth or {}).get(dtype, {}).items()}
    more = sorted(t for t in table if t >= threads)
    if not more:
        why = "no local profile" if profile is None else f"the profile has no calibration for {dtype}, {threads} threads"
        return Growth(DEFAULT_GROWTH + dirty, f"default: {why}")
    measured = table[more[0]]
    return Growth(max(int(measured * MARGIN), FLOOR) + dirty, f"calibrated for {dtype}, {more[0]} threads: "
                  f"{measured >> 20} MB x{MARGIN} (at least {FLOOR >> 20} MB), + {dirty >> 20} MB dirty pages")


def read_status(field: str) -> int:
    """A /proc/self/status figure (kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak():
    """Makes VmHWM (the peak RSS) start again from the RSS now (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
