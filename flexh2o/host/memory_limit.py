"""The memory the whole process may use, where something other than free RAM bounds it.

Containers and batch schedulers put a process in a memory cgroup and kill it past the limit,
whatever the machine has free. So the limit is read from the process's own cgroup (v2
`memory.max`, v1 `memory.limit_in_bytes`), the tightest on its path up to the root, and what the
run may still add is the limit less what the cgroup uses now (this process so far included).
`--max-memory SIZE` gives a budget for the process itself instead (less what it already holds);
where both apply, the smaller room wins.
"""

import functools
import os
from dataclasses import dataclass

import psutil

from flexh2o.host.cgroups import cgroup_directories

UNLIMITED = 1 << 62  # v1 reports "no limit" as a number near 2^63


@dataclass(frozen=True)
class MemoryLimit:
    limit: int   # bytes
    room: int    # bytes the process may still add now
    source: str  # where the limit came from: a cgroup file, or --max-memory

    def describe(self) -> str:
        return f"{self.limit / (1 << 30):.2f} GB ({self.source})"


@functools.lru_cache(maxsize=None)
def process_limit(max_memory: int | None = None, proc_cgroup: str = "/proc/self/cgroup",
                  root: str = "/sys/fs/cgroup") -> MemoryLimit | None:
    """The limit that leaves the process the least room: its cgroup's, or max_memory; None if neither.
    Measured once per process, the first time it is asked for (before a model is loaded): a later
    pre-flight of the same run must not count what the run itself has loaded since as used."""
    return limit_now(max_memory, proc_cgroup, root)


def limit_now(max_memory: int | None = None, proc_cgroup: str = "/proc/self/cgroup",
              root: str = "/sys/fs/cgroup") -> MemoryLimit | None:
    """process_limit as it stands now, read again at every call (the profile's measurements, which
    free what each one made before the next)."""
    limits = [cgroup_limit(proc_cgroup, root)]
    if max_memory is not None:
        used = psutil.Process().memory_info().rss
        limits.append(MemoryLimit(max_memory, max_memory - used, "--max-memory"))
    limits = [limit for limit in limits if limit is not None]
    return min(limits, key=lambda limit: limit.room) if limits else None


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> MemoryLimit | None:
    """The tightest memory limit on this process's cgroup path (v2, or v1's memory controller)."""
    found = []
    for directory, kind in cgroup_directories("memory", proc_cgroup, root):
        limit_file, usage_file = (("memory.max", "memory.current") if kind == "cgroup v2"
                                  else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        limit, usage = _read(os.path.join(directory, limit_file)), _read(os.path.join(directory, usage_file))
        if limit is not None and limit < UNLIMITED and usage is not None:
            found.append(MemoryLimit(limit, limit - usage, f"{kind} {os.path.join(directory, limit_file)}"))
    return min(found, key=lambda limit: limit.room) if found else None


def _read(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None
