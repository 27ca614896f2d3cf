"""Measures flexh2o on a CUDA machine: `make gpu-bench`. Results in results/gpu_bench.{json,md},
written after every row; FlexGen's comparison also in results/vs_flexgen.{json,md}; a copy of each
in $GPU_CHECK_OUT when set. Exit status 1 if a section failed or a target was missed. Sections,
each within its budget (check_sections.py says what happens past one), 8 minutes in all:

1. profile: this machine's hardware profile for the cost model (`python -m flexh2o.profile --device
   cuda`; a cached one is used as it is).
2. vs-flexgen: FlexGen 0.1.8 and flexh2o side by side (scripts/bench_vs_flexgen.py: OPT-6.7B all on
   the GPU, OPT-30B at FlexGen's CPU offload, OPT-30B with H2O at a larger batch). Targets: flexh2o's
   decode >= 2.5x FlexGen's on OPT-6.7B, total >= 2x on OPT-30B and >= 3x with H2O. Needs FlexGen's
   wheels (--flexgen-wheel-dir, default wheels/: see bench_vs_flexgen.py); without them its FlexGen
   cells say so and flexh2o's still run.
3. t4 opt-6.7b, t4 opt-30b: the H2O paper's six T4 settings, FlexGen's baseline and H2O-20% at the
   paper's batches, under --gpu-mem 16GB, generation cut and decode projected as FlexGen's
   --cut-gen-len does (scripts/t4_measure.py, one process per model). Target per row: the cost
   model's prediction for this machine within +-25% of the measured total throughput.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(__file__))
import bench_vs_flexgen as vs  # noqa: E402
from check_sections import Check, machine_line  # noqa: E402
from flexh2o.common.errors import OneLineErrorParser, UsageError  # noqa: E402

BUDGETS = {"profile": 90, "vs-flexgen": 210, "t4 opt-6.7b": 50, "t4 opt-30b": 120}
TOTAL_BUDGET_S = 8 * 60


# -- 1. the profile ----------------------------------------------------------------------------------
def profile_section(section, python=sys.executable):
    cmd = [python, "-m", "flexh2o.profile", "--device", "cuda"]
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BUDGETS["profile"])
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])}: exit {r.returncode}: {vs.last_line(r.stderr)}")
    section.add({"command": " ".join(cmd[1:]), "seconds": time.monotonic() - start,
                 "last_line": vs.last_line(r.stdout)})


# -- 2. FlexGen beside flexh2o -----------------------------------------------------------------------
def vs_flexgen_section(section, wheels: list, outs: list, header: dict, python=sys.executable):
    """Runs bench_vs_flexgen's settings within the section's budget; every engine's run is written to
    vs_flexgen.{md,json} and each finished setting is a row here, with its target."""
    result = {**header, "rows": []}

    def on_row(rows):
        result["rows"] = rows
        for out in outs:
            vs.write(out, result)
        section.rows[:] = rows
        section.write()
    rows = vs.run_settings(vs.SETTINGS, wheels, section.deadline, on_row, python)
    for row in rows:
        section.target(row["setting"], f"total {row['total_ratio']:.2f}x, decode {row['decode_ratio']:.2f}x"
                       if "total_ratio" in row else "not compared: " + flexh2o_or_flexgen_error(row),
                       row.get("target", "compared with FlexGen"), row.get("target_met", False))
    section.skipped += [s.name for s in vs.SETTINGS if s.name not in {r["setting"] for r in rows}]


def flexh2o_or_flexgen_error(row: dict) -> str:
    for engine in ("flexgen", "flexh2o"):
        figures = row.get(engine)
        if not figures:
            return f"{engine} did not run within the budget"
        if "error" in figures:
            return f"{engine}: {figures['error']}"
    return "?"


# -- 3. the paper's T4 settings -----------------------------------------------------------------------
def stream_rows(cmd: list, seconds: float, on_row) -> str | None:
    """Runs cmd, handing each JSON line it prints to on_row as it comes; stops it after `seconds`.
    Returns why it ended early (None when it exited 0 in time)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + seconds
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"stopped after {seconds:.0f} s"
        if line is None:
            break
        if line.startswith("{"):
            on_row(json.loads(line))
    code = proc.wait()
    return None if code == 0 else f"exit {code}"


def t4_section(section, model: str, python=sys.executable):
    import t4_measure
    seconds = section.deadline - time.monotonic()
    cmd = [python, os.path.join(REPO, "scripts", "t4_measure.py"), "--model", model, "--seconds", f"{seconds:.0f}"]
    done = []

    def on_row(row):
        done.append(row["name"])
        section.add(row)
        section.target(row["name"], t4_value(row), f"cost model within +-{t4_measure.TOLERANCE:.0%} of the measured",
                       row.get("within_target", False))
    ended = stream_rows(cmd, seconds, on_row)
    section.skipped += [r["name"] for r in t4_measure.rows_of(model) if r["name"] not in done]
    if ended and not ended.startswith("stopped"):  # stopped at the budget: its rows left are listed as skipped
        raise RuntimeError(f"t4_measure.py --model {model}: {ended}")


