"""flexh2o against Hugging Face accelerate's disk offload, both under one memory budget the kernel enforces.

    python scripts/bench_vs_accelerate.py      # OPT-1.3B dummy checkpoint, bf16, 32 + 96 tokens, budget 3 GB

Each engine runs in a child process inside a memory cgroup of its own (scripts/memory_budget.py),
limited to --budget: everything the process holds counts (Python and torch, resident weights, KV
cache, activations, page cache it touches), and the kernel OOM-kills it past the limit; an OOM
kill is reported as "did not fit the budget". With the budget below the weights' size (2.6 GB)
plus the process, both engines must stream part of the weights from disk every token step, and
the memory they keep resident is traded against the KV cache, hence the batch. Neither may serve
weight reads from the page cache: flexh2o bypasses it (bypass_page_cache), and for accelerate a
logits processor drops the checkpoint's pages after every token step.

Each engine gets its best configuration under that budget:
- accelerate (`device_map="auto"`, `max_memory`, `offload_folder`; the offloaded weights are read
  from the checkpoint itself): for each resident share of the weights (--acc-resident), the batch
  doubles from --acc-start-batch until a probe run is OOM-killed; probes use the full prompt and
  --probe-gen-len new tokens, so their cache is smaller than at the end. Each share's probe with
  the best throughput projected from it (prefill + (gen_len - 1) x decode step) then runs at full
  length, the best projected first; if that is OOM-killed, the batch steps down (scaled by how far
  into the generation it got) until a run completes. The reported figure is the best measured run.
- flexh2o: `python -m flexh2o.run` as a user runs it, with no caps, no reserve and no placement: it
  finds its cgroup's limit, allows its process's growth as its local profile calibrated it, and
  plans batch and placement from what is left (engine/preflight.py, host/process_memory.py). It runs once before
  accelerate's search and once right after accelerate's last run (interleaved).
Throughput is batch x gen_len / (prefill + decode time), as in FlexGen; the per-token decode step
shows how much of the ratio is batch and how much speed per step. One full run per engine, so
the figures carry the machine's run-to-run noise. Duration: see --help of the flags; about 20
minutes on a machine with bfloat16 matrix units (the one that produced the README's figures).
Writes results/vs_accelerate.{json,md}.
"""

import argparse
import glob
import json
import os
from math import inf
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from flexh2o import Policy  # noqa: E402
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.engine.preflight import layer_bytes, parse_size  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402
from memory_budget import CgroupUnavailable, check_available, exit_on_sigterm, report_result, run_in_budget  # noqa: E402

GB = 1 << 30
DTYPE = cpu_compute_dtype()  # bfloat16 where the CPU multiplies it natively, else float32 (--dtype sets it)
DID_NOT_FIT = ("oom", "timeout")


def make_checkpoint(spec, directory):
    from bench_vs_transformers import opt_model
    if not os.path.exists(os.path.join(directory, "config.json")):
        opt_model(spec, 0, DTYPE).save_pretrained(directory)


def drop_page_cache(paths):
    """Evicts the files' pages (written back first, so dirty pages go too)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- what runs inside the cgroup -------------------------------------------------------------

def child_accelerate(c):
    from transformers import LogitsProcessor, LogitsProcessorList, OPTForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    start = time.perf_counter()
    model = OPTForCausalLM.from_pretrained(c["checkpoint"], device_map="auto", max_memory={"cpu": c["resident"]},
                                           offload_folder=c["offload_dir"], dtype=DTYPE)
    load_s = time.perf_counter() - start
    places = list(getattr(model, "hf_device_map", {"": "cpu"}).values())  # no map: it all fit in max_memory
    files = glob.glob(os.path.join(c["checkpoint"], "*.safetensors")) + \
        [f for f in glob.glob(os.path.join(c["offload_dir"], "**"), recursive=True) if os.path.isfile(f)]
    stamps = []

    class StepClock(LogitsProcessor):
        """Called once per forward pass (prefill, then each decode step): notes the time and drops the
        weights' pages, so the next step reads them from disk."""
        def __call__(self, ids, scores):
            stamps.append(time.perf_counter())
            drop_page_cache(files)
            print(f"PROGRESS {len(stamps)}", flush=True)
            return scores

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    ids, _ = synthetic_prompts(c["batch"], c["prompt_len"], model.config.vocab_size, seed=0)
    drop_page_cache(files)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=c["gen_len"], do_sample=False,
                       logits_processor=LogitsProcessorList([StepClock()]))
        seconds = time.perf_counter() - start
    prefill = stamps[0] - start
    return {"seconds": seconds, "prefill_s": prefill, "decode_s": seconds - prefill,
            "decode_step_s": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), "load_s": load_s,
            "modules_resident": places.count("cpu"), "modules_on_disk": places.count("disk"),
            "threads": torch.get_num_threads()}


