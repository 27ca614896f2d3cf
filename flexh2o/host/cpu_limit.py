"""How many CPUs the process may use, and torch's threads sized to them.

torch starts a thread per core it sees (its affinity mask), but a container's CPU quota (`docker
--cpus 4` on a 64-core host) is not a mask: 64 threads then share 4 CPUs' worth of time, and each
parallel operation waits for its slowest thread, which the quota keeps stopped. So the count is the
smaller of the affinity mask and the tightest quota on the process's cgroup path (v2 `cpu.max`, v1
`cpu.cfs_quota_us` over `cpu.cfs_period_us`), rounded up: a quota stops all of a cgroup's threads
together, so a part CPU is worth a thread.
"""

import math
import os

import torch

from flexh2o.host.cgroups import cgroup_directories


def usable_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: its affinity mask, within its cgroup's CPU quota."""
    try:
        mask = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        mask = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, root)
    return max(1, min(mask, math.ceil(quota))) if quota is not None else max(1, mask)


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The tightest CPU quota on this process's cgroup path, in CPUs (1.5: one and a half CPUs'
    time per period); None where no cgroup on the path sets one."""
    found = [(_v2_quota if kind == "cgroup v2" else _v1_quota)(directory)
             for directory, kind in cgroup_directories("cpu", proc_cgroup, root)]
    found = [quota for quota in found if quota is not None]
    return min(found) if found else None


def _v2_quota(directory: str) -> float | None:
    fields = (_read(os.path.join(directory, "cpu.max")) or "").split()
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit() or int(fields[1]) == 0:
        return None  # "max 100000": no quota
    return int(fields[0]) / int(fields[1])


def _v1_quota(directory: str) -> float | None:
    quota, period = _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(os.path.join(directory, "cpu.cfs_period_us"))
    if quota is None or period is None or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None  # -1: no quota
    return int(quota) / int(period)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def fit_threads() -> int:
    """Lowers torch's threads to the CPUs the process may use where it has more (never raises a
    count someone chose lower); returns the count now in force."""
    usable = usable_cpus()
    if torch.get_num_threads() > usable:
        torch.set_num_threads(usable)
    return torch.get_num_threads()
