"""How fast a run writes its weights to disk: dummy and real (a checkpoint's), full width and 4-bit.

    python scripts/bench_placement.py        # OPT-1.3B in float32: about 3 minutes

Each case builds an Engine with every weight it may place off the compute device on disk (the LM
head stays on the compute device, engine/preflight.py), timed from the call to the engine being ready, and
reports the bytes written to the offload directory per second beside the disk's write speed as the
local profile measured it (the issue's bar: at least half of it). Real weights come from a
safetensors checkpoint this script writes once (float32 and float16, the widths users download),
its pages dropped before each run, so the source is read from disk as on a first run (and once more
with them in the page cache); the source's bytes per second are reported too, since reading them
bounds a cold placement whatever the writing does, and each case's bound: the least time its
writes, its source's reads or (4-bit from the page cache) quantizing its source alone can take.
Each case runs --repeats times, the cases interleaved.

It also times 4-bit quantization itself on one 8192 x 8192 matrix per input width, by flexh2o's C
kernels and by torch's operations (flexh2o/quant.py keeps both, bit-equal).
Writes results/placement.{json,md}.
"""

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from flexh2o import Engine, Policy, native  # noqa: E402
from flexh2o.compression import quant
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402
from flexh2o.offload.offload_dir import default_offload_dir  # noqa: E402
from flexh2o.profiling.local_profile import ensure_local_profile  # noqa: E402
from bench_vs_accelerate import drop_page_cache  # noqa: E402

GB = 1e9


def make_checkpoint(model: str, dtype: torch.dtype, directory: str) -> list[str]:
    from bench_vs_transformers import opt_model
    if not os.path.exists(os.path.join(directory, "config.json")):
        partial = directory + ".part"
        shutil.rmtree(partial, ignore_errors=True)
        opt_model(PRESETS[model], 0, dtype).save_pretrained(partial)
        os.replace(partial, directory)
    return glob.glob(os.path.join(directory, "*.safetensors"))


def warm_page_cache(paths):
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def place_once(model: str, compressed: bool, source: str | None, files: list[str], workdir: str,
               cached: bool) -> dict:
    policy = Policy(gpu_batch_size=1, num_gpu_batches=1, w_gpu_percent=0, w_cpu_percent=0, compress_weight=compressed)
    (warm_page_cache if cached else drop_page_cache)(files)
    start = time.perf_counter()
    with Engine.from_pretrained(model, policy=policy, device="cpu", dtype=torch.float32, dummy=source is None,
                                path=source, offload_dir=workdir) as engine:
        seconds = time.perf_counter() - start
        written = engine.tiers.peak["disk"]
    return {"seconds": seconds, "written": written, "source_bytes": sum(os.path.getsize(f) for f in files)}


