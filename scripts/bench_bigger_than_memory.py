"""A model bigger than memory on the CPU: flexh2o against llama.cpp, each in the same memory cgroup.

    python scripts/bench_bigger_than_memory.py [--batches 8 32] [--limit 1.5GB] [--repeats 2]

The model is issue 30's synthetic 1.26B Llama in an F16 GGUF of 2.52 GB (scripts/synthetic_gguf.py
writes it once, under --workdir), against a 1.5 GB cgroup: neither engine can hold it. Per batch B,
B prompts of --prompt-len tokens, --gen-len tokens generated each, greedy:

- llama.cpp: `llama-batched-bench` (built as scripts/bench_vs_llamacpp.py builds it), the file
  mapped (its default: the kernel pages weights in from the page cache, within the cgroup), -t and
  -tb the machine's cores, micro-batches of 512, the context sized for the batch. Its -ntg is
  --gen-len - 1: the prompt step gives each sequence's first token, as flexh2o's does, so both
  make --gen-len tokens with the same work.
- flexh2o: `python -m flexh2o.run --batch B`, planned by its cost model inside the cgroup (it finds
  the limit itself), offload files under --workdir; once in each of --dtypes (default: its own
  default for this CPU, and float32, where the F16 file stays 16-bit at rest and is widened per
  use: gguf_blocks.keeps_16_bit).

Each run is a child in a fresh cgroup of --limit (scripts/memory_budget.py), after the GGUF's page
cache is dropped (posix_fadvise DONTNEED; fincore checks it); batches and engines interleave, for
--repeats rounds; tables give each configuration's best round and every round is in the JSON. Load
times are not counted: end-to-end tokens per second is B x gen-len over prompt plus decode time.

Disk figures come from the block device holding --workdir, sampled every 0.1 s (/sys/dev/block/*/stat):
bytes read and the share of the time the device was busy (io_ticks), over each engine's decode
window (from the moment its result line came, back by its own decode time) divided per decode step,
and over its prompt step. The machine's other processes read from the same device; the benchmark
asks for a quiet machine.

What would make this unfair, and why it does not apply: a larger limit or more threads for one
engine (both the same cgroup and cores); a warm page cache for one (dropped before each run, both
read their weights through the page cache); llama.cpp without its best settings (its own defaults
for a mapped model, the batch and micro-batch of bench_vs_llamacpp.py); flexh2o told a placement
(it plans for itself). Results: results/bigger_than_memory.{json,md,png}.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from bench_vs_llamacpp import build_llama_cpp  # noqa: E402
from memory_budget import CgroupUnavailable, check_available, exit_on_sigterm, run_in_budget  # noqa: E402
from synthetic_gguf import write_model  # noqa: E402
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.engine.preflight import parse_size  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402

GB = 1 << 30  # as flexh2o's sizes and --limit count
SECTOR = 512


class DiskMeter:
    """Samples a block device's sectors read and busy milliseconds every `period` seconds."""

    def __init__(self, path: str, period: float = 0.1):
        st = os.stat(path)
        self.stat_file = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
        self.samples, self.period, self._stop = [], period, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> tuple:
        with open(self.stat_file) as f:
            fields = f.read().split()
        return time.monotonic(), int(fields[2]) * SECTOR, int(fields[9]) / 1000

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(self.read())

    def over(self, start: float, end: float) -> dict:
        """Bytes read and busy share between two monotonic times (nearest samples inside)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {"read_bytes": None, "busy_share": None}
        (t0, r0, b0), (t1, r1, b1) = inside[0], inside[-1]
        return {"read_bytes": r1 - r0, "busy_share": min(1.0, (b1 - b0) / (t1 - t0))}


def drop_page_cache(path: str) -> int:
    """Drops the file's pages from the page cache; gives the bytes still resident (fincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True, text=True)
    return int(r.stdout.strip() or 0) if r.returncode == 0 else -1


def line_time(run, prefix: str) -> float | None:
    return next((t for t, line in run.lines if line.lstrip().startswith(prefix)), None)


def run_llama(binary: str, batch: int, a) -> tuple:
    cmd = [binary, "-m", a.model, "-c", str(batch * (a.prompt_len + a.gen_len)), "-b", "2048", "-ub", "512",
           "-npp", str(a.prompt_len), "-ntg", str(a.gen_len - 1), "-npl", str(batch), "-t", str(a.threads),
           "-tb", str(a.threads), "--output-format", "jsonl"]
    run = run_in_budget(["sh", "-c", 'exec stdbuf -oL "$@" 2>&1', "sh", *cmd], a.limit, "flexh2o-bigger",
                        timeout=a.timeout)
    rows = [(t, json.loads(line)) for t, line in run.lines if line.startswith("{")]
    if run.returncode != 0 or not rows:
        return run, None
    end, row = rows[-1]
    return run, {"prefill_s": row["t_pp"], "decode_s": row["t_tg"], "decode_steps": a.gen_len - 1, "end": end,
                 "plan": f"mmap, -b 2048 -ub 512, -t {a.threads}"}


