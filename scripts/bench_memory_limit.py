"""Never killed by its own plan: flexh2o runs inside a memory cgroup, over a matrix of placements,
and must either stay under the limit or refuse before loading, in one line naming the limit.

    python scripts/bench_memory_limit.py [--limits 1GB 2GB] [--model opt-125m]

Each run is a `python -m flexh2o.run` child in a fresh cgroup of its own (scripts/memory_budget.py);
the child is told nothing of the limit: it finds it in its cgroup. Recorded per run: its exit code,
whether it was OOM-killed, the cgroup's peak (anonymous memory and page cache) and the run's own
figures from --json-out. Results: results/memory_limit.{json,md}. Needs root and a cgroup v1 memory
controller (it says so and stops otherwise).
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from memory_budget import CgroupUnavailable, check_available, exit_on_sigterm, run_in_budget  # noqa: E402
from flexh2o.engine.preflight import parse_size  # noqa: E402
from flexh2o.runs.report import rss_beyond_projection  # noqa: E402

GB = 1 << 30
# (name, flags): placements with the weights and the cache in memory, split, on disk; full and H2O;
# one and several gpu-batches; and planned runs, which pick batch and placement from the limit alone.
MATRIX = [
    ("planned", []),
    ("planned, H2O 20%", ["--hh-ratio", "0.2"]),
    ("in memory", ["--gpu-batch-size", "8", "--weights", "gpu=100", "--cache", "gpu=100"]),
    ("in memory, 4 gpu-batches, H2O", ["--gpu-batch-size", "8", "--num-gpu-batches", "4", "--weights", "gpu=100",
                                       "--cache", "gpu=100", "--hh-ratio", "0.2"]),
    ("split", ["--gpu-batch-size", "8", "--num-gpu-batches", "2", "--weights", "gpu=50,disk=50",
               "--cache", "gpu=50,disk=50"]),
    ("on disk", ["--gpu-batch-size", "8", "--num-gpu-batches", "2", "--weights", "disk=100", "--cache", "disk=100"]),
    ("on disk, H2O", ["--gpu-batch-size", "16", "--weights", "disk=100", "--cache", "disk=100", "--hh-ratio", "0.2"]),
    ("too big for the limit", ["--gpu-batch-size", "512", "--weights", "gpu=100", "--cache", "gpu=100"]),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limits", nargs="+", default=["1GB", "2GB"], help="each cgroup limit the matrix runs under")
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=16)
    args = ap.parse_args()
    limits = [parse_size(text, "--limits") for text in args.limits]
    try:
        check_available()
    except CgroupUnavailable as e:
        sys.exit(f"bench_memory_limit: {e}")
    exit_on_sigterm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for limit, (name, flags) in ((limit, row) for limit in limits for row in MATRIX):
            out = os.path.join(tmp, "report.json")
            argv = [sys.executable, "-m", "flexh2o.run", "--model", args.model, "--dtype", "float32",
                    "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
                    "--offload-dir", os.path.join(tmp, "off"), "--json-out", out, *flags]
            print(f"{name} under {limit / GB:.2f} GB: {' '.join(flags) or '(planned)'}", flush=True)
            run = run_in_budget(argv, limit, "flexh2o-memlimit", timeout=900)
            report = json.load(open(out)) if run.returncode == 0 and os.path.exists(out) else None
            if os.path.exists(out):
                os.remove(out)
            row = {"name": name, "flags": flags, "returncode": run.returncode, "oom_killed": run.oom_killed,
                   "timed_out": run.timed_out, "cgroup_peak_bytes": run.peak_bytes, "limit_bytes": limit,
                   "seconds": run.seconds}
            if report is not None:
                row.update(policy=report["policy"], memory_limit=report["memory_limit"],
                           peak_rss_bytes=report["peak_rss_bytes"], total_throughput=report["total_throughput"],
                           projected_bytes=report["projected_gpu_mem_bytes"] + report["projected_cpu_mem_bytes"],
                           load_transient_bytes=report["load_transient_bytes"],
                           growth_allowed_bytes=report["process_growth_allowed_bytes"],
                           growth_source=report["process_growth_source"],
                           # The peak RSS beyond the RSS at the pre-flight and the projection (loading's or
                           # the run's): what the growth allowance was for.
                           unprojected_rss_bytes=rss_beyond_projection(report))
            row["held"] = not run.oom_killed and not run.timed_out and run.returncode in (0, 2) and \
                run.peak_bytes <= limit
            rows.append(row)
            print(f"  exit {run.returncode}, peak {run.peak_bytes / GB:.2f} GB of {limit / GB:.2f}, "
                  f"{'held' if row['held'] else 'FAILED'}", flush=True)
    write_results(rows, args)
    sys.exit(0 if all(r["held"] for r in rows) else 1)


def write_results(rows, args):
    os.makedirs(os.path.join(REPO, "results"), exist_ok=True)
    with open(os.path.join(REPO, "results", "memory_limit.json"), "w") as f:
        json.dump({"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len, "rows": rows}, f,
                  indent=1)
    lines = [f"# Runs inside a memory cgroup ({args.model}, float32, {args.prompt_len} + {args.gen_len})", "",
             "Each run is a child in a cgroup of its own, told nothing of the limit; exit 2 is a refusal before "
             "loading. `python scripts/bench_memory_limit.py`.", "",
             "| run | exit | OOM-killed | cgroup peak GB | limit GB | batch | placement | projected GB | "
             "loading GB | growth allowed GB | peak RSS beyond the projection GB | total tok/s | held |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("policy")
        batch = f"{p['gpu_batch_size']} x {p['num_gpu_batches']}" if p else ""
        placement = (f"w {p['w_gpu_percent']:g}/{p['w_cpu_percent']:g}, c {p['cache_gpu_percent']:g}/"
                     f"{p['cache_cpu_percent']:g}" if p else "")
        tok = f"{r['total_throughput']:.1f}" if "total_throughput" in r else ""
        projected = f"{r['projected_bytes'] / GB:.2f}" if "projected_bytes" in r else ""
        extra = [f"{r[k] / GB:.2f}" if k in r else "" for k in
                 ("load_transient_bytes", "growth_allowed_bytes", "unprojected_rss_bytes")]
        lines.append(f"| {r['name']} | {r['returncode']} | {r['oom_killed']} | {r['cgroup_peak_bytes'] / GB:.2f} | "
                     f"{r['limit_bytes'] / GB:.2f} | {batch} | {placement} | {projected} | {' | '.join(extra)} | "
                     f"{tok} | {r['held']} |")
    sources = sorted({r["growth_source"] for r in rows if "growth_source" in r})
    lines += ["", f"Growth allowed: {'; '.join(sources)}. Loading: what the pre-flight counts for one layer's "
              "tensors as read, beyond the placed weights. The cgroup's peak includes page cache, which the kernel "
              "reclaims before it kills."]
    with open(os.path.join(REPO, "results", "memory_limit.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
