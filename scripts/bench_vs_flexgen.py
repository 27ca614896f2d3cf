"""FlexGen 0.1.8 (PyPI) and flexh2o side by side on one CUDA GPU: results/vs_flexgen.{md,json}.

    pip download --no-deps flexgen==0.1.8 attrs -d wheels/   # once, where there is network
    python scripts/bench_vs_flexgen.py                        # on the GPU machine; --help for the flags

Both engines run OPT dummy float16 weights at the same placement, batch and lengths, each measured
as FlexGen measures itself: load; a warm-up generate of 32-token prompts and 1 token; the timed
generate. Each setting runs FlexGen, then flexh2o (the engines interleaved), each in a process of
its own; the results are written again after every run.

- OPT-6.7B all on the GPU, batch 32, 512+32.
- OPT-30B at FlexGen's CPU offload: weights and cache in CPU memory, attention on the CPU (FlexGen's
  --percent 0 100 0 100 100 0 --cpu-cache-compute), 24 x 2 sequences, 512+8. FlexGen's own suite
  runs OPT-30B as 48 x 3 with a fifth of the weights on a T4, on a host of 208 GB; 144 sequences'
  cache does not fit beside 60 GB of weights in a GPU machine's 128 GB, 48 sequences' does.
- OPT-30B with H2O (10% heavy + 10% recent tokens) at the larger batch its smaller cache makes room
  for, 32 x 4 (flexh2o alone: FlexGen has no H2O), against FlexGen's full cache at its batch above.

FlexGen's figures come from its log (--log-file), flexh2o's from its JSON report (--json-out).
FlexGen runs through scripts/flexgen_offline.py, which stands in for the tokenizer FlexGen would
fetch from the hub. The GPU machine has no network: flexgen 0.1.8 and attrs (the one import of
FlexGen's that a torch image may lack) are taken from --flexgen-wheel-dir, put on PYTHONPATH as they
are (a wheel is a zip file, and Python imports pure-Python packages from one): copy that directory
to the GPU machine with the checkout. Without CUDA this script says so in one line and exits 0.
"""

import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
from flexh2o.common.errors import OneLineErrorParser, UsageError  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402

