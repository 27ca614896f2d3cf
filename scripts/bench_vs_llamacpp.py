"""flexh2o against llama.cpp on the same GGUF file, same threads, interleaved.

    python scripts/bench_vs_llamacpp.py      # SmolLM2-135M Q4_1, 128 + 128 tokens, batch 1, 8 and 32

llama.cpp's side is its own benchmark, `llama-batched-bench` (each of B sequences its own prompt of
--prompt-len tokens, then --gen-len tokens each), built by this script from the llama.cpp tree that
the `llama-cpp-python` source distribution on PyPI vendors (pip download, cmake, with every
instruction set this CPU lists but AMX: see ISA_SWITCHES); where it cannot be built, its rows are
skipped with the reason. flexh2o's side is `python -m flexh2o.run` on the same file with --compress-weight (its
4-bit groups, multiplied as stored: kernel_choice.py), B prompts of the same length, the whole batch as
one gpu-batch, weights and cache in memory, greedy, no stop at EOS. Both run with --threads threads
(torch's intra-op threads; llama.cpp's -t and -tb), one engine at a time, the batches interleaved,
--repeats rounds; the table gives each configuration's best run.

Prefill: prompt tokens per second (B x prompt / prompt time); decode: generated tokens per second of
the steps after the first (llama.cpp's S_TG, flexh2o's decode throughput). What would make this
unfair, and why it does not apply: llama.cpp gets its own best-known settings (a batch of 2048
tokens, micro-batches of 512, the context sized for the whole batch, built for this CPU's
instruction sets; its AMX path could not run here, while torch's bfloat16 products use AMX); flexh2o
does not get more threads or more memory; both read the same file, held in the page cache.
Writes results/vs_llamacpp.{json,md}.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def build_llama_cpp(workdir: str, log, target: str = "llama-batched-bench") -> str:
    """The path of llama.cpp's tool `target` (llama-batched-bench, llama-server, test-backend-ops), built once in
    workdir; RuntimeError saying why it cannot be."""
    binary = os.path.join(workdir, "build", "bin", target)
    if os.path.exists(binary):
        return binary
    os.makedirs(workdir, exist_ok=True)

    def step(what, cmd, **kwargs):
        log(f"llama.cpp: {what}")
        r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if r.returncode != 0:
            raise RuntimeError(f"{what} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")

    sdists = glob.glob(os.path.join(workdir, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        step("downloading the llama-cpp-python sdist", [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                                        "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", workdir],
             timeout=600)
        sdists = glob.glob(os.path.join(workdir, "llama_cpp_python-*.tar.gz"))
    source = os.path.join(workdir, "source")
    if not os.path.isdir(source):
        partial = tempfile.mkdtemp(dir=workdir)
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(partial, members=members, filter="data")
        tree = glob.glob(os.path.join(partial, "*", "vendor", "llama.cpp"))[0]
        os.replace(tree, source)
        shutil.rmtree(partial)
    build = os.path.join(workdir, "build")
    step("configuring", ["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                         *isa_options(), "-DLLAMA_CURL=OFF",
                         f"-DLLAMA_BUILD_TESTS={'ON' if target.startswith('test-') else 'OFF'}",
                         f"-DLLAMA_BUILD_SERVER={'ON' if target == 'llama-server' else 'OFF'}"],
         timeout=600)
    step(f"building {target} (several minutes)",
         ["cmake", "--build", build, "--target", target, "-j", str(os.cpu_count() or 2)], timeout=3600)
    return binary


# ggml's switch for each instruction set /proc/cpuinfo may list. AMX is left out: its native build
# died here on its first tile instruction (ldtilecfg: SIGILL) although the CPU lists amx_tile.
ISA_SWITCHES = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI", "bmi2": "GGML_BMI2"}


def isa_options() -> list[str]:
    """cmake options building ggml for every instruction set this CPU has but AMX."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    return [f"-D{switch}={'ON' if flag in flags else 'OFF'}" for flag, switch in ISA_SWITCHES.items()]


