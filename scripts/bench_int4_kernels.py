"""Issue 27's first question: which kernel should multiply 4-bit weights without widening them first?

Times one linear layer's product on this CPU, for matrices of OPT-125M, OPT-1.3B and SmolLM2 at 1,
8 and 32 rows (decode batch sizes) in float32 and bfloat16 activations, and at 128 and 512 rows
(prompt steps) in bfloat16 (in float32 the weight-only kernels take seconds there):

- the full-width product (F.linear on float weights): what compressed weights are weighed against;
- dequantize the groups (quant.py) into a compute buffer, then F.linear;
- flexh2o's own kernel on its groups as they are (grouped_weight.py, native/quant4.c), with float32
  activations: what a float32 run multiplies compressed weights with at few rows;
- torch's own CPU weight-only kernels: aten._weight_int4pack_mm_for_cpu (groups of 64, an affine
  scale and zero per group: it is given flexh2o's own groups, codes as stored and zero = minimum +
  8 * scale, and checked against them dequantized) and aten._weight_int8pack_mm (one scale per
  output row);
- what it costs to bring flexh2o's groups into that kernel's layout (convert_s, once per matrix):
  the kernel's weight is tiled across rows (tiles of 64 rows, k-major inside a tile, byte j holding
  rows j and j + 32; where the rows are not a multiple of 64, tiles of 32 pairing rows 2j and 2j + 1),
  so flexh2o's row-major records cannot be handed over as they are; converting at every load is
  weighed against dequantizing at every load.

Writes results/int4_kernels.{md,json}. Median of 5 timings of 10 calls each, after 2 warm-ups, with
the CPU's own thread count.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o import native  # noqa: E402
from flexh2o.compression import grouped_weight
from flexh2o.compression.quant import GROUP, GROUP_BYTES, dequantize, quantize  # noqa: E402

SHAPES = {"OPT-125M fc1": (3072, 768), "OPT-1.3B fc1": (8192, 2048), "SmolLM2 up": (1536, 576)}
ROWS = {torch.float32: (1, 8, 32), torch.bfloat16: (1, 8, 32, 128, 512)}


def seconds(fn, calls=10, repeats=5) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def torch_int4(groups: torch.Tensor, n: int, k: int, dtype: torch.dtype):
    """flexh2o's 4-bit groups of an [n, k] weight (quant.py) in the layout of
    aten._weight_int4pack_mm_for_cpu: the codes as they are, and per group [scale, zero] with
    value = (code - 8) * scale + zero, i.e. zero = minimum + 8 * scale."""
    record = groups.view(n, k // GROUP, GROUP_BYTES)
    pairs = record[..., :GROUP // 2]  # the group's first half in the low nibbles, its second in the high ones
    codes = torch.cat([pairs & 15, pairs >> 4], -1).to(torch.int32).view(n, k)
    scale = record[..., GROUP // 2: GROUP // 2 + 2].contiguous().view(torch.float16).float().squeeze(-1)
    low = record[..., GROUP // 2 + 2:].contiguous().view(torch.float16).float().squeeze(-1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, torch.stack([scale.t(), (low + 8 * scale).t()], -1).contiguous().to(dtype)


def measure_shape(name: str, n: int, k: int, dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    weight = (torch.randn(n, k) * 0.02).to(dtype)
    groups = quantize(weight)
    buffer = torch.empty(n, k, dtype=dtype)
    packed, scales_zeros = torch_int4(groups, n, k, dtype)
    reference = dequantize(groups, k)  # float32
    convert_s = seconds(lambda: torch_int4(groups, n, k, dtype), calls=3, repeats=3)
    dequantize_s = seconds(lambda: dequantize(groups, k, buffer), calls=3, repeats=3)
    int8 = (weight.float() / (weight.float().abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
    int8_scales = (weight.float().abs().amax(1) / 127).to(dtype)
    rows_out = []
    for rows in ROWS[dtype]:
        x = torch.randn(rows, k).to(dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
        error = (out.float() - x.float() @ reference.t()).abs().max().item()
        row = {"matrix": name, "shape": [n, k], "dtype": str(dtype).removeprefix("torch."), "rows": rows,
               "full_width_s": seconds(lambda: F.linear(x, weight)),
               "dequantize_then_matmul_s": seconds(lambda: F.linear(x, dequantize(groups, k, buffer))),
               "int4pack_mm_s": seconds(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP,
                                                                                          scales_zeros)),
               "int8pack_mm_s": seconds(lambda: torch.ops.aten._weight_int8pack_mm(x, int8, int8_scales)),
               "flexh2o_kernel_s": seconds(lambda: grouped_weight.matmul(x, groups, k))
               if dtype == torch.float32 and native.library() is not None else None,
               "int4pack_max_error": error, "output_scale": out.float().abs().max().item(),
               "convert_s": convert_s, "dequantize_s": dequantize_s}
        rows_out.append(row)
        print(f"{name} {row['dtype']} rows {rows}: full {row['full_width_s'] * 1e3:.3f} ms, dequantize+mm "
              f"{row['dequantize_then_matmul_s'] * 1e3:.3f}, int4pack {row['int4pack_mm_s'] * 1e3:.3f}, int8pack "
              f"{row['int8pack_mm_s'] * 1e3:.3f}", flush=True)
    return rows_out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# 4-bit weight kernels on this CPU (issue 27, point 1)", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores, torch {m.get('torch', '?')}; the CPU "
             f"computes in {result['cpu_compute_dtype']} (`machine.cpu_compute_dtype()`). Command: "
             "`python scripts/bench_int4_kernels.py`. One linear layer's product, median of 5 x 10 calls; "
             "milliseconds; the ratios are the int4 kernel's speed-up over each.", "",
             "| matrix | activations | rows | full width | dequantize + matmul | torch int4pack | "
             "torch int8pack | flexh2o's kernel | int4 vs dequantize | int4 vs full width | flexh2o's vs full width |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    converts = {}
    for r in result["rows"]:
        lines.append(f"| {r['matrix']} {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['rows']} | "
                     f"{r['full_width_s'] * 1e3:.3f} | {r['dequantize_then_matmul_s'] * 1e3:.3f} | "
                     f"{r['int4pack_mm_s'] * 1e3:.3f} | {r['int8pack_mm_s'] * 1e3:.3f} | "
                     + (f"{own * 1e3:.3f}" if (own := r.get("flexh2o_kernel_s")) else "-") + " | "
                     f"{r['dequantize_then_matmul_s'] / r['int4pack_mm_s']:.1f}x | "
                     f"{r['full_width_s'] / r['int4pack_mm_s']:.2f}x | "
                     + (f"{r['full_width_s'] / own:.2f}x" if own else "-") + " |")
        converts[(r["matrix"], tuple(r["shape"]), r["dtype"])] = (r["convert_s"], r["dequantize_s"])
    worst = max(r["int4pack_max_error"] / max(r["output_scale"], 1e-12) for r in result["rows"])
    lines += ["", f"The int4 kernel, given flexh2o's own groups (codes as stored, zero = minimum + 8 x scale), "
              f"against the same groups dequantized by quant.py and multiplied in float32: at most {worst:.1e} of "
              "the output's scale.", "",
              "Bringing flexh2o's groups into the int4 kernel's layout, once per matrix, against dequantizing them "
              "(milliseconds; the conversion unpacks the codes to int32 and re-packs them in tiles of rows):", "",
              "| matrix | activations | convert | dequantize | convert / dequantize |", "|---|---|---|---|---|"]
    for (matrix, shape, dtype), (convert, dequant) in converts.items():
        lines.append(f"| {matrix} {shape[0]}x{shape[1]} | {dtype} | {convert * 1e3:.2f} | {dequant * 1e3:.2f} | "
                     f"{convert / dequant:.1f}x |")
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "int4_kernels"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (n, k) in SHAPES.items():
            rows += measure_shape(name, n, k, dtype)
    result = {"machine": describe_machine(), "cpu_compute_dtype": str(cpu_compute_dtype()).removeprefix("torch."),
              "threads": torch.get_num_threads(), "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