def run_flexh2o(batch: int, dtype: str, a) -> tuple:
    out = os.path.join(a.workdir, "flexh2o.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "flexh2o.run", "--model", a.model, "--prompt-len", str(a.prompt_len),
           "--gen-len", str(a.gen_len), "--batch", str(batch), "--no-stop-at-eos",
           "--offload-dir", os.path.join(a.workdir, "offload"), "--json-out", out, "--dtype", dtype]
    run = run_in_budget(cmd, a.limit, "flexh2o-bigger", timeout=a.timeout)
    end = line_time(run, "model:")  # the report's first line, printed as generate returns
    if run.returncode != 0 or end is None or not os.path.exists(out):
        return run, None
    with open(out) as f:
        r = json.load(f)
    p = r["policy"]
    plan = (f"{p['gpu_batch_size']} x {p['num_gpu_batches']}, weights {p['w_gpu_percent']:g}/{p['w_cpu_percent']:g}, "
            f"cache {p['cache_gpu_percent']:g}/{p['cache_cpu_percent']:g} (compute/cpu %, rest disk), {r['dtype']}")
    return run, {"prefill_s": r["prefill_latency_s"], "decode_s": r["decode_latency_s"],
                 "decode_steps": a.gen_len - 1, "end": end, "plan": plan}


def measure(engine: str, batch: int, a, binary: str | None) -> dict:
    resident = drop_page_cache(a.model)
    with DiskMeter(a.workdir) as disk:
        run, t = run_llama(binary, batch, a) if engine == "llama.cpp" else run_flexh2o(batch, engine.split()[1], a)
    row = {"engine": engine, "batch": batch, "returncode": run.returncode, "oom_killed": run.oom_killed,
           "timed_out": run.timed_out, "cgroup_peak_bytes": run.peak_bytes, "resident_before_bytes": resident}
    if t is None:
        return row | {"failed": (run.lines[-1][1].strip() if run.lines else "no output")}
    decode_start, prefill_start = t["end"] - t["decode_s"], t["end"] - t["decode_s"] - t["prefill_s"]
    decode, prefill = disk.over(decode_start, t["end"]), disk.over(prefill_start, decode_start)
    tokens = batch * a.gen_len
    steps = t["decode_steps"]
    return row | {
        "plan": t["plan"], "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
        "prefill_tok_s": batch * a.prompt_len / t["prefill_s"], "decode_tok_s": batch * steps / t["decode_s"],
        "step_s": t["decode_s"] / steps, "end_to_end_tok_s": tokens / (t["prefill_s"] + t["decode_s"]),
        "decode_read_per_step_bytes": None if decode["read_bytes"] is None else decode["read_bytes"] / steps,
        "decode_disk_busy": decode["busy_share"], "prefill_read_bytes": prefill["read_bytes"],
        "prefill_disk_busy": prefill["busy_share"]}


def best(rows: list, engine: str, batch: int) -> dict | None:
    done = [r for r in rows if r["engine"] == engine and r["batch"] == batch and "end_to_end_tok_s" in r]
    return max(done, key=lambda r: r["end_to_end_tok_s"]) if done else None


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value / scale, spec)