WRAPPER = os.path.join("scripts", "flexgen_offline.py")  # engines run with the checkout as their directory
PREPARE = "pip download --no-deps flexgen==0.1.8 attrs -d DIR"
RUN_TIMEOUT_S = 600  # one engine's run, load included
FIGURES = ("prefill_latency_s", "prefill_throughput", "decode_latency_s", "decode_throughput", "total_latency_s",
           "total_throughput")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    model: str          # flexh2o's preset; FlexGen's name is facebook/<model>
    percent: tuple      # FlexGen's six placement numbers
    gpu_batch_size: int
    num_gpu_batches: int
    prompt_len: int
    gen_len: int
    cpu_cache_compute: bool = False
    hh_ratio: float | None = None     # H2O, flexh2o alone: FlexGen's figure comes from `compare_to`
    compare_to: str | None = None
    target: tuple = ("total", 1.0)    # (figure, times FlexGen's) that flexh2o should reach

    @property
    def batch(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches


OFFLOAD = (0, 100, 0, 100, 100, 0)
SETTINGS = [
    Setting("OPT-6.7B all on the GPU", "opt-6.7b", (100, 0, 100, 0, 100, 0), 32, 1, 512, 32, target=("decode", 2.5)),
    Setting("OPT-30B, weights + cache in CPU memory, attention on the CPU", "opt-30b", OFFLOAD, 24, 2, 512, 8,
            cpu_cache_compute=True, target=("total", 2.0)),
    Setting("OPT-30B, same placement, H2O 10% + 10% at a larger batch", "opt-30b", OFFLOAD, 32, 4, 512, 8,
            cpu_cache_compute=True, hh_ratio=0.1, compare_to="OPT-30B, weights + cache in CPU memory, attention on "
            "the CPU", target=("total", 3.0)),
]


# -- the two engines' command lines -----------------------------------------------------------------
def shape_flags(s: Setting) -> list:
    flags = ["--percent", *map(str, s.percent), "--gpu-batch-size", str(s.gpu_batch_size),
             "--num-gpu-batches", str(s.num_gpu_batches), "--prompt-len", str(s.prompt_len),
             "--gen-len", str(s.gen_len)]
    return flags + (["--cpu-cache-compute"] if s.cpu_cache_compute else [])


def flexgen_command(s: Setting, log_file: str, offload_dir: str, python=sys.executable) -> list:
    if s.hh_ratio is not None:
        raise ValueError(f"{s.name}: FlexGen 0.1.8 has no H2O")
    return [python, WRAPPER, "--model", f"facebook/{s.model}", "--path", "_DUMMY_", *shape_flags(s),
            "--offload-dir", offload_dir, "--log-file", log_file]


def flexh2o_command(s: Setting, json_out: str, python=sys.executable) -> list:
    h2o = [] if s.hh_ratio is None else ["--hh-ratio", f"{s.hh_ratio:g}"]
    return [python, "-m", "flexh2o.run", "--model", s.model, "--dummy", "--device", "cuda", "--dtype", "float16",
            *shape_flags(s), *h2o, "--no-stop-at-eos", "--warmup", "--json-out", json_out]


def flexgen_pythonpath(wheel_dir: str, installed=lambda: importlib.util.find_spec("flexgen") is not None) -> list:
    """The wheels to put on PYTHONPATH for FlexGen: every *.whl in wheel_dir when one of them is
    flexgen's; none when flexgen is installed. Refuses, naming the flag, where neither holds."""
    wheels = sorted(glob.glob(os.path.join(glob.escape(wheel_dir), "*.whl")))
    if any(os.path.basename(w).lower().startswith("flexgen-") for w in wheels):
        return wheels
    if installed():
        return []
    where = "holds no flexgen-*.whl" if os.path.isdir(wheel_dir) else "is not a directory"
    raise UsageError("--flexgen-wheel-dir", f"{wheel_dir} {where} and flexgen is not installed; prepare it with "
                     f"`{PREPARE}`")


# -- reading what each engine reports --------------------------------------------------------------
LOG_FIGURE = re.compile(r"^(prefill|decode|total) latency: ([0-9.]+) s\s+\1 throughput: ([0-9.]+) token/s", re.M)


def parse_flexgen_log(text: str) -> dict:
    """FlexGen's figures from its benchmark log (flex_opt's --log-file, appended to at every run: the
    last run counts): latency and throughput of prefill, decode and total, its peak GPU memory and
    whether the figures were projected from a cut run."""
    figures = {}
    for kind, latency, throughput in LOG_FIGURE.findall(text):
        figures[f"{kind}_latency_s"], figures[f"{kind}_throughput"] = float(latency), float(throughput)
    missing = [k for k in FIGURES if k not in figures]
    if missing:
        raise ValueError(f"FlexGen's log has no {missing[0].rsplit('_', 1)[0].replace('_', ' ')} figure")
    peak = re.findall(r"peak gpu mem: ([0-9.]+) GB\s+projected: (True|False)", text)
    if peak:
        figures["peak_gpu_mem_gb"], figures["projected"] = float(peak[-1][0]), peak[-1][1] == "True"
    return figures


def flexh2o_figures(report: dict) -> dict:
    """The figures FlexGen reports, from flexh2o's JSON report, with flexh2o's peak GPU memory."""
    figures = {k: report[k] for k in FIGURES}
    figures["peak_gpu_mem_gb"] = (report.get("peak_gpu_allocator_bytes") or report["peak_gpu_mem_bytes"]) / (1 << 30)
    figures["projected"] = bool(report.get("projected_from_steps"))
    return figures


def last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_engine(cmd: list, read, timeout: float, env=None) -> dict:
    """Runs one engine's command; read() -> its figures once it exited 0. Returns the figures, or
    {"error": one line} (the last line it printed, or why it stopped)."""
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s", "seconds": time.monotonic() - start}
    seconds = time.monotonic() - start
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {last_line(r.stderr) or last_line(r.stdout)}", "seconds": seconds}
    try:
        return {**read(), "seconds": seconds}
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}; its output ended: {last_line(r.stdout)}", "seconds": seconds}


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


# -- the runs and the table --------------------------------------------------------------------------
def compare(row: dict, s: Setting):
    """The ratios of flexh2o's figures to FlexGen's, and whether the setting's target held."""
    fg, fx = row.get("flexgen") or {}, row.get("flexh2o") or {}
    if "total_throughput" not in fg or "total_throughput" not in fx:
        return
    for kind in ("total", "decode"):
        row[f"{kind}_ratio"] = fx[f"{kind}_throughput"] / fg[f"{kind}_throughput"]
    figure, times = s.target
    row["target"] = f"{figure} >= {times:g}x FlexGen's"
    row["target_met"] = row[f"{figure}_ratio"] >= times


