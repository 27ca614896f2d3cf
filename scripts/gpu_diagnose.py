"""What to run on a lent GPU after `make gpu-check` names a failing row, to learn why in one call.

    python3 scripts/gpu_diagnose.py memory "compressed: weights disk, cache gpu" [ROW ...]
    python3 scripts/gpu_diagnose.py trace prefill-cache-cpu decode-cache-cpu decode-weights-cpu

`memory ROW`: the allocator row of gpu_check.py's matrix (same model, batch and policy), run once
under torch's CUDA memory history; writes memory.json: the projection, the allocated and reserved
peaks, and the allocations live at the allocated peak, grouped by the flexh2o frames that made them
(and the 40 largest one by one): what the projection missed or over-counted.

`trace RUN`: a torch profiler trace (CPU and CUDA) of one of gpu_check.py's timed runs, after an
untimed one: trace_RUN.json.gz, for scripts/analyze_trace.py (on any machine): how busy the copy
engine and the compute stream were, the gaps, and what the I/O threads waited in.

`decode CHOICE`: OPT-6.7B all on the GPU, 32 x 1, 512+32 (issue 48's row), with and without CUDA
graphs and with each fused attention backend for decode (FLEXH2O_CUDA_GRAPHS, FLEXH2O_DECODE_ATTENTION):
decode tok/s and the kernel launches per decode step the profiler saw (a graph's replay is one);
decode.json. CHOICE: all, or one of DECODE_CHOICES.

Output goes to $OUT (the device tool's folder) or --out. OPT-1.3B dummy weights, float16, but for `decode`.
"""

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_check import GB, MATRIX, MODEL, largest_batch, policy_of, projection  # noqa: E402

# The timed runs of gpu_check.py's bandwidth and prefill sections: (policy arguments, prompt, new tokens).
RUNS = {
    "prefill-cache-cpu": (((100, 0), (0, 100), "gpu", 1, None, False, False, 64), 512, 1),
    "prefill-cache-cpu-compute": (((100, 0), (0, 100), "gpu", 1, None, True, False, 64), 512, 1),
    "decode-cache-cpu": (((100, 0), (0, 100), "gpu", 2, None, False, False, 32), 512, 8),
    "decode-weights-cpu": (((0, 100), (100, 0), "gpu", 2, None, False, False, 32), 512, 8),
}


def site(frames) -> str:
    """The innermost three flexh2o frames of an allocation's stack, as file:line:function."""
    ours = [f for f in frames if "/flexh2o/" in f["filename"]][:3]
    if not ours:
        return f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?"
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in ours)


def live_at_peak(snapshot) -> tuple[int, dict]:
    """Replays the memory history: the most bytes allocated at once, and what was live then."""
    live, total, best, at = {}, 0, 0, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
        if total > best:
            best, at = total, dict(live)
    return best, at


