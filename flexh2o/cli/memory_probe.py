"""`python -m flexh2o.cli.memory_probe --dtype D --threads T --offload-dir DIR [--probe LABEL]`:
one probe of profiling/memory_growth.py in this interpreter, or (without --probe) all of them, each
in a fresh one. Prints the growth in bytes as JSON."""

if __name__ == "__main__":
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse
import json
import os
import sys

from flexh2o.host.process_memory import read_status, reset_peak
from flexh2o.profiling.memory_growth import PROBE_BATCH, PROBE_CONFIG, PROBE_GEN, PROBE_PROMPT, PROBES, calibrate


def probe(label: str, dtype: str, offload_dir: str) -> int:
    """Runs one probe in this process; its peak RSS beyond the RSS at the pre-flight and the projection."""
    import importlib
    import tempfile

    import torch
    importlib.import_module("flexh2o.cli.run_main")  # what a run imports is in use before its pre-flight, as here
    from flexh2o.engine.engine import Engine
    from flexh2o.engine.policy import Policy
    from flexh2o.runs.prompts import synthetic_prompts
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
    p = argparse.ArgumentParser(prog="python -m flexh2o.cli.memory_probe", description=__doc__)
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
