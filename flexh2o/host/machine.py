"""What machine a figure was measured on: CPU, cores, memory, GPU (through pynvml), torch, and
how busy other processes kept it meanwhile."""

import os
import platform
import time

import psutil
import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without it torch's
    bfloat16 matrix products ran 300x slower than float32 (AVX2 EPYC: 0.2 against 68 GFLOP/s)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_compute_dtype() -> torch.dtype:
    """The 16- or 32-bit float this CPU computes fastest in (float16 is slow on every CPU)."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def gpus() -> list[dict]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no NVIDIA driver: the usual case on a CPU machine
        return []
    try:
        found = []
        for n in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(n)
            name = pynvml.nvmlDeviceGetName(handle)
            found.append({"name": name.decode() if isinstance(name, bytes) else name,
                          "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).total})
        return found
    finally:
        pynvml.nvmlShutdown()


def describe_machine() -> dict:
    return {
        "cpu": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpus": gpus(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process has run, CPU seconds this one and its finished children have run)
    since boot or start: a profile's probes run as children, and the C kernels' build too."""
    system, own = psutil.cpu_times(), psutil.Process().cpu_times()
    guests = getattr(system, "guest", 0.0) + getattr(system, "guest_nice", 0.0)  # already counted in user, nice
    idle = system.idle + getattr(system, "iowait", 0.0)
    return sum(system) - guests - idle, own.user + own.system + own.children_user + own.children_system


class LoadMeter:
    """How busy the machine was from its creation until result(): the 1-minute load average at both
    ends, and the share of all cores that other processes kept busy (this process excluded)."""

    def __init__(self):
        self.start_wall, self.start_cpu, self.start_load = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]

    def result(self) -> dict:
        (all_now, own_now), (all_then, own_then) = cpu_seconds(), self.start_cpu
        wall = max(time.perf_counter() - self.start_wall, 1e-9)
        others = (all_now - all_then - (own_now - own_then)) / (wall * psutil.cpu_count())
        return {"loadavg_1min": [round(self.start_load, 2), round(os.getloadavg()[0], 2)],
                "others_cpu_share": round(max(0.0, others), 3)}


def others_cpu_share_now(seconds: float = 0.5) -> float:
    """The share of all cores other processes keep busy now, over `seconds`."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.result()["others_cpu_share"]