def memory(rows: list[str], out: str, offload: str) -> dict:
    import torch
    from flexh2o import Engine
    from flexh2o.runs.prompts import synthetic_prompts
    configs = {name: config for name, *config in MATRIX}
    result = {}
    for name in rows:
        with Engine.from_pretrained(MODEL, policy=policy_of(*configs[name]), device="cuda", dtype=torch.float16,
                                    dummy=True, offload_dir=offload, prompt_len=512, gen_len=4) as engine:
            batch, _ = largest_batch(engine, 512, 4)
            engine.use_policy(gpu_batch_size=batch)
            ids, _ = synthetic_prompts(engine.policy.batch_size, 512, engine.spec.vocab_size, seed=0)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
            try:
                engine.generate(ids, max_new_tokens=4, eos_token_id=None)
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            peak, live = live_at_peak(snapshot)
            groups, counts = collections.Counter(), collections.Counter()
            for size, frames in live.values():
                groups[site(frames)] += size
                counts[site(frames)] += 1
            result[name] = {
                "gpu_batch_size": batch, "projected_gb": projection(engine, batch, 512, 4)["gpu"] / GB,
                "allocated_peak_gb": torch.cuda.max_memory_allocated() / GB,
                "reserved_peak_gb": torch.cuda.max_memory_reserved() / GB, "allocated_before_gb": before / GB,
                "traced_peak_gb": peak / GB,
                "live_at_peak": [{"site": s, "gb": b / GB, "allocations": counts[s]} for s, b in groups.most_common()],
                "largest_at_peak": [{"gb": size / GB, "site": site(frames)}
                                    for size, frames in sorted(live.values(), key=lambda x: -x[0])[:40]]}
        torch.cuda.empty_cache()
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "largest_at_peak"}, indent=1), flush=True)
        with open(os.path.join(out, "memory.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def trace(runs: list[str], out: str, offload: str):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from flexh2o import Engine
    from flexh2o.runs.prompts import synthetic_prompts
    for name in runs:
        config, prompt_len, new = RUNS[name]
        policy = policy_of(*config[:7], batch=config[7])
        with Engine.from_pretrained(MODEL, policy=policy, device="cuda", dtype=torch.float16, dummy=True,
                                    offload_dir=offload, prompt_len=prompt_len, gen_len=new) as engine:
            ids, _ = synthetic_prompts(policy.batch_size, prompt_len, engine.spec.vocab_size, seed=0)
            engine.generate(ids, max_new_tokens=new, eos_token_id=None)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.generate(ids, max_new_tokens=new, eos_token_id=None)
            stats = engine.last_stats
        path = os.path.join(out, f"trace_{name}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
        print(f"{name}: prefill {stats.prefill_seconds:.3f} s, decode {stats.decode_seconds:.3f} s, "
              f"finish {stats.finish_seconds:.4f} s -> {path}.gz", flush=True)


# name -> (FLEXH2O_CUDA_GRAPHS, FLEXH2O_DECODE_ATTENTION)
DECODE_CHOICES = {"graphs": ("1", "efficient,math"), "no graphs": ("0", "efficient,math"),
                  "graphs, cudnn": ("1", "cudnn,efficient,math"), "no graphs, cudnn": ("0", "cudnn,efficient,math"),
                  "graphs, math": ("1", "math")}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def launches(engine, ids, new: int) -> int:
    """CUDA launches (kernels, and graphs) the host made in one generate of `new` tokens."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(ids, max_new_tokens=new, eos_token_id=None)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


def decode(choices: list[str], out: str, offload: str):
    import torch
    from flexh2o import Engine, Policy
    from flexh2o.runs.prompts import synthetic_prompts
    names = list(DECODE_CHOICES) if choices == ["all"] else choices
    result = {}
    with Engine.from_pretrained("opt-6.7b", policy=Policy(32), device="cuda", dtype=torch.float16, dummy=True,
                                offload_dir=offload, prompt_len=512, gen_len=32) as engine:
        ids, _ = synthetic_prompts(32, 512, engine.spec.vocab_size, seed=0)
        for name in names:
            os.environ["FLEXH2O_CUDA_GRAPHS"], os.environ["FLEXH2O_DECODE_ATTENTION"] = DECODE_CHOICES[name]
            try:
                engine.generate(ids[:, :32], max_new_tokens=4, eos_token_id=None)  # warm-up
                engine.generate(ids, max_new_tokens=32, eos_token_id=None)
                stats = engine.last_stats
                per_step = (launches(engine, ids, 9) - launches(engine, ids, 5)) / 4
                result[name] = {"decode_tok_s": 32 * 31 / stats.decode_seconds, "launches_per_decode_step": per_step}
            except Exception as e:  # noqa: BLE001 - a backend that cannot run is a row of its own
                result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(name, json.dumps(result[name]), flush=True)
            with open(os.path.join(out, "decode.json"), "w") as f:
                json.dump(result, f, indent=1)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["memory", "trace", "decode"])
    ap.add_argument("names", nargs="+", help="allocator rows of gpu_check.py (memory), runs (trace): "
                    + ", ".join(RUNS) + "; or decode choices: all, " + ", ".join(DECODE_CHOICES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    known = {"memory": [name for name, *_ in MATRIX], "trace": list(RUNS), "decode": ["all", *DECODE_CHOICES]}
    unknown = [n for n in args.names if n not in known[args.what]]
    if unknown:
        ap.error(f"unknown {args.what} choice {unknown[0]!r}; accepted: " + "; ".join(known[args.what]))
    offload = tempfile.mkdtemp(prefix="flexh2o-diagnose-")
    try:
        {"memory": memory, "trace": trace, "decode": decode}[args.what](args.names, args.out, offload)
    finally:
        shutil.rmtree(offload, ignore_errors=True)


if __name__ == "__main__":
    main()
