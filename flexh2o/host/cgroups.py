"""The cgroup directories that bound this process: its own and every one above it, for cgroup v2
and for one v1 controller; memory_limit.py and cpu_limit.py read their limits there."""

import os


def cgroup_directories(controller: str, proc_cgroup: str = "/proc/self/cgroup",
                       root: str = "/sys/fs/cgroup") -> list[tuple[str, str]]:
    """(directory, "cgroup v2" or "cgroup v1") of the process's cgroup and each above it, under v2
    (on a hybrid system, maybe under unified/) and under v1's `controller` mount; none where
    `proc_cgroup` cannot be read."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            bases, kind = [root, os.path.join(root, "unified")], "cgroup v2"
        elif controller in controllers.split(","):
            bases, kind = sorted({os.path.join(root, controller), os.path.join(root, controllers)}), "cgroup v1"
        else:
            continue
        names = [p for p in path.split("/") if p]
        found += [(os.path.join(base, *names[:depth]), kind)
                  for base in bases for depth in range(len(names), -1, -1)]
    return found
