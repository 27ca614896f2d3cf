"""Measuring what a run grows by beyond the pre-flight's projection (host/process_memory.py).

Each probe runs in a fresh interpreter (`python -m flexh2o.cli.memory_probe`): a small model in one
placement of a matrix (in memory, on disk, several gpu-batches, H2O, compressed), reporting its peak
RSS beyond its RSS at the pre-flight plus the projection. flexh2o.profile stores the largest.

A probe sizes itself to the memory the process may use (free memory, within a memory cgroup's limit
or --max-memory): the largest of its sizes whose projection takes at most PROBE_SHARE of it, the
rest left for the growth it measures. Where a probe cannot be measured (not even its smallest size
fits, or it failed), its dtype is left uncalibrated, so the pre-flight allows the default growth,
and one line says so.
"""

import json
import os
import subprocess
import sys

# The probes: (label, engine keywords). Each runs in its own interpreter.
PROBES = {
    "in memory": dict(),
    "on disk, 2 gpu-batches": dict(w=(0, 0), cache=(0, 0), num_gpu_batches=2),
    "split, H2O": dict(w=(30, 20), cache=(50, 0), kv_policy="h2o", hh_ratio=0.2, recent_ratio=0.2),
    "compressed, on disk": dict(w=(0, 0), cache=(0, 0), compress_weight=True, compress_cache=True),
}
PROBE_CONFIG = {"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
                "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048}  # opt-125m's widths, 4 layers
PROBE_BATCH, PROBE_PROMPT, PROBE_GEN = 16, 256, 8
# Where the full probe does not fit: (batch, prompt, layers, vocabulary), largest first, opt-125m's
# widths kept. The vocabulary and the layers shrink first: they set the weights' size (the embedding
# and head take 154 MB each in float32), not a step's working set, where the growth comes from.
SMALLER = ((16, 256, 4, 8192), (16, 256, 2, 8192), (8, 256, 2, 8192), (8, 128, 1, 8192), (4, 64, 1, 8192),
           (2, 32, 1, 8192))
# The share of the memory the process may use that a probe's projection may take; the rest is for
# what it grows by (in float32 with 2 threads, 54 MB beside the full probe's 656 MB projection; in a
# 1 GB cgroup, sized down to 200-410 MB, 0-25 MB).
PROBE_SHARE = 0.5
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the probes run from here


def probe_policy(label: str, batch: int):
    """The policy of probe `label` for `batch` sequences."""
    from flexh2o.engine.policy import Policy
    kw = dict(PROBES[label])
    (w_gpu, w_cpu), (c_gpu, c_cpu) = kw.pop("w", (100, 0)), kw.pop("cache", (100, 0))
    return Policy(batch // kw.get("num_gpu_batches", 1), w_gpu_percent=w_gpu, w_cpu_percent=w_cpu,
                  cache_gpu_percent=c_gpu, cache_cpu_percent=c_cpu, **kw)


def probe_size(label: str, dtype_bytes: int, room: int, full: tuple) -> tuple[tuple | None, int]:
    """(batch, prompt, config) of the largest size of probe `label` whose projection takes at most
    PROBE_SHARE of `room` bytes, or None; and the projection of the size taken, else of the smallest.
    `full`: the full probe's (batch, prompt, config)."""
    import torch

    from flexh2o.engine.preflight import projected_need
    from flexh2o.models import spec_from_config
    sizes = [full] + [(batch, prompt, {**full[2], "num_hidden_layers": layers, "vocab_size": vocab})
                      for batch, prompt, layers, vocab in SMALLER]
    need = 0
    for batch, prompt, config in sizes:
        spec = spec_from_config(config, "the memory probe", "probe", "--probe")
        tiers = projected_need(spec, spec.build_layers(), probe_policy(label, batch), dtype_bytes, prompt,
                               PROBE_GEN, torch.device("cpu"))
        need = int(tiers["gpu"] + tiers["cpu"])
        if need <= room * PROBE_SHARE:
            return (batch, prompt, config), need
    return None, need


def calibrate(dtype: str, threads: int, offload_dir: str, log=None, quick: bool = False,
              max_memory: int | None = None) -> int | None:
    """The largest growth of the probes, each in a fresh interpreter with `threads` torch threads
    (quick: the first probe only); None where one could not be measured (a line to `log` says which
    and why). max_memory: the bytes this process may use (--max-memory), shared with each probe."""
    import psutil

    from flexh2o.host.process_memory import DEFAULT_GROWTH
    log = log or (lambda line: None)
    worst = 0
    for label in list(PROBES)[:1] if quick else PROBES:
        cmd = [sys.executable, "-m", "flexh2o.cli.memory_probe", "--dtype", dtype, "--threads", str(threads),
               "--offload-dir", offload_dir, "--probe", label]
        if max_memory is not None:  # this process waits while its probe runs: the probe has the rest
            cmd += ["--max-memory", str(max(0, max_memory - psutil.Process().memory_info().rss))]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        result, why = probe_result(done)
        if why is not None:
            log(f"note: process growth, {dtype}: the memory probe '{label}' could not be measured ({why}): runs in "
                f"{dtype} allow the default growth, {DEFAULT_GROWTH >> 20} MB")
            return None
        growth = result["growth_bytes"]
        smaller = f" (a smaller probe, {result['size']}, to fit {result['room_bytes'] >> 20} MB free)" \
            if result["smaller"] else ""
        log(f"  process growth, {label}: {growth / (1 << 20):.0f} MB{smaller}")
        worst = max(worst, growth)
    return worst


def probe_result(done: subprocess.CompletedProcess) -> tuple[dict | None, str | None]:
    """(the probe's JSON, None), or (None, why it measured nothing)."""
    if done.returncode < 0:
        return None, f"killed by signal {-done.returncode}" + (", as a memory limit's out-of-memory killer does"
                                                              if done.returncode == -9 else "")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return None, last[0]
    result = json.loads(lines[-1])
    if result["growth_bytes"] is None:
        return None, result["why"]
    return result, None
