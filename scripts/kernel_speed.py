"""The float32 block products alone (native/blocks.c and quant4.c through matmul_all), per format
and rows of x, beside the same sources built without AVX-512, the GGUF formats' products with int8
activations (int8_dots.c's matmul_int8), and the machine's read bandwidth.

    python scripts/kernel_speed.py                         # SmolLM2-135M's layer, 2 threads
    python scripts/kernel_speed.py --against ../other-checkout   # and that checkout's build too
    python scripts/kernel_speed.py --layer llama-7b        # a Llama-7B layer's matrices instead

A layer's matrices multiplied one after another: SmolLM2-135M's (k=576 -> n=960, 576, 3072; k=1536
-> n=576: small enough that each product's fixed cost, its threads' start and end, shows), or a
Llama-7B layer's (k=4096 -> n=12288, 4096, 22016; k=11008 -> n=4096: each product megabytes).
Warm: the same weights again and again (they stay in the caches); cold: copies of the layer, --cold-mb
in all (more than the caches hold), each timing on the next copy (never the warm one), so the weights
come from memory.
The builds are timed in turn, one layer a timing, the best of --rounds kept (on a shared machine the
best is the kernel's own time; a mean takes in the other programs' too). ns per block: per 32 weight
values and per thread (wall time times threads); GB/s: the weights' bytes over wall time. The read
bandwidth is decode_breakdown.py's read_bandwidth (the fastest of several ways of reading 256 MB).
Writes results/kernel_speed.{json,md}.
"""

import argparse
import ctypes
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_breakdown import read_bandwidth  # noqa: E402
from flexh2o import native  # noqa: E402
from flexh2o.compression import quant  # noqa: E402
from flexh2o.compression.formats import BLOCK, NATIVE_FORMATS, SIXTEEN_BIT  # noqa: E402
from flexh2o.compression.int8_activations import FORMATS as INT8_FORMATS  # noqa: E402

LAYERS = {"smollm2-135m": [(576, 960), (576, 576), (576, 3072), (1536, 576)],  # (k, n) of each product
          "llama-7b": [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]}
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "groups"]
INT8 = "int8 activations"
READ = "read alone"


def weights(fmt: str, n: int, k: int) -> torch.Tensor:
    """A matrix's records in `fmt`, made from normal values (real scales: no subnormal arithmetic)."""
    values = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    if fmt == "groups":
        return quant.quantize(torch.from_numpy(values))
    if fmt in SIXTEEN_BIT:
        return torch.from_numpy(values).to(SIXTEEN_BIT[fmt]).view(torch.uint8)
    import gguf
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt]).copy())