def run_llama(binary: str, batch: int, a) -> dict:
    cmd = [binary, "-m", a.model, "-c", str(batch * (a.prompt_len + a.gen_len)), "-b", "2048", "-ub", "512",
           "-npp", str(a.prompt_len), "-ntg", str(a.gen_len), "-npl", str(batch), "-t", str(a.threads),
           "-tb", str(a.threads), "--output-format", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    rows = [json.loads(line) for line in (r.stdout + r.stderr).splitlines() if line.startswith("{")]
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed: {r.stderr.strip().splitlines()[-1:]}")
    row = rows[-1]
    return {"prefill_tok_s": row["speed_pp"], "decode_tok_s": row["speed_tg"], "seconds": row["t"]}


def flexh2o_flags(batch: int, a, json_out: str) -> list[str]:
    """`python -m flexh2o.run`'s flags for flexh2o's side (scripts/decode_breakdown.py runs it so too)."""
    # A file of 16-bit matrices keeps them 16-bit in CPU memory, multiplied as stored as llama.cpp
    # does (--compress-weight would make them 4-bit groups; on the compute tier they are widened).
    weights = ["--weights", "gpu=0,cpu=100,disk=0"] if getattr(a, "sixteen_bit", False) else \
        ["--weights", "gpu=100,cpu=0,disk=0", "--compress-weight"]
    return ["--model", a.model, "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len),
            "--gpu-batch-size", str(batch), "--num-gpu-batches", "1", *weights,
            "--cache", "gpu=100,cpu=0,disk=0", "--no-stop-at-eos", "--quiet",
            "--json-out", json_out] + (["--dtype", a.dtype] if a.dtype else []) + \
        (["--int8-activations"] if getattr(a, "int8_activations", False) else [])


def run_flexh2o(batch: int, a, workdir: str) -> dict:
    out = os.path.join(workdir, "flexh2o.json")
    cmd = [sys.executable, "-m", "flexh2o.run", *flexh2o_flags(batch, a, out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=REPO, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"flexh2o failed: {r.stderr.strip().splitlines()[-1:]}")
    with open(out) as f:
        report = json.load(f)
    return {"prefill_tok_s": report["prefill_throughput"], "decode_tok_s": report["decode_throughput"],
            "seconds": report["total_latency_s"]}


def best(runs: list, key: str) -> float:
    return max(r[key] for r in runs)


def markdown(r: dict) -> str:
    int8 = " with int8 activations (--int8-activations, as llama.cpp multiplies its blocks)" \
        if r.get("int8_activations") else ""
    lines = [f"# flexh2o against llama.cpp: {os.path.basename(r['model'])}", "",
             f"Machine: {r['machine']}; flexh2o computes in {r['dtype']}{int8}. `{r['command']}`: {r['prompt_len']} + "
             f"{r['gen_len']} tokens, {r['threads']} threads each, batches interleaved, best of {r['repeats']} "
             "rounds (tokens per second).", ""]
    if r.get("llama_cpp_skipped"):
        lines += [f"llama.cpp's rows skipped: {r['llama_cpp_skipped']}", ""]
    lines += ["| batch | prefill flexh2o | prefill llama.cpp | ratio | decode flexh2o | decode llama.cpp | ratio |",
              "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        f, ll = row["flexh2o"], row.get("llama_cpp") or []
        cells = [str(row["batch"])]
        for key in ("prefill_tok_s", "decode_tok_s"):
            mine = best(f, key)
            theirs = best(ll, key) if ll else None
            cells += [f"{mine:.1f}", f"{theirs:.1f}" if theirs else "-", f"{mine / theirs:.2f}x" if theirs else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="a GGUF file both engines load (default: SmolLM2-135M Q4_1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="flexh2o's compute dtype (default: what "
                   "this CPU computes fastest in)")
    p.add_argument("--sixteen-bit", action="store_true", help="the file's matrices are F16/BF16: flexh2o keeps "
                   "them 16-bit in CPU memory and multiplies them as stored (the 1.26B model of "
                   "bench_bigger_than_memory.py), not quantized by --compress-weight")
    p.add_argument("--int8-activations", action="store_true", help="flexh2o multiplies the file's Q4_0/Q4_1/Q8_0 "
                   "blocks with int8 activations, as llama.cpp does (float32 only; opt-in: not float32's results)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds after which one run is stopped")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--out", default=os.path.join(REPO, "results", "vs_llamacpp"))
    a = p.parse_args()
    if not os.path.isfile(a.model):
        p.error(f"--model: no file {a.model} (make setup downloads SmolLM2's GGUF)")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    skipped, binary = None, None
    try:
        binary = build_llama_cpp(os.path.join(a.workdir, "llama.cpp"), log)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, IndexError) as e:
        skipped = f"llama.cpp could not be built here ({e})"
        log(f"note: {skipped}")
    rows = [{"batch": b, "flexh2o": [], "llama_cpp": []} for b in a.batches]
    for _ in range(a.repeats):
        for row in rows:
            row["flexh2o"].append(run_flexh2o(row["batch"], a, a.workdir))
            log(f"flexh2o batch {row['batch']}: {row['flexh2o'][-1]}")
            if binary:
                row["llama_cpp"].append(run_llama(binary, row["batch"], a))
                log(f"llama.cpp batch {row['batch']}: {row['llama_cpp'][-1]}")
    result = {"model": a.model, "machine": describe_machine(), "dtype": a.dtype or str(cpu_compute_dtype()).removeprefix("torch."),
              "command": " ".join(["python"] + sys.argv), "prompt_len": a.prompt_len, "gen_len": a.gen_len,
              "threads": a.threads, "repeats": a.repeats, "int8_activations": a.int8_activations,
              "llama_cpp_skipped": skipped, "rows": rows}
    write_json_atomic(a.out + ".json", result)
    write_text_atomic(a.out + ".md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