def child_flexh2o(c):
    """`python -m flexh2o.run` as a user runs it: no caps, no placement: it finds its cgroup's limit
    and plans batch and placement from it and the machine's profile."""
    from flexh2o.run import main as run_main
    report_path = os.path.join(c["offload_dir"] + "-report.json")
    argv = ["--model", c["checkpoint"], "--dtype", str(DTYPE).removeprefix("torch."), "--prompt-len",
            str(c["prompt_len"]), "--gen-len", str(c["gen_len"]), "--no-page-cache", "--offload-dir", c["offload_dir"],
            "--max-batch", str(c["max_batch"]), "--json-out", report_path]
    if run_main(argv) != 0:
        raise SystemExit("flexh2o.run failed")
    r = json.load(open(report_path))
    os.remove(report_path)
    steps = r["steps_done"]
    return {"seconds": r["total_latency_s"], "prefill_s": r["prefill_latency_s"], "decode_s": r["decode_latency_s"],
            "decode_step_s": r["decode_latency_s"] / max(1, steps - 1), "batch": r["batch_size"],
            "policy": r["policy"], "memory_limit": r["memory_limit"], "peak_rss_bytes": r["peak_rss_bytes"],
            "growth_allowed_bytes": r["process_growth_allowed_bytes"], "growth_source": r["process_growth_source"],
            "threads": torch.get_num_threads()}


def child_main(config: str):
    global DTYPE
    c = json.loads(config)
    DTYPE = getattr(torch, c["dtype"])
    torch.set_grad_enabled(False)
    report_result((child_accelerate if c["engine"] == "accelerate" else child_flexh2o)(c))


# ---- the parent: searches, runs each child under the budget, reports -----------------------

class Runner:
    def __init__(self, args, checkpoint, budget):
        self.args, self.checkpoint, self.budget, self.count = args, checkpoint, budget, 0

    def run(self, engine, batch, gen_len, timeout=None, **config):
        """One child under the budget; returns its figures, or outcome 'oom' / 'timeout' / 'error'."""
        self.count += 1
        offload = os.path.join(self.args.workdir, f"offload-{engine}-{self.count}")
        shutil.rmtree(offload, ignore_errors=True)
        drop_page_cache(glob.glob(os.path.join(self.checkpoint, "*")))
        c = {"engine": engine, "checkpoint": self.checkpoint, "offload_dir": offload, "batch": batch,
             "dtype": str(DTYPE).removeprefix("torch."),
             "prompt_len": self.args.prompt_len, "gen_len": gen_len, **config}
        try:
            r = run_in_budget([sys.executable, os.path.abspath(__file__), "--child", json.dumps(c)],
                              self.budget, f"flexh2o-bench-{engine}", min(timeout or inf, self.args.child_timeout))
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        out = {"engine": engine, "batch": batch, "gen_len": gen_len, **config, "cgroup_peak_bytes": r.peak_bytes,
               "cgroup_failcnt": r.failcnt, "major_faults": r.major_faults, "wall_s": r.seconds, "steps_reached": r.progress}
        if r.oom_killed:
            out["outcome"] = "oom"
        elif r.timed_out:
            out["outcome"] = "timeout"
        elif r.returncode != 0 or r.result is None:
            out["outcome"] = f"error (exit {r.returncode})"
        else:
            out.update(r.result, outcome="ok")
            out["batch"] = batch = r.result.get("batch", batch)  # a planned run chose its own
            out["total_tok_s"] = batch * gen_len / r.result["seconds"]
        print(f"  {engine} batch {batch} gen {gen_len}: {out['outcome']} after {r.seconds:.0f} s, cgroup peak "
              f"{r.peak_bytes / GB:.2f} GB, {r.major_faults} major faults"
              + (f", {out['total_tok_s']:.2f} tok/s, step {out['decode_step_s']:.3f} s" if out["outcome"] == "ok" else ""),
              flush=True)
        return out