def markdown(result: dict) -> str:
    a = result["settings"]
    lines = [f"# A model bigger than memory: flexh2o against llama.cpp in a {a['limit_bytes'] / GB:.2f} GB cgroup", "",
             f"Synthetic Llama, {a['model_params'] / 1e9:.2f}B parameters, F16 GGUF of {a['model_bytes'] / GB:.2f} GB "
             f"({a['model_bytes'] / 1e9:.2f}e9 bytes; GB here: 2^30 bytes); "
             f"prompt {a['prompt_len']}, {a['gen_len']} generated; {a['threads']} threads; page cache of the file "
             f"dropped before each run; best of {a['repeats']} interleaved rounds. "
             f"`python scripts/bench_bigger_than_memory.py`. Machine: "
             f"{', '.join(f'{key} {value}' for key, value in result['machine'].items())}.", "",
             "| batch | engine | plan | prefill tok/s | decode tok/s (step s) | end-to-end tok/s | vs llama.cpp | "
             "disk read per decode step GB | disk busy in decode | prompt step: read GB, busy | cgroup peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for batch in a["batches"]:
        base = best(result["runs"], "llama.cpp", batch)
        for engine in result["settings"]["engines"]:
            r = best(result["runs"], engine, batch)
            if r is None:
                failed = [x for x in result["runs"] if x["engine"] == engine and x["batch"] == batch]
                why = failed[-1].get("failed", "") if failed else "not run"
                lines.append(f"| {batch} | {engine} | failed: {why} (OOM-killed: "
                             f"{any(x['oom_killed'] for x in failed)}) | | | | | | | | |")
                continue
            ratio = f"{r['end_to_end_tok_s'] / base['end_to_end_tok_s']:.2f}x" if base else ""
            lines.append(
                f"| {batch} | {engine} | {r['plan']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} "
                f"({r['step_s']:.2f}) | {r['end_to_end_tok_s']:.2f} | {ratio} | "
                f"{fmt(r['decode_read_per_step_bytes'], '.2f', GB)} | {fmt(r['decode_disk_busy'], '.0%')} | "
                f"{fmt(r['prefill_read_bytes'], '.2f', GB)}, {fmt(r['prefill_disk_busy'], '.0%')} | "
                f"{r['cgroup_peak_bytes'] / GB:.2f} |")
    return "\n".join(lines + ["", result["notes"], ""])


def plot(result: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = result["settings"]["batches"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    engines = result["settings"]["engines"]
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        rows = [best(result["runs"], engine, b) for b in batches]
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(batches))]
        axes[0].bar(xs, [r["end_to_end_tok_s"] if r else 0 for r in rows], width, label=engine)
        axes[1].bar(xs, [(r["decode_read_per_step_bytes"] or 0) / GB if r else 0 for r in rows], width, label=engine)
    for ax, title in zip(axes, ("end-to-end tokens/s", "disk read per decode step (GB)")):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{result['settings']['model_bytes'] / GB:.2f} GB model in a "
                 f"{result['settings']['limit_bytes'] / GB:.2f} GB cgroup")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--limit", default="1.5GB", help="each run's memory cgroup limit")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dtypes", nargs="+", default=None,
                    help="flexh2o's compute dtypes, a run each (default: its own for this CPU, and float32)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take before it is killed")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_bigger"),
                    help="the model, flexh2o's offload files; on the disk measured")
    ap.add_argument("--llama-workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    ap.add_argument("--out", default=os.path.join(REPO, "results", "bigger_than_memory"))
    a = ap.parse_args()
    a.limit = parse_size(a.limit, "--limit")
    if a.gen_len < 2:
        sys.exit("bench_bigger_than_memory: --gen-len must be at least 2 (a decode step after the prompt step)")
    try:
        check_available()
    except CgroupUnavailable as e:
        sys.exit(f"bench_bigger_than_memory: {e}")
    exit_on_sigterm()
    os.environ["PYTHONUNBUFFERED"] = "1"  # flexh2o's report line comes as it is printed
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.makedirs(a.workdir, exist_ok=True)
    a.model = os.path.join(a.workdir, "llama-1.26b-f16.gguf")
    print(f"model: {a.model} (written once)", flush=True)
    shapes = write_model(a.model)
    binary = build_llama_cpp(os.path.join(a.llama_workdir, "llama.cpp"), print)
    own = str(cpu_compute_dtype()).removeprefix("torch.")
    engines = ["llama.cpp"] + [f"flexh2o {dtype}" for dtype in dict.fromkeys(a.dtypes or [own, "float32"])]
    runs = []
    for round_ in range(a.repeats):
        for batch in a.batches:
            for engine in engines:
                print(f"round {round_ + 1}, batch {batch}: {engine}", flush=True)
                row = measure(engine, batch, a, binary)
                print("  " + json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
                runs.append(row | {"round": round_})
    shutil.rmtree(os.path.join(a.workdir, "offload"), ignore_errors=True)
    settings = {"batches": a.batches, "limit_bytes": a.limit, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                "repeats": a.repeats, "threads": a.threads, "engines": engines, "model_bytes": os.path.getsize(a.model),
                "model_params": sum(math.prod(d) for d in shapes.values())}
    notes = ("Decode window: each engine's own decode time, back from the moment its result line came (llama.cpp's "
             "JSON line, flexh2o's report); disk figures are the device's (every process on it) in that window. "
             "llama.cpp runs gen-len - 1 decode steps after its prompt step, flexh2o the same.")
    result = {"settings": settings, "machine": describe_machine(), "runs": runs, "notes": notes}
    write_json_atomic(a.out + ".json", result)
    write_text_atomic(a.out + ".md", markdown(result))
    plot(result, a.out + ".png")
    print(markdown(result))


if __name__ == "__main__":
    main()
