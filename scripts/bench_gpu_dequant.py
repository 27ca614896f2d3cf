"""Issue 48, point 4: do 4-bit weights pay on the GPU? Two measurements on one CUDA device:

1. kernel: dequantizing OPT-30B's matrices (q/k/v joined, the output projection, fc1, fc2) from
   quant.py's groups into float16, in GB/s of memory traffic (groups read + values written), by
   - fused: gpu_dequant.py's Triton kernel, one launch per matrix (what a CUDA run uses);
   - torch: gpu_dequant.py's torch path, where Triton is missing (five kernels per 4M values);
   - before: quant.dequantize_torch, what a CUDA run used before (about ten kernels and three
     float32 temporaries per 4M values);
   beside a plain device-to-device copy of the same bytes (the memory's own rate); and whether the
   fused kernel's values equal the old path's, in float16 and bfloat16.
2. decode: `python -m flexh2o.run` on OPT-30B dummy weights held in CPU memory (weights 0% GPU,
   100% CPU; cache and activations on the GPU; H2O 10% + 10%; 32 x 4 sequences, 512 + 8 tokens,
   float16), without and with --compress-weight: decode tok/s of each and their ratio (target:
   4-bit >= 2x 16-bit). With --torch-too, a third run with the torch path (FLEXH2O_TRITON=0).

    python3 scripts/bench_gpu_dequant.py [--skip-decode] [--torch-too] [--gen-len N] [--out DIR]

Writes gpu_dequant.json to --out (default $OUT, else results/). Without CUDA it says so in one line
and exits 0.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
from flexh2o.compression import gpu_dequant, quant  # noqa: E402

HIDDEN, FFN = 7168, 28672
MATRICES = {"qkv": (3 * HIDDEN, HIDDEN), "out": (HIDDEN, HIDDEN), "fc1": (FFN, HIDDEN), "fc2": (HIDDEN, FFN)}
DECODE_FLAGS = ["--model", "opt-30b", "--dummy", "--dtype", "float16", "--percent", "0", "100", "100", "0", "100", "0",
                "--gpu-batch-size", "32", "--num-gpu-batches", "4", "--prompt-len", "512", "--hh-ratio", "0.1",
                "--quiet"]


def timed(fn, repeat: int = 10) -> float:
    """Median seconds of one call, by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def kernel_row(shape: tuple, workspace, fused_here: bool) -> dict:
    """One matrix's timings (ms and GB/s per way) and, with the fused kernel, whether it is exact."""
    device = torch.device("cuda")
    packed = quant.quantize(torch.randn(shape, device=device), check=False)
    out = torch.empty(shape, dtype=torch.float16, device=device)
    nbytes = packed.numel() + out.numel() * out.element_size()
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)  # a copy reading and writing nbytes
    dst = torch.empty_like(src)
    ways = {
        "torch": lambda: gpu_dequant._by_torch(packed, gpu_dequant.LAYOUTS["groups"], out, workspace),
        "before": lambda: quant.dequantize_torch(packed, shape[1], out),
        "copy": lambda: dst.copy_(src),
    }
    if fused_here:
        ways["fused"] = lambda: gpu_dequant.dequantize(packed, "groups", out)
    seconds = {way: timed(fn) for way, fn in ways.items()}
    row = {"shape": list(shape), "bytes": nbytes, **{f"{way}_ms": s * 1e3 for way, s in seconds.items()},
           **{f"{way}_gb_s": nbytes / s / 1e9 for way, s in seconds.items()}}
    if fused_here:
        for dtype in (torch.float16, torch.bfloat16):
            a = gpu_dequant.dequantize(packed, "groups", torch.empty(shape, dtype=dtype, device=device))
            b = quant.dequantize_torch(packed, shape[1], torch.empty(shape, dtype=dtype, device=device))
            row[f"exact_{str(dtype).removeprefix('torch.')}"] = bool(torch.equal(a, b))
    return row


def kernel_rows() -> dict:
    workspace, fused_here, rows = gpu_dequant.Workspace(), gpu_dequant.kernel() is not None, {}
    for name, shape in MATRICES.items():
        row = rows[name] = kernel_row(shape, workspace, fused_here)
        torch.cuda.empty_cache()
        ways = [k.removesuffix("_gb_s") for k in row if k.endswith("_gb_s")]
        print(f"{name} {shape}: " + ", ".join(f"{way} {row[f'{way}_gb_s']:.0f} GB/s ({row[f'{way}_ms']:.3f} ms)"
                                             for way in ways)
              + "".join(f", {k} {v}" for k, v in row.items() if k.startswith("exact")), flush=True)
    if not fused_here:
        print("no fused row: Triton is not usable here (see the line above)", flush=True)
    return rows


def decode_run(compressed: bool, gen_len: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="flexh2o-bench-") as tmp:
        path = os.path.join(tmp, "run.json")
        argv = [sys.executable, "-m", "flexh2o.run", *DECODE_FLAGS, "--gen-len", str(gen_len), "--json-out", path]
        argv += ["--compress-weight"] if compressed else []
        print("running:", " ".join(argv[1:]), flush=True)
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], flush=True)
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
        with open(path) as f:
            report = json.load(f)
    keys = ("decode_throughput", "decode_latency_s", "prefill_latency_s", "total_throughput")
    row = {k: report[k] for k in keys if k in report}
    row["wall_s"] = time.perf_counter() - start
    print(f"  decode {row.get('decode_throughput', 0):.1f} tok/s, wall {row['wall_s']:.0f} s", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-decode", action="store_true", help="the kernel measurement only")
    ap.add_argument("--torch-too", action="store_true", help="also decode 4-bit with the torch path (FLEXH2O_TRITON=0)")
    ap.add_argument("--gen-len", type=int, default=8, help="tokens generated per sequence in the decode runs")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_dequant: no CUDA device here; nothing measured")
        return 0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": kernel_rows()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_dequant.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    save()
    if not args.skip_decode:
        runs = [("16-bit", False, {}), ("4-bit", True, {})] + ([("4-bit torch", True, {"FLEXH2O_TRITON": "0"})]
                                                               if args.torch_too else [])
        result["decode"] = {}
        for name, compressed, env in runs:
            result["decode"][name] = decode_run(compressed, args.gen_len, env)
            save()
        rates = {k: v.get("decode_throughput") for k, v in result["decode"].items()}
        if rates.get("16-bit") and rates.get("4-bit"):
            result["ratio_4bit_over_16bit"] = rates["4-bit"] / rates["16-bit"]
            print(f"4-bit / 16-bit decode: {result['ratio_4bit_over_16bit']:.2f}x (target >= 2)", flush=True)
        save()
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