def best_run(runs) -> dict:
    """The completed run with the highest throughput (outcome 'none' if none completed)."""
    return max((x for x in runs if x["outcome"] == "ok"), key=lambda x: x["total_tok_s"], default={"outcome": "none"})


def projected_tok_s(probe, gen_len) -> float:
    """Throughput of a full run projected from a short probe: its prefill, then gen_len - 1 steps."""
    return probe["batch"] * gen_len / (probe["prefill_s"] + (gen_len - 1) * probe["decode_step_s"])


def search_accelerate(runner, weights_bytes):
    a = runner.args
    probes = []
    for share in a.acc_resident:
        resident = int(share * weights_bytes)
        batch, last = a.acc_start_batch, None
        while batch >= 1:
            # A probe taking 4x its predecessor's time (at half the batch) is thrashing, not fitting.
            timeout = 4 * last["wall_s"] + 60 if last else None
            p = runner.run("accelerate", batch, a.probe_gen_len, timeout, resident=resident, resident_share=share)
            probes.append(p)
            if p["outcome"] == "ok":
                last = p
                if batch * 2 > a.max_batch:
                    break
                batch *= 2
            elif last or p["outcome"] not in DID_NOT_FIT:
                break
            else:  # even the first batch did not fit: halve down
                batch //= 2
    # Each resident share's best probe runs at full length, the best projected first: a projection
    # from 4 tokens can rank the shares wrongly once the cache has grown.
    ok = [p for p in probes if p["outcome"] == "ok"]
    per_share = [max((p for p in ok if p["resident_share"] == share), key=lambda p: projected_tok_s(p, a.gen_len))
                 for share in a.acc_resident if any(p["resident_share"] == share for p in ok)]
    runs = []
    for best in sorted(per_share, key=lambda p: -projected_tok_s(p, a.gen_len)):
        runs += full_length_runs(runner, best)
    return probes, runs


