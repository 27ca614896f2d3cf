"""`python -m flexh2o.cli.memory_probe --dtype D --threads T --offload-dir DIR [--probe LABEL] [--max-memory BYTES]`:
one probe of profiling/memory_growth.py in this interpreter, or (without --probe) all of them, each
in a fresh one. Prints the growth in bytes as JSON (null where the probe could not run, and why)."""

if __name__ == "__main__":
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse
import json
import os
import sys

from flexh2o.host.process_memory import Growth, read_status, reset_peak
from flexh2o.profiling.memory_growth import (PROBE_BATCH, PROBE_CONFIG, PROBE_GEN, PROBE_PROMPT, PROBES, calibrate,
                                             probe_policy, probe_size)


def probe(label: str, dtype: str, offload_dir: str, max_memory: int | None = None) -> dict:
    """Runs one probe in this process, at the largest size the memory it may use holds: "growth_bytes",
    its peak RSS beyond the RSS at the pre-flight and the projection (None where no size fits: "why"),
    "size" and "smaller" (whether it is smaller than the full probe), "room_bytes"."""
    import importlib
    import tempfile

    import torch
    importlib.import_module("flexh2o.cli.run_main")  # what a run imports is in use before its pre-flight, as here
    from flexh2o.engine.engine import Engine
    from flexh2o.engine.preflight import capacities, format_size
    from flexh2o.runs.prompts import synthetic_prompts
    torch.set_grad_enabled(False)
    room = capacities(torch.device("cpu"), None, max_memory=max_memory)["ram"]
    full = (PROBE_BATCH, PROBE_PROMPT, PROBE_CONFIG)
    size, need = probe_size(label, getattr(torch, dtype).itemsize, room, full)
    if size is None:
        return {"probe": label, "growth_bytes": None, "room_bytes": room,
                "why": f"its smallest size needs {format_size(need)}, more than half of the {format_size(room)} the "
                       "process may use"}
    batch, prompt, config = size
    ids, mask = synthetic_prompts(batch, prompt, config["vocab_size"], 0)
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(config, f)
        reset_peak()
        start = read_status("VmRSS")
        # The growth is what this measures: the pre-flight allows none beyond the projection.
        with Engine.load(model, probe_policy(label, batch), device="cpu", dtype=getattr(torch, dtype), dummy=True,
                         offload_dir=offload_dir, max_memory=max_memory, prompt_len=prompt, gen_len=PROBE_GEN,
                         growth=Growth(0, "the memory probe measures it")) as engine:
            loading = read_status("VmHWM") - start - engine.weight_need["gpu"] - engine.weight_need["cpu"] \
                - engine.load_transient
            reset_peak()
            engine.generate(ids, mask, max_new_tokens=PROBE_GEN, eos_token_id=None)
            running = read_status("VmHWM") - start - engine.projected["gpu"] - engine.projected["cpu"]
    layers = config["num_hidden_layers"]
    return {"probe": label, "growth_bytes": max(0, loading, running), "room_bytes": room,
            "size": f"batch {batch} x {prompt} tokens, {layers} layer{'s' if layers > 1 else ''}, vocabulary "
                    f"{config['vocab_size']}", "smaller": size != full}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexh2o.cli.memory_probe", description=__doc__)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--offload-dir", required=True)
    p.add_argument("--probe", choices=sorted(PROBES), help="run this probe here (else all, each in a fresh interpreter)")
    p.add_argument("--max-memory", type=int, help="bytes the process may use (where no memory cgroup says less)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(args.probe, args.dtype, args.offload_dir, args.max_memory)))
    else:
        print(json.dumps({"growth_bytes": calibrate(args.dtype, args.threads, args.offload_dir, print,
                                                    max_memory=args.max_memory)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