def run_settings(settings: list, wheels: list, deadline: float, on_row, python=sys.executable) -> list:
    """Runs each setting (FlexGen, then flexh2o), calling on_row(rows) after every engine's run;
    a run starts only before the deadline (time.monotonic()) and is stopped at it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(wheels + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    rows, by_name = [], {}
    for s in settings:
        row = {"setting": s.name, "model": s.model, "percent": list(s.percent),
               "cpu_cache_compute": s.cpu_cache_compute,
               "batch": f"{s.gpu_batch_size} x {s.num_gpu_batches}", "lengths": f"{s.prompt_len}+{s.gen_len}",
               "kv": "full" if s.hh_ratio is None else f"H2O {s.hh_ratio:g} + {s.hh_ratio:g}"}
        rows.append(row)
        by_name[s.name] = row
        with tempfile.TemporaryDirectory(prefix="flexh2o-vs-flexgen-") as tmp:
            log, report, offload = (os.path.join(tmp, n) for n in ("flexgen.log", "flexh2o.json", "offload"))
            if s.compare_to is not None:
                earlier = by_name.get(s.compare_to, {})
                row["flexgen"] = {**earlier.get("flexgen", {"error": f"{s.compare_to} did not run"}),
                                  "from": s.compare_to}
            elif time.monotonic() < deadline:
                row["flexgen_command"] = " ".join(flexgen_command(s, "LOG", "DIR", "python"))
                row["flexgen"] = run_engine(flexgen_command(s, log, offload, python),
                                            lambda: parse_flexgen_log(read_text(log)), deadline - time.monotonic(), env)
                print(f"[vs-flexgen] {s.name}: FlexGen {cell(row['flexgen'])}", flush=True)
                on_row(rows)
            if time.monotonic() < deadline:
                row["flexh2o_command"] = " ".join(flexh2o_command(s, "OUT.json", "python"))
                row["flexh2o"] = run_engine(flexh2o_command(s, report, python),
                                            lambda: flexh2o_figures(json.loads(read_text(report))),
                                            deadline - time.monotonic())
                print(f"[vs-flexgen] {s.name}: flexh2o {cell(row['flexh2o'])}", flush=True)
        compare(row, s)
        on_row(rows)
    return rows


def cell(figures: dict | None) -> str:
    if not figures:
        return "not run (time)"
    if "error" in figures:
        return f"**{figures['error'].replace('|', '/')}**"  # a bar would end the table's cell
    projected = " (projected)" if figures.get("projected") else ""
    return f"{figures['total_throughput']:.1f} / {figures['decode_throughput']:.1f}{projected}"


def table(rows: list) -> list:
    """The comparison's markdown lines: a row per setting, then the commands that ran."""
    lines = ["| setting | batch | prompt + gen | KV cache | FlexGen total / decode tok/s | flexh2o total / decode "
             "tok/s | total ratio | decode ratio | target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = [f"**{r[k]:.2f}x**" if k in r else "" for k in ("total_ratio", "decode_ratio")]
        target = "" if "target" not in r else f"{r['target']}: {'met' if r['target_met'] else '**not met**'}"
        via = f" (FlexGen: {r['flexgen']['from']}, full cache)" if (r.get("flexgen") or {}).get("from") else ""
        lines.append(f"| {r['setting']}{via} | {r['batch']} | {r['lengths']} | {r['kv']} | {cell(r.get('flexgen'))} | "
                     f"{cell(r.get('flexh2o'))} | {ratios[0]} | {ratios[1]} | {target} |")
    lines += ["", "Commands (LOG, OUT.json and DIR stand for temporary files):", ""]
    for r in rows:
        lines += [f"- {r['setting']}: `{r[k]}`" for k in ("flexgen_command", "flexh2o_command") if k in r]
    return lines


def markdown(result: dict) -> str:
    return "\n".join([f"# FlexGen 0.1.8 vs flexh2o on {result['device']}", "",
                      f"Command: `{result['command']}`, started {result['started']}; torch {result['torch']}, CUDA "
                      f"{result['cuda']}; FlexGen from {result['flexgen_from']}. OPT dummy float16 weights; each "
                      "engine in its own process: load, a warm-up generate of 32-token prompts and 1 token, then the "
                      "timed generate (FlexGen's own protocol); FlexGen's figures from its log, flexh2o's from its "
                      "JSON report.", ""] + table(result["rows"])) + "\n"


def write(out: str, result: dict):
    write_json_atomic(out + ".json", result)
    write_text_atomic(out + ".md", markdown(result))


def header(command: str, wheels: list) -> dict:
    import torch
    from flexh2o.host.machine import describe_machine
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "flexgen_from": ", ".join(os.path.basename(w) for w in wheels) or "the installed flexgen",
            "machine": describe_machine()}


def build_parser() -> OneLineErrorParser:
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flexgen-wheel-dir", default=os.path.join(REPO, "wheels"), metavar="DIR",
                   help=f"flexgen 0.1.8's wheel and attrs' (`{PREPARE}`); default: wheels/ in the checkout")
    p.add_argument("--only", metavar="TEXT", help="run the settings whose name holds TEXT")
    p.add_argument("--budget", type=float, default=30 * 60, metavar="SECONDS",
                   help="no run starts after this many seconds, and one running then is stopped")
    p.add_argument("--out", default=os.path.join(REPO, "results", "vs_flexgen"), help="path without extension")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = [s for s in SETTINGS if args.only is None or args.only.lower() in s.name.lower()]
    try:
        if not settings:
            raise UsageError("--only", f"no setting's name holds {args.only!r}")
        if args.budget <= 0:
            raise UsageError("--budget", f"must be positive, got {args.budget:g}")
        import torch
        if not torch.cuda.is_available():
            print(f"bench_vs_flexgen: no CUDA device (torch {torch.__version__}): nothing measured")
            return 0
        wheels = flexgen_pythonpath(args.flexgen_wheel_dir)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {**header("python " + " ".join([os.path.relpath(__file__, REPO)] + (argv or sys.argv[1:])), wheels),
              "rows": []}

    def on_row(rows):
        result["rows"] = rows
        write(args.out, result)
    run_settings(settings, wheels, time.monotonic() + args.budget, on_row)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