def full_length_runs(runner, best) -> list:
    """Full-length runs at a probe's resident share, from its batch down until one completes."""
    a = runner.args
    runs, batch = [], best["batch"]
    timeout = 3 * (best["load_s"] + a.gen_len * best["batch"] / projected_tok_s(best, a.gen_len)) + 120
    while batch >= 1:
        r = runner.run("accelerate", batch, a.gen_len, timeout, resident=best["resident"],
                       resident_share=best["resident_share"])
        runs.append(r)
        if r["outcome"] == "ok":
            break
        if r["outcome"] not in DID_NOT_FIT:
            return runs
        # Stopped with the cache at prompt_len + steps: scale the batch to what that much cache holds at the end.
        reached = (r["steps_reached"] or 1) + a.prompt_len - 1
        batch = min(batch - 1, int(batch * reached / (a.prompt_len + a.gen_len) * 0.95) or batch // 2)
    # Near the limit the kernel may keep dropping accelerate's memory-mapped weights and re-reading them:
    # if the run fell short of its projection by over a quarter, try 3/4 of the batch too.
    if runs and runs[-1]["outcome"] == "ok" and runs[-1]["total_tok_s"] < 0.75 * projected_tok_s(best, a.gen_len) \
            and batch > 1:
        runs.append(runner.run("accelerate", batch * 3 // 4, a.gen_len, timeout, resident=best["resident"],
                               resident_share=best["resident_share"]))
    return runs


def run_flexh2o_planned(runner):
    """flexh2o planned from its cgroup's limit alone (issue 25): no caps, no reserve, no placement."""
    a = runner.args
    return [runner.run("flexh2o", None, a.gen_len, planned=True, max_batch=a.max_batch)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--budget", default="3GB", help="memory of each engine's process, enforced by a cgroup")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--probe-gen-len", type=int, default=4, help="new tokens of accelerate's probe runs")
    ap.add_argument("--acc-resident", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                    help="shares of the weights accelerate may keep resident (max_memory), each searched")
    ap.add_argument("--acc-start-batch", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=128, help="largest batch either search tries")
    ap.add_argument("--workdir", default="/tmp/flexh2o_bench_accelerate")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "vs_accelerate"))
    ap.add_argument("--child-timeout", type=float, default=3600,
                    help="seconds after which any run is stopped as thrashing (not fitting); probes and accelerate's "
                    "full runs get tighter limits from the probes before them")
    ap.add_argument("--engines", nargs="+", choices=["flexh2o", "accelerate"], default=["flexh2o", "accelerate"],
                    help="run only these (for checks; the comparison needs both)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="of both engines (default: what this CPU computes fastest in)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DTYPE
    if args.dtype:
        DTYPE = getattr(torch, args.dtype)
    if args.child:
        return child_main(args.child)
    started = time.perf_counter()
    exit_on_sigterm()
    try:
        check_available()
    except CgroupUnavailable as e:
        raise SystemExit(f"error: the memory budget cannot be enforced: {e}; not running unlimited")
    spec = PRESETS[args.model]
    budget = parse_size(args.budget, "--budget")
    checkpoint = os.path.join(args.workdir, f"{args.model}-{str(DTYPE).removeprefix('torch.')}")
    make_checkpoint(spec, checkpoint)
    weights_bytes = sum(layer_bytes(spec.build_layers(), DTYPE.itemsize, Policy()))
    runner = Runner(args, checkpoint, budget)

    ours, probes, theirs = [], [], []
    if "flexh2o" in args.engines:
        print("flexh2o: planned by flexh2o.run itself from the cgroup's limit", flush=True)
        ours = run_flexh2o_planned(runner)
    if "accelerate" in args.engines:
        print("accelerate: probes, then the full run", flush=True)
        probes, theirs = search_accelerate(runner, weights_bytes)
    if set(args.engines) == {"flexh2o", "accelerate"} and best_run(theirs)["outcome"] == "ok":
        # One more run of each, in turn, in the same time window: the machine is shared and drifts.
        h = best_run(theirs)
        ours += run_flexh2o_planned(runner)
        theirs.append(runner.run("accelerate", h["batch"], args.gen_len, 3 * h["wall_s"] + 120, resident=h["resident"],
                                 resident_share=h["resident_share"]))
    f, h = best_run(ours), best_run(theirs)
    result = {"command": "python " + " ".join(sys.argv), "model": args.model,
              "dtype": str(DTYPE).removeprefix("torch."), "budget_bytes": budget,
              "weights_bytes": weights_bytes, "prompt_len": args.prompt_len,
              "gen_len": args.gen_len, "flexh2o_runs": ours, "accelerate_probes": probes, "accelerate_runs": theirs,
              "machine": describe_machine(), "elapsed_s": time.perf_counter() - started}
    if f["outcome"] == h["outcome"] == "ok":
        result["ratio"] = {"total_tok_s": f["total_tok_s"] / h["total_tok_s"], "batch": f["batch"] / h["batch"],
                           "decode_step": h["decode_step_s"] / f["decode_step_s"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out + ".json", result)
    text = markdown(result, args)
    write_text_atomic(args.out + ".md", text)
    print(text)


def describe_run(r, weights_bytes) -> str:
    if r["engine"] == "accelerate":
        where = (f"max_memory {r['resident'] / GB:.2f} GB ({r['resident_share']:.0%} of the weights)"
                 + (f": {r['modules_resident']} modules resident, {r['modules_on_disk']} on disk" if "modules_on_disk" in r else ""))
        return where + ", cache in memory"
    p = r["policy"]
    placement = " ".join(f"{k} {p[k + '_gpu_percent']:g}/{p[k + '_cpu_percent']:g}/"
                         f"{100 - p[k + '_gpu_percent'] - p[k + '_cpu_percent']:g}" for k in ("w", "cache"))
    return (f"planned by flexh2o.run from the cgroup's limit: {p['gpu_batch_size']} x {p['num_gpu_batches']} "
            f"gpu-batches, {placement} (gpu/cpu/disk %); growth allowed {r['growth_allowed_bytes'] / GB:.2f} GB")


def worst_ratio(r) -> float:
    """flexh2o's slowest completed run over accelerate's best."""
    ours = min(x["total_tok_s"] for x in r["flexh2o_runs"] if x["outcome"] == "ok")
    return ours / best_run(r["accelerate_runs"])["total_tok_s"]


def outcome(x) -> str:
    if x["outcome"] == "ok":
        return "ok"
    after = f" after {x['steps_reached']} forward passes" if x["steps_reached"] else ""
    if x["outcome"] == "oom":
        return f"did not fit the budget: OOM-killed{after}"
    if x["outcome"] == "timeout":
        return f"did not fit the budget: stopped as thrashing after {x['wall_s']:.0f} s{after}"
    return f"failed: {x['outcome']}"


def markdown(r, args) -> str:
    m, gb, wb = r["machine"], GB, r["weights_bytes"]
    lines = [f"# flexh2o vs accelerate disk offload: {r['model']} dummy checkpoint, {r['dtype']}, "
             f"{r['prompt_len']}+{r['gen_len']}, memory budget {r['budget_bytes'] / gb:.2f} GB per engine", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}. Command: `{r['command']}` "
             f"({r['elapsed_s'] / 60:.0f} min in all). Each engine ran in its own process inside a memory cgroup "
             f"limited to {r['budget_bytes'] / gb:.2f} GB (memory.limit_in_bytes, and memsw where accounted): "
             "everything the process holds counts, page cache included, and the kernel kills it past the limit. "
             f"The weights are {wb / gb:.2f} GB, so both must stream part of them from disk at every token step. "
             "One run per row; the figure compared is each engine's best completed full-length run.", "",
             "| engine | configuration | batch | prefill s | decode step s | total s | total tok/s | cgroup peak GB "
             "| major faults |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in (("accelerate", r["accelerate_runs"]), ("flexh2o", r["flexh2o_runs"])):
        for x in runs:
            figures = (f"{x['prefill_s']:.1f} | {x['decode_step_s']:.3f} | {x['seconds']:.1f} | {x['total_tok_s']:.2f}"
                       if x["outcome"] == "ok" else f"{outcome(x)} | | |")
            lines.append(f"| {name} | {describe_run(x, wb)} | {x['batch']} | {figures} | "
                         f"{x['cgroup_peak_bytes'] / gb:.2f} | {x['major_faults']} |")
    if not r["accelerate_runs"]:
        lines.append("| accelerate | no probe completed (below) | - | did not fit the budget | | | | | |")
    lines.append("")
    if "ratio" in r:
        q = r["ratio"]
        lines += [f"flexh2o / accelerate total throughput: **{q['total_tok_s']:.2f}x**. Of that, flexh2o runs "
                  f"{q['batch']:.2f}x the batch, and its decode step is {q['decode_step']:.2f}x as fast as "
                  f"accelerate's (accelerate's step time over flexh2o's); per sequence and token step that is "
                  f"{q['decode_step'] * q['batch']:.2f}x. The machine's disk speed drifts between runs: flexh2o's "
                  f"slowest run against accelerate's best is {worst_ratio(r):.2f}x.", ""]
    ok = [x for x in r["flexh2o_runs"] + r["accelerate_runs"] + r["accelerate_probes"] if x["outcome"] == "ok"]
    if any(x["batch"] * 2 > args.max_batch for x in ok):
        lines += [f"Note: the searches stop at --max-batch {args.max_batch}, and a run above came within a doubling "
                  "of it.", ""]
    lines += ["## How each configuration was found", "",
              f"accelerate: probe runs with the full prompt and {args.probe_gen_len} new tokens (their cache is "
              f"smaller than at the end of a full run), batch doubling from {args.acc_start_batch} until one did not "
              "fit, for each resident share; each share's probe with the best projected throughput (prefill + "
              f"{r['gen_len'] - 1} x its decode step) then ran at full length, the best projected first, stepping the "
              "batch down until a run completed (and once more by a quarter if that run fell short of its projection "
              "by over a quarter):",
              "", "| resident share | batch | outcome | prefill s | decode step s | projected tok/s | cgroup peak GB |",
              "|---|---|---|---|---|---|---|"]
    for p in r["accelerate_probes"]:
        figures = (f"{p['prefill_s']:.1f} | {p['decode_step_s']:.3f} | {projected_tok_s(p, r['gen_len']):.2f}"
                   if p["outcome"] == "ok" else " | | ")
        lines.append(f"| {p['resident_share']:.0%} ({p['resident'] / gb:.2f} GB) | {p['batch']} | {outcome(p)} | "
                     f"{figures} | {p['cgroup_peak_bytes'] / gb:.2f} |")
    lines += ["", "flexh2o: `python -m flexh2o.run` with no caps and no placement flags: it read the cgroup's limit "
              "itself and planned batch and placement from it and this machine's profile; it ran once before "
              "accelerate's search and once more right after accelerate's last run (interleaved), and its best "
              "run is compared with accelerate's best. It was given no reserve: the growth it allowed itself "
              "beyond its pre-flight's projection is what its local profile calibrated (host/process_memory.py), "
              f"{'; '.join(sorted({x['growth_source'] for x in r['flexh2o_runs'] if 'growth_source' in x}))}.", ""]
    lines += [
              "accelerate (with transformers 5) keeps its resident weights as memory-mapped checkpoint pages: they "
              "count against its budget as page cache, and when its KV cache grows the kernel may drop some and "
              "read them again (major faults above). flexh2o holds its resident weights in anonymous memory.", "",
              "## What would make this unfair, and why it does not apply", "",
              "- A budget one engine computes for the other, or memory one of them uses outside it: each child "
              "process joins its cgroup before Python starts, so its interpreter, torch, weights, cache, "
              "activations and the page cache it touches are all charged, and the same limit applies to both.",
              "- Weight reads served from the page cache: flexh2o reads with O_DIRECT (or evicts after each "
              "read); accelerate's checkpoint pages are dropped before generation and after every token step "
              "(pages it has mapped as resident weights stay, as they should); the checkpoint's pages are flushed "
              "and dropped before each child starts, so neither inherits them from an earlier run.",
              "- A weak baseline configuration: accelerate's resident size and batch were searched by real runs "
              "under the budget (above), and its figure is its best completed full-length run; flexh2o got no more "
              "than its own pre-flight's choice.",
              "- Different work: the same checkpoint directory, the same synthetic prompts, "
              f"{r['prompt_len']} + {r['gen_len']} tokens greedy without EOS stop, {r['dtype']}, and the same torch "
              "threads (" + ", ".join(sorted({str(x.get("threads")) for x in ok})) + ") in both.",
              "- Load time: excluded for both (neither engine's figure counts loading the weights).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
