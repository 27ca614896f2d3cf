"""What machine a figure was measured on: CPU, cores, memory, GPU (through pynvml), torch (how
busy other processes kept it meanwhile: host/cpu_load.py)."""

import platform

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


