"""How busy the machine's CPUs are: the CPU time every process and this one have run, and the share
of all cores other processes kept busy over a while. Torch-free: host/thread_waiting.py reads it as
`import flexh2o` runs, before torch loads (psutil, 22 ms to import, only off Linux)."""

import os
import time


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process has run since boot, CPU seconds this one and its finished children
    have run): a profile's probes run as children, and the C kernels' build too."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat", encoding="ascii") as f:
            own = [int(v) for v in f.read().rsplit(")", 1)[1].split()[11:15]]  # utime stime cutime cstime
    except (OSError, ValueError, IndexError):
        return _cpu_seconds_psutil()
    idle = sum(fields[3:5])  # idle, iowait
    guests = sum(fields[8:10])  # already counted in user and nice
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle - guests) / ticks, sum(own) / ticks


def _cpu_seconds_psutil() -> tuple[float, float]:
    import psutil
    system, own = psutil.cpu_times(), psutil.Process().cpu_times()
    guests = getattr(system, "guest", 0.0) + getattr(system, "guest_nice", 0.0)
    idle = system.idle + getattr(system, "iowait", 0.0)
    return sum(system) - guests - idle, own.user + own.system + own.children_user + own.children_system


class LoadMeter:
    """How busy the machine was from its creation until result(): the 1-minute load average at both
    ends, and the share of all cores that other processes kept busy (this process excluded)."""

    def __init__(self):
        self.start_wall, self.start_cpu, self.start_load = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]

    def result(self) -> dict:
        return {"loadavg_1min": [round(self.start_load, 2), round(os.getloadavg()[0], 2)],
                "others_cpu_share": round(self.others_share(), 3)}

    def others_share(self) -> float:
        (all_now, own_now), (all_then, own_then) = cpu_seconds(), self.start_cpu
        wall = max(time.perf_counter() - self.start_wall, 1e-9)
        return max(0.0, (all_now - all_then - (own_now - own_then)) / (wall * (os.cpu_count() or 1)))


def others_cpu_share(seconds: float = 0.5) -> float:
    """The share of all cores other processes keep busy now, over `seconds`."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.others_share()
