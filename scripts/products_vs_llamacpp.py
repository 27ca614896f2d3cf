"""flexh2o's block products beside llama.cpp's, the product alone, on the same matrix and threads.

    python scripts/products_vs_llamacpp.py     # a 4096 x 14336 matrix, x of 1 and 8 rows

llama.cpp's side is its own timing of the product, `test-backend-ops perf -o MUL_MAT` on the CPU
backend (built as bench_vs_llamacpp.py builds its tools), for the cases it has: a 4096 x 14336
weight matrix in each format against 1 to 8 rows of float32 activations (its x quantized to 8 bits
inside the product where the format has an 8-bit partner, as llama.cpp does). It runs them on half
the CPU's threads; flexh2o's products (native matmul_all with float32 activations, and matmul_int8,
the opt-in --int8-activations) run here on as many, on the same shape, the best of --repeats
timings each, llama.cpp's and flexh2o's rounds interleaved. The matrix stays in the caches only as
far as they hold it (Q4_0's 33 MB does not fit in this 32 MB L3, so each call reads it from memory).
Not llama.cpp's every path: test-backend-ops times the CPU backend's own buffers, not the repacked
layouts (Q4_0, Q8_0 and others interleaved for AVX2/AVX-512) that llama.cpp's model runs put the
weights in where the CPU allows, so its products in a real run can be faster than these; the end
to end comparison is bench_vs_llamacpp.py.
Writes results/products_vs_llamacpp.{json,md}.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_vs_llamacpp import build_llama_cpp  # noqa: E402
from kernel_speed import weights  # noqa: E402
from flexh2o import native  # noqa: E402
from flexh2o.compression.formats import NATIVE_FORMATS  # noqa: E402
from flexh2o.compression.int8_activations import FORMATS as INT8_FORMATS  # noqa: E402

N, K = 4096, 14336  # the weight matrix of test-backend-ops' perf cases (out x in)
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "F16"]
CASE = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+),.*?([\d.]+) us/run")


def llama_times(binary: str, formats: list, rows: list) -> dict:
    """{(format, rows): microseconds a product} from one test-backend-ops perf run."""
    pattern = (f"type_a=({'|'.join(f.lower() for f in formats)}),type_b=f32,m={N},n=({'|'.join(map(str, rows))}),"
               f"k={K},")
    out = subprocess.run([binary, "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", pattern], capture_output=True,
                         text=True, timeout=1800).stdout
    return {(m.group(1).upper(), int(m.group(3))): float(m.group(5)) for m in CASE.finditer(out)
            if int(m.group(2)) == N and int(m.group(4)) == K}


def flexh2o_times(fmt: str, rows: list, threads: int, repeats: int) -> dict:
    """{(kind, rows): microseconds a product}, kind "float32" or "int8", the best of `repeats`."""
    lib, w, out = native.library(), weights(fmt, N, K), {}
    kinds = {"float32": lib.matmul_all} | ({"int8": lib.matmul_int8} if fmt in INT8_FORMATS else {})
    for m in rows:
        x, y = torch.randn(m, K), torch.empty(m, N)
        for kind, product in kinds.items():
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                product(NATIVE_FORMATS[fmt], x.data_ptr(), m, K, K, w.data_ptr(), y.data_ptr(), N, N, threads)
                best = min(best, time.perf_counter() - start)
            out[kind, m] = best * 1e6
    return out


def markdown(r: dict) -> str:
    lines = ["| format | rows of x | llama.cpp (us) | flexh2o float32 (us) | vs llama.cpp | flexh2o int8 (us) | "
             "vs llama.cpp |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        llama, f32, i8 = row["llama_cpp_us"], row["float32_us"], row.get("int8_us")
        cells = [row["format"], str(row["rows"]), f"{llama:.0f}" if llama else "-", f"{f32:.0f}",
                 f"{llama / f32:.2f}x" if llama else "-", f"{i8:.0f}" if i8 else "-",
                 f"{llama / i8:.2f}x" if llama and i8 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return (f"# The block products beside llama.cpp's\n\n`{r['command']}`: a {N} x {K} weight matrix, {r['threads']} "
            f"thread(s) each (test-backend-ops' own count: half the CPU's), best of {r['repeats']} rounds; "
            f"microseconds a product, and llama.cpp's time over flexh2o's (above 1: flexh2o faster). llama.cpp's "
            f"products on its plain CPU buffers: its model runs may repack Q4_0 and Q8_0 weights into faster layouts."
            + (f" {r['llama_cpp_skipped']}" if r["llama_cpp_skipped"] else "") + "\n\n" + "\n".join(lines) + f"\n\nMachine: {r['machine']}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], choices=[1, 2, 3, 4, 5, 8],
                   help="rows of x (the ones test-backend-ops has)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both sides")
    p.add_argument("--repeats", type=int, default=10, help="flexh2o's timings of each product in a round")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "products_vs_llamacpp"))
    a = p.parse_args()
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    from flexh2o.host.machine import describe_machine

    threads = max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    skipped, binary = None, None
    try:
        binary = build_llama_cpp(os.path.join(a.workdir, "llama.cpp"), log, "test-backend-ops")
    except (RuntimeError, OSError, subprocess.TimeoutExpired, IndexError) as e:
        skipped = f"llama.cpp could not be built here ({e}): its column is empty."
        log(f"note: {skipped}")
    llama, ours = {}, {}
    for _ in range(a.rounds):
        if binary:
            for key, us in llama_times(binary, a.formats, a.rows).items():
                llama[key] = min(llama.get(key, us), us)
        for fmt in a.formats:
            for key, us in flexh2o_times(fmt, a.rows, threads, a.repeats).items():
                ours[fmt, *key] = min(ours.get((fmt, *key), us), us)
        log(f"round: llama.cpp {llama}, flexh2o {ours}")
    rows = [{"format": fmt, "rows": m, "llama_cpp_us": llama.get((fmt, m)), "float32_us": ours[fmt, "float32", m],
             **({"int8_us": ours[fmt, "int8", m]} if fmt in INT8_FORMATS else {})}
            for fmt in a.formats for m in a.rows]
    r = {"machine": describe_machine(), "command": " ".join(["python"] + sys.argv), "threads": threads,
         "repeats": a.rounds, "llama_cpp_skipped": skipped, "rows": rows}
    write_json_atomic(a.out + ".json", r)
    write_text_atomic(a.out + ".md", markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
