"""Measuring what a run grows by beyond the pre-flight's projection (host/process_memory.py).

Each probe runs in a fresh interpreter (`python -m flexh2o.cli.memory_probe`): a small model in one
placement of a matrix (in memory, on disk, several gpu-batches, H2O, compressed), reporting its peak
RSS beyond its RSS at the pre-flight plus the projection. flexh2o.profile stores the largest.
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
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the probes run from here


def calibrate(dtype: str, threads: int, offload_dir: str, log=None, quick: bool = False) -> int:
    """The largest growth of the probes, each in a fresh interpreter with `threads` torch threads
    (quick: the first probe only)."""
    worst = 0
    for label in list(PROBES)[:1] if quick else PROBES:
        cmd = [sys.executable, "-m", "flexh2o.cli.memory_probe", "--dtype", dtype, "--threads", str(threads),
               "--offload-dir", offload_dir, "--probe", label]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"the memory probe '{label}' failed: {done.stderr.strip().splitlines()[-1:]}")
        growth = json.loads(done.stdout.strip().splitlines()[-1])["growth_bytes"]
        if log:
            log(f"  process growth, {label}: {growth / (1 << 20):.0f} MB")
        worst = max(worst, growth)
    return worst