def layers(fmt: str, megabytes: int, shape: list = LAYERS["smollm2-135m"]) -> list:
    """Copies of a layer's matrices (`shape`: their (k, n)), at least `megabytes` in all (two at the
    least), each a list of (k, n, records), laid one after another in memory."""
    one = [weights(fmt, n, k) for k, n in shape]
    layer_bytes = sum(w.numel() for w in one)
    copies = max(2, -(-megabytes * 2 ** 20 // layer_bytes))
    joined, at, out = torch.cat([w.reshape(-1) for w in one]).repeat(copies), 0, []
    for _ in range(copies):
        out.append([])
        for (k, n), w in zip(shape, one):
            out[-1].append((k, n, joined[at: at + w.numel()].view(w.shape)))
            at += w.numel()
    return out


class Timer:
    """Times a layer's products, each time on the next of `copies` (from the `start`-th)."""

    def __init__(self, fmt: str, m: int, copies: list, threads: int, start: int = 0):
        self.code, self.m, self.copies, self.threads, self.next = NATIVE_FORMATS[fmt], m, copies, threads, start
        self.x = torch.randn(m, max(k for layer in copies[:1] for k, _, _ in layer))
        self.y = torch.empty(m, max(n for layer in copies[:1] for _, n, _ in layer))

    def seconds(self, product) -> float:
        layer, self.next = self.copies[self.next], (self.next + 1) % len(self.copies)
        start = time.perf_counter()
        for k, n, w in layer:
            product(self, k, n, w)
        return time.perf_counter() - start


def multiplies(fn):
    """A timed product: fn takes matmul_all's (and matmul_int8's) arguments."""
    return lambda t, k, n, w: fn(t.code, t.x.data_ptr(), t.m, k, k, w.data_ptr(), t.y.data_ptr(), n, n, t.threads)


def reads(lib):
    """The weights only read (read_rate.c, as decode_breakdown.read_bandwidth's fastest way read them
    here): the time a product of those bytes cannot beat, taken beside it."""
    fold = ctypes.c_uint64()
    return lambda t, k, n, w: lib.read_bytes(w.data_ptr(), w.nbytes, t.threads, 8, 256, ctypes.byref(fold))


def measure(products: dict, a) -> list:
    rows, shape = [], LAYERS[a.layer]
    blocks = sum(n * k // BLOCK for k, n in shape)
    for fmt in a.formats:
        libs = {name: p for name, p in products.items() if fmt in INT8_FORMATS or name != INT8}
        libs_cold = libs | {READ: reads(native.library())}
        copies = layers(fmt, a.cold_mb, shape)
        layer_bytes, cold_at = sum(w.nbytes for _, _, w in copies[0]), 0
        for m in a.rows:
            for heat, used in (("warm", copies[:1]), ("cold", copies[1:])):  # (copy 0, just read, is warm)
                timed = libs_cold if heat == "cold" else libs
                timer, best = Timer(fmt, m, used, a.threads, cold_at if heat == "cold" else 0), dict.fromkeys(timed, 1e9)
                for _ in range(a.rounds):
                    for name, product in timed.items():
                        best[name] = min(best[name], timer.seconds(product))
                cold_at = timer.next if heat == "cold" else cold_at  # (a copy read again only after all others)
                rows += [{"format": fmt, "rows": m, "heat": heat, "build": name, "layer_s": s,
                          "ns_per_block": s * a.threads / blocks * 1e9, "gb_s": layer_bytes / s / 1e9}
                         for name, s in best.items()]
                print(fmt, m, heat, {name: f"{s * 1e6:.0f} us" for name, s in best.items()}, flush=True)
        del copies
    return rows


def markdown(r: dict, names: list) -> str:
    head = ["format", "rows", "heat"] + [f"{n}: ns/block, GB/s" for n in names] + [
        f"{names[0]} vs {names[1]}", f"{READ}: GB/s", f"of that: {names[0]}", f"of that: {INT8}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {(row["format"], row["rows"], row["heat"], row["build"]): row for row in r["rows"]}
    for fmt, m, heat in dict.fromkeys((row["format"], row["rows"], row["heat"]) for row in r["rows"]):
        got = [keyed.get((fmt, m, heat, n)) for n in names]
        cells = [f"{g['ns_per_block']:.2f}, {g['gb_s']:.1f}" if g else "-" for g in got]
        read = keyed.get((fmt, m, heat, READ))
        shares = [f"{keyed[fmt, m, heat, n]['gb_s'] / read['gb_s']:.2f}" if read and (fmt, m, heat, n) in keyed
                  else "-" for n in (names[0], INT8)]
        lines.append("| " + " | ".join([fmt, str(m), heat, *cells, f"{got[1]['layer_s'] / got[0]['layer_s']:.2f}x",
                                        f"{read['gb_s']:.1f}" if read else "-", *shares]) + " |")
    return (f"# The block products alone\n\n`python scripts/kernel_speed.py{r['flags']}`: a {r['layer_name']} layer's products (k, n) "
            f"{r['layer']}, {r['threads']} threads, best of {r['rounds']}; ns per block of 32 values per thread, GB/s "
            f"of weights read; read bandwidth {r['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s (256 MB). {INT8}: "
            f"int8_dots.c's products (the opt-in --int8-activations), the x rows' quantizing included. {READ}: the "
            f"same cold copies only read (read_rate.c), timed in turn with the products: what they cannot beat, "
            f"measured beside them (a shared machine's read rate moves from run to run).\n\n"
            + "\n".join(lines) + f"\n\nMachine: {r['machine']}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layer", choices=list(LAYERS), default="smollm2-135m", help="whose layer's matrices")
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32])
    p.add_argument("--rounds", type=int, default=40, help="timings of one layer for each build")
    p.add_argument("--cold-mb", type=int, default=1024, help="megabytes of weights read in turn, cold")
    p.add_argument("--against", help="another checkout, whose flexh2o/native sources are built and timed too")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "kernel_speed"))
    a = p.parse_args()
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    from flexh2o.host.machine import describe_machine

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as work:
        lib = native.library()
        libs = {"this build": lib.matmul_all,
                "no AVX-512": native.build_at(os.path.join(work, "256"), native.FLAGS + ("-mno-avx512f",)).matmul_all,
                INT8: lib.matmul_int8}
        if a.against:
            libs["against"] = native.build_at(os.path.join(work, "against"), native.FLAGS,
                                              os.path.join(a.against, "flexh2o", "native")).matmul_all
        libs = {name: multiplies(fn) for name, fn in libs.items()}
        flags = "".join(f" {f}" for f in sys.argv[1:] if not f.startswith("--out") and f != a.out)
        r = {"machine": describe_machine(), "flags": flags, "threads": a.threads, "rounds": a.rounds,
             "layer_name": a.layer, "layer": LAYERS[a.layer],
             "read_bandwidth_bytes_s": read_bandwidth(a.threads), "against": a.against, "rows": measure(libs, a)}
    write_json_atomic(a.out + ".json", r)
    write_text_atomic(a.out + ".md", markdown(r, list(libs)))
    print(markdown(r, list(libs)))


if __name__ == "__main__":
    main()
