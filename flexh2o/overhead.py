"""The process's own memory: what a run grows by beyond the pre-flight's projection.

The pre-flight projects weights, cache, buffers and working sets; the process also holds what no
projection lists: allocator slack (small freed blocks the allocator keeps, one arena per thread;
large ones go back to the system, malloc.py), the math libraries' scratch per thread, I/O thread
stacks, and the dirty pages of buffered writes, which a memory cgroup charges to the process until
they reach the disk. The interpreter, torch, the tokenizer and whatever else the run loaded before
its pre-flight are in use when the free memory (or a limit's room) is read: not counted again.

`python -m flexh2o.overhead --dtype D --threads T --offload-dir DIR` measures the growth: each
probe runs in a fresh interpreter, a small model in one placement of a matrix (in memory, on disk,
several gpu-batches, H2O, compressed), and reports its peak RSS beyond its RSS at the pre-flight
plus the projection. flexh2o.profile stores the largest per dtype and thread count; the pre-flight
uses it (`process_growth`), or DEFAULT_GROWTH where the profile has no figure for the run.
"""

if __name__ == "__main__":
    from flexh2o.signals import stop_at_once
    stop_at_once()

import argparse
import json
import os
import subprocess
import sys
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


# -- calibration -------------------------------------------------------------------------------

def calibrate(dtype: str, threads: int, offload_dir: str, log=None, quick: bool = False) -> int:
    """The largest growth of the probes, each in a fresh interpreter with `threads` torch threads
    (quick: the first probe only)."""
    worst = 0
    for label in list(PROBES)[:1] if quick else PROBES:
        cmd = [sys.executable, "-m", "flexh2o.overhead", "--dtype", dtype, "--threads", str(threads),
               "--offload-dir", offload_dir, "--probe", label]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        if done.returncode != 0:
            raise RuntimeError(f"the memory probe '{label}' failed: {done.stderr.strip().splitlines()[-1:]}")
        growth = json.loads(done.stdout.strip().splitlines()[-1])["growth_bytes"]
        if log:
            log(f"  process growth, {label}: {growth / (1 << 20):.0f} MB")
        worst = max(worst, growth)
    return worst


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


def probe(label: str, dtype: str, offload_dir: str) -> int:
    """Runs one probe in this process; its peak RSS beyond the RSS at the pre-flight and the projection."""
    import importlib
    import tempfile

    import torch
    importlib.import_module("flexh2o.run")  # what a run imports is in use before its pre-flight, as here
    from .engine import Engine
    from .policy import Policy
    from .prompts import synthetic_prompts
    torch.set_grad_enabled(False)
    kw = dict(PROBES[label])
    (w_gpu, w_cpu), (c_gpu, c_cpu) = kw.pop("w", (100, 0)), kw.pop("cache", (100, 0))
    policy = Policy(PROBE_BATCH // kw.get("num_gpu_batches", 1), w_gpu_percent=w_gpu, w_cpu_percent=w_cpu,
                    cache_gpu_percent=c_gpu, cache_cpu_percent=c_cpu, **kw)
    ids, mask = synthetic_prompts(PROBE_BATCH, PROBE_PROMPT, PROBE_CONFIG["vocab_size"], 0)
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(PROBE_CONFIG, f)
        reset_peak()
        start = read_status("VmRSS")
        with Engine.from_pretrained(model, policy=policy, device="cpu", dtype=getattr(torch, dtype), dummy=True,
                                    offload_dir=offload_dir, prompt_len=PROBE_PROMPT, gen_len=PROBE_GEN) as engine:
            loading = read_status("VmHWM") - start - engine.weight_need["gpu"] - engine.weight_need["cpu"] \
                - engine.load_transient
            reset_peak()
            engine.generate(ids, mask, max_new_tokens=PROBE_GEN, eos_token_id=None)
            running = read_status("VmHWM") - start - engine.projected["gpu"] - engine.projected["cpu"]
            return max(0, loading, running)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexh2o.overhead", description=__doc__.split("\n\n")[2].strip())
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--offload-dir", required=True)
    p.add_argument("--probe", choices=sorted(PROBES), help="run this probe here (else all, each in a fresh interpreter)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps({"probe": args.probe, "growth_bytes": probe(args.probe, args.dtype, args.offload_dir)}))
    else:
        print(json.dumps({"growth_bytes": calibrate(args.dtype, args.threads, args.offload_dir, print)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