def disk_speeds(directory: str, nbytes: int = 1 << 30, block: int = 64 << 20) -> dict:
    """This disk's write and read speed measured as placing uses it, between the cases (the
    profile's figure is from another time of a disk whose speed drifts): nbytes written through
    DiskStore in tensors of `block` bytes, then read back with their pages dropped, past the page
    cache where the filesystem allows (as the local profile reads)."""
    from flexh2o.offload.disk import DiskStore
    store = DiskStore(directory, bypass_page_cache=True)
    try:
        data = torch.randint(0, 256, (block,), dtype=torch.uint8)
        files = [store.create(block) for _ in range(nbytes // block)]
        start = time.perf_counter()
        for f in files:
            store.write(f, 0, data)
        write = len(files) * block / (time.perf_counter() - start)
        drop_page_cache([f.path for f in files])
        start = time.perf_counter()
        for f in files:
            store.read(f, 0, data)
        read = len(files) * block / (time.perf_counter() - start)
    finally:
        store.close()
    return {"write": write, "read": read}


def quantize_all_seconds(files: list[str]) -> float:
    """Seconds to quantize every matrix of a checkpoint in the page cache straight from its map,
    writing nothing: the least a compressed placement from there can take."""
    from safetensors import safe_open
    warm_page_cache(files)
    start = time.perf_counter()
    for path in files:
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if tensor.dim() == 2:
                    quant.quantize(tensor, check=False)
    return time.perf_counter() - start


def bound_seconds(case: dict, r: dict) -> float:
    """The least time a case can take: writing its bytes at the disk's measured speed, and reading
    its source, from disk at the disk's measured read speed or, quantized from the page cache, at
    the quantizer's speed over the same checkpoint (quantize_all_seconds)."""
    best = min(case["runs"], key=lambda run: run["seconds"])
    bound = best["written"] / r["disk_speeds"]["write"]
    if best["source_bytes"] and not case.get("cached"):
        bound = max(bound, best["source_bytes"] / r["disk_speeds"]["read"])
    elif best["source_bytes"] and case["compressed"]:
        bound = max(bound, r["quantize_all"][case["weights"]])
    return bound


def quantize_rates(repeats: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(8192, 8192).to(dtype)
        row = {"dtype": str(dtype).removeprefix("torch."), "bytes_in": x.numel() * x.element_size()}
        for path in ("native", "torch"):
            if path == "native" and native.library() is None:
                continue
            os.environ["FLEXH2O_NATIVE"] = "1" if path == "native" else "0"
            best = min(timed(lambda: quant.quantize(x, check=False)) for _ in range(repeats))
            row[path] = row["bytes_in"] / best
        os.environ.pop("FLEXH2O_NATIVE")
        rows.append(row)
    return rows


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def markdown(r: dict) -> str:
    half = r["disk_write"] / 2
    lines = [f"# Placing weights on disk: {r['model']} in float32", "", f"Machine: {r['machine']}.", "",
             f"`{r['command']}`. The local profile's disk write speed: {r['disk_write'] / GB:.2f} GB/s "
             f"(half: {half / GB:.2f}). Best of {r['repeats']} runs per case, cases interleaved; a real "
             "checkpoint's pages dropped before each run (read from disk, as on a first run), or read into the "
             "page cache first where the row says so.", "",
             "The bound: the least time the case can take, the longest of writing its bytes at the disk's write "
             f"speed, reading its source at its read speed (both measured between the cases, the fastest of "
             f"{r['repeats']}: {r['disk_speeds']['write'] / GB:.2f} and {r['disk_speeds']['read'] / GB:.2f} GB/s), "
             "or, for 4-bit weights from the page cache, quantizing every matrix of the checkpoint straight from its "
             "map with nothing written (" + ", ".join(f"{name}: {sec:.2f} s" for name, sec in r["quantize_all"].items())
             + ").", "",
             "| weights | 4-bit | seconds | written | written GB/s | vs half the disk's speed | source read GB/s "
             "| bound (s) | bound / seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        best = min(c["runs"], key=lambda run: run["seconds"])
        rate = best["written"] / best["seconds"]
        read = f"{best['source_bytes'] / best['seconds'] / GB:.2f}" if best["source_bytes"] else "-"
        name = c["weights"] + (", in the page cache" if c.get("cached") else "")
        bound = bound_seconds(c, r)
        lines.append(f"| {name} | {'yes' if c['compressed'] else 'no'} | {best['seconds']:.1f} | "
                     f"{best['written'] / GB:.2f} GB | {rate / GB:.2f} | {rate / half:.2f}x | {read} | "
                     f"{bound:.2f} | {bound / best['seconds']:.2f} |")
    lines += ["", "4-bit quantization alone, one 8192 x 8192 matrix (GB/s of values in, best of "
              f"{r['repeats']}):", "", "| input | flexh2o's C kernels | torch's operations | speed-up |", "|---|---|---|---|"]
    for q in r["quantize"]:
        fast = f"{q['native'] / GB:.2f}" if "native" in q else "not built"
        gain = f"{q['native'] / q['torch']:.1f}x" if "native" in q else "-"
        lines.append(f"| {q['dtype']} | {fast} | {q['torch'] / GB:.2f} | {gain} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="opt-1.3b", choices=sorted(PRESETS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_placement"))
    p.add_argument("--out", default="results/placement")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    profile = ensure_local_profile("cpu", default_offload_dir())
    sources = {"dummy": (None, [])}
    for dtype in (torch.float32, torch.float16):
        directory = os.path.join(args.workdir, f"{args.model}-{str(dtype).removeprefix('torch.')}")
        sources[f"checkpoint, {str(dtype).removeprefix('torch.')}"] = (directory, make_checkpoint(args.model, dtype, directory))
    cases = [{"weights": name, "compressed": c, "cached": cached, "runs": []} for name in sources
             for cached in ((False,) if name == "dummy" else (False, True)) for c in (False, True)]
    offload = os.path.join(args.workdir, "offload")
    speeds = []
    for _ in range(args.repeats):
        speeds.append(disk_speeds(offload))
        for case in cases:
            source, files = sources[case["weights"]]
            case["runs"].append(place_once(args.model, case["compressed"], source, files, offload, case["cached"]))
            print(case["weights"], case["compressed"], case["runs"][-1], flush=True)
    quantize_all = {name: min(quantize_all_seconds(files) for _ in range(args.repeats))
                    for name, (_, files) in sources.items() if files}
    result = {"model": args.model, "machine": describe_machine(), "command": " ".join(["python"] + sys.argv),
              "disk_write": profile.disk_write, "quantize_all": quantize_all,
              "disk_speeds": {k: max(sp[k] for sp in speeds) for k in ("write", "read")},
              "repeats": args.repeats, "cases": cases,
              "quantize": quantize_rates(args.repeats)}
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