def t4_value(row: dict) -> str:
    if "error" in row:
        return row["error"]
    measured = f"{row['total_throughput']:.2f} tok/s at batch {row['batch']}"
    if not row.get("predicted"):
        return measured + ", no prediction (no profile)"
    return f"{measured}, predicted {row['predicted']['total_throughput']:.2f} ({row['measured_over_predicted']:.2f})"


# -- the report ------------------------------------------------------------------------------------------
def describe(r: dict, header: bool) -> str:
    if header:
        notes = " Notes: " + "; ".join(r["notes"]) if r.get("notes") else ""
        return "\n".join([f"# GPU benchmarks on {r['device']}", "",
                          f"{machine_line(r)} FlexGen from {r['flexgen_from']}. OPT dummy float16 weights "
                          f"throughout.{notes}"])
    s, lines = r["sections"], []
    rows = s.get("vs-flexgen", {}).get("rows", [])
    if rows:
        lines += ["## FlexGen 0.1.8 beside flexh2o (same placement, batch, lengths; FlexGen's protocol)", ""]
        lines += vs.table(rows) + [""]
    for name in ("t4 opt-6.7b", "t4 opt-30b"):
        rows = s.get(name, {}).get("rows", [])
        if rows:
            lines += [f"## The H2O paper's T4 settings, {name.split()[1]}, under --gpu-mem 16GB", ""] + t4_table(rows)
            lines.append("")
    return "\n".join(lines)


def t4_table(rows: list) -> list:
    lines = ["| setting | paper (T4) tok/s, batch | batch here | steps run | measured total / decode tok/s | "
             "predicted total / decode | measured / predicted | within +-25% |", "|---|---|---|---|---|---|---|---|"]
    for x in rows:
        shape = f"{x['batch']} ({x['gpu_batch_size']} x {x['num_gpu_batches']})" + \
            (f"; {x['batch_note']}" if x["batch_note"] else "")
        measured = f"**{x['error'].replace('|', '/')}**" if "error" in x else \
            f"{x['total_throughput']:.2f} / {x['decode_throughput']:.2f}"
        p = x.get("predicted")
        predicted = f"{p['total_throughput']:.2f} / {p['decode_throughput']:.2f}" if p else "no profile"
        ratio = f"{x['measured_over_predicted']:.2f}" if "measured_over_predicted" in x else ""
        within = "" if "within_target" not in x else "yes" if x["within_target"] else "**no**"
        lines.append(f"| {x['name']} | {x['paper_tok_s']}, {x['paper_batch']} | {shape} | {x['steps_run']} of "
                     f"{x['gen_len']} | {measured} | {predicted} | {ratio} | {within} |")
    return lines


def main(argv=None) -> int:
    ap = OneLineErrorParser(description="Measures flexh2o on a CUDA machine (make gpu-bench).")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "gpu_bench"))
    ap.add_argument("--vs-flexgen-out", default=os.path.join(REPO, "results", "vs_flexgen"))
    ap.add_argument("--flexgen-wheel-dir", default=os.path.join(REPO, "wheels"), metavar="DIR",
                    help=f"flexgen 0.1.8's and attrs' wheels (`{vs.PREPARE}`)")
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for the whole benchmark")
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error(f"--budget: must be positive, got {args.budget:g}")
    import torch
    if not torch.cuda.is_available():
        print(f"gpu-bench: no CUDA device (torch {torch.__version__}): nothing measured")
        return 0
    notes = []
    try:
        wheels = vs.flexgen_pythonpath(args.flexgen_wheel_dir)
    except UsageError as e:
        wheels = []
        notes.append(f"FlexGen cannot run: {e}")
        print(f"gpu-bench: {notes[-1]}", flush=True)
    header = {**vs.header("make gpu-bench", wheels), "notes": notes}
    copies = [os.environ["GPU_CHECK_OUT"]] if os.environ.get("GPU_CHECK_OUT") else []
    outs = [args.out] + [os.path.join(d, "gpu_bench") for d in copies]
    vs_outs = [args.vs_flexgen_out] + [os.path.join(d, "vs_flexgen") for d in copies]
    check = Check(outs, args.budget, header, describe)
    check.run("profile", BUDGETS["profile"], profile_section)
    check.run("vs-flexgen", BUDGETS["vs-flexgen"], lambda s: vs_flexgen_section(s, wheels, vs_outs, header))
    for model in ("opt-6.7b", "opt-30b"):
        check.run(f"t4 {model}", BUDGETS[f"t4 {model}"], lambda s: t4_section(s, model))
    print(check.markdown())
    return 0 if check.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
