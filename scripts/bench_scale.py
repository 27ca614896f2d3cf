"""Scale-out on one machine: data-parallel replicas and pipeline stages against one process.

    python scripts/bench_scale.py                  # both parts, about 10 minutes on 2 cores
    python scripts/bench_scale.py --part pipeline  # one part

Data parallel (`--part replicas`): a dataset job of --prompts chat prompts about passages of
Shakespeare (as scripts/job_agreement.py makes them), SmolLM2-135M-Instruct from its GGUF,
float32, greedy, up to --max-tokens new tokens, batch --batch, the model in memory. One process
with torch's 2 threads against `torchrun --nproc-per-node 2` (the same flags), each replica one
thread (torchrun's OMP_NUM_THREADS=1) taking half the records, rank 0 merging the parts. Each is
timed from the command's start to its exit (the replicas load the model twice, at once), and by
its job wall time (loading excluded) from --json-out (the replicas': the slower one's). The merged
output is checked against the single process's, text for text.

Pipeline (`--part pipeline`): a model bigger than one process's memory cap. OPT-350M, float32,
dummy weights (1.3 GB), prompt --pp-prompt-len + --pp-gen-len tokens, --pp-batch sequences as 2
gpu-batches, every process under the same --max-memory (enforced by flexh2o's pre-flight, which
counts the process's whole RSS). One process with 2 threads must put part of the weights on disk;
two stages (`torchrun --nproc-per-node 2 ... --pipeline-stages 2`, one thread each) each hold their
half. Each side gets its best placement under the cap: the largest weight share in memory the
pre-flight accepts (tried from 100% down in steps of 5). Disk reads bypass the page cache
(--no-page-cache): served from the page cache, the single process's weights would sit in memory
outside its cap. Throughput is the run's own (tokens / its generate time, rank 0's report for
the pipeline: the first stage sees the whole pipeline's time).

The contenders alternate which goes first, round by round. Writes results/scale.{json,md}.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quality import MODEL, shakespeare_texts  # noqa: E402
from job_agreement import chat_prompts  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_input(args, path: str):
    from flexh2o.runs.prompts import load_tokenizer
    prompts = chat_prompts(shakespeare_texts(args.data_dir).values(), load_tokenizer(MODEL), args.prompts, args.seed)
    with open(path, "w", encoding="utf-8") as f:
        for n, messages in enumerate(prompts):
            f.write(json.dumps({"id": f"p{n}", "messages": messages, "max_tokens": args.max_tokens}) + "\n")


def run(name: str, args, work: str, source: str, round_: int) -> dict:
    out = os.path.join(work, f"{name}{round_}.jsonl")
    stats = os.path.join(work, f"{name}{round_}.json")
    flags = ["-m", "flexh2o.run", "--model", MODEL, "--input", source, "--output", out, "--dtype", "float32",
             "--gpu-batch-size", str(args.batch), "--quiet", "--overwrite", "--json-out", stats]
    if name == "one":
        command, env = [sys.executable, *flags], dict(os.environ, OMP_NUM_THREADS=str(args.processes))
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.processes),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1")
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{name} failed ({done.returncode}): {done.stderr[-2000:]}")
    walls, tokens = [], 0
    for rank in range(1 if name == "one" else args.processes):
        path = stats if rank == 0 else stats.replace(".json", f".rank{rank}.json")
        job = json.load(open(path))["job"]
        walls.append(job["wall_seconds"])
        tokens += job["generated_tokens"]
    return {"seconds": seconds, "job_seconds": max(walls), "replica_job_seconds": walls, "generated_tokens": tokens,
            "texts": {r["id"]: r["text"] for r in map(json.loads, open(out, encoding="utf-8"))}}


PP_MODEL = "opt-350m"


def pipeline_command(args, stages: int, weight_share: int, out: str) -> tuple[list, dict]:
    flags = ["-m", "flexh2o.run", "--model", PP_MODEL, "--dtype", "float32", "--prompt-len",
             str(args.pp_prompt_len), "--gen-len", str(args.pp_gen_len), "--gpu-batch-size", str(args.pp_batch // 2),
             "--num-gpu-batches", "2", "--weights", f"gpu={weight_share},cpu=0,disk={100 - weight_share}",
             "--cache", "gpu=100,cpu=0,disk=0", "--max-memory", args.pp_cap, "--no-page-cache", "--json-out", out,
             "--offload-dir", os.path.join(tempfile.gettempdir(), "flexh2o_scale_offload")]
    if stages == 1:
        return [sys.executable, *flags], dict(os.environ, OMP_NUM_THREADS=str(args.processes))
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *flags, "--pipeline-stages", str(stages)],
            dict(os.environ, OMP_NUM_THREADS="1"))


def run_pipeline_side(args, stages: int, share: int, work: str, tag: str):
    """(exit code, report or None, seconds, stderr) of one run."""
    out = os.path.join(work, f"pp{stages}-{tag}.json")
    command, env = pipeline_command(args, stages, share, out)
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    report = json.load(open(out)) if done.returncode == 0 else None
    return done.returncode, report, seconds, done.stderr


def best_share(args, stages: int, work: str) -> int:
    """The largest weight share in memory (a multiple of 5) whose run the pre-flight accepts under
    the cap: fewer bytes in memory always fit if more do, so a binary search."""
    def fits(share: int) -> bool:
        code, _, _, err = run_pipeline_side(args, stages, share, work, f"probe{share}")
        if code not in (0, 2) or (code == 2 and "--max-memory" not in err):
            sys.exit(f"pipeline probe ({stages} stages, {share}%) failed: {err[-1500:]}")
        return code == 0
    low, high = 0, 20  # in steps of 5; fits(5 * low) is assumed, checked below
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(5 * mid) else (low, mid - 1)
    if low == 0 and not fits(0):
        sys.exit(f"nothing fits {args.pp_cap} with {stages} stage(s)")
    return 5 * low


def pipeline_part(args, work: str) -> dict:
    shares = {stages: best_share(args, stages, work) for stages in (1, 2)}
    print("best weight shares in memory:", shares, flush=True)
    rounds = []
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        this = {}
        for stages in order:
            code, report, seconds, err = run_pipeline_side(args, stages, shares[stages], work, f"r{r}")
            if code != 0:
                sys.exit(f"pipeline run ({stages} stages) failed: {err[-1500:]}")
            this[stages] = {"seconds": seconds, "total_throughput": report["total_throughput"],
                            "decode_throughput": report["decode_throughput"],
                            "prefill_throughput": report["prefill_throughput"]}
        rounds.append(this)
        print({s: round(this[s]["total_throughput"], 2) for s in order}, flush=True)
    return {"shares": shares, "rounds": rounds}


def pipeline_markdown(args, result: dict) -> list[str]:
    rounds, shares = result["rounds"], result["shares"]
    best = {s: max(r[s]["total_throughput"] for r in rounds) for s in (1, 2)}
    decode = {s: max(r[s]["decode_throughput"] for r in rounds) for s in (1, 2)}
    return [
        "## Pipeline stages against one process, a model bigger than the per-process cap",
        "",
        f"{PP_MODEL}, float32, dummy weights, {args.pp_batch} sequences as 2 gpu-batches, "
        f"{args.pp_prompt_len} + {args.pp_gen_len} tokens, every process under `--max-memory {args.pp_cap}`, disk "
        f"reads past the page cache; best of {len(rounds)} rounds, the order alternating.",
        "",
        "| contender | weights in memory (best that fits the cap) | total tok/s | decode tok/s |",
        "|---|---|---|---|",
        f"| one process, {args.processes} threads | {shares[1]}% | {best[1]:.2f} | {decode[1]:.2f} |",
        f"| 2 pipeline stages (torchrun), 1 thread each | {shares[2]}% of each stage's half | {best[2]:.2f} | "
        f"{decode[2]:.2f} |",
        "",
        f"Pipeline against one process: **{best[2] / best[1]:.2f}x** total throughput, "
        f"**{decode[2] / decode[1]:.2f}x** decode.",
        "",
        "Rounds (total tok/s, one / pipeline): " + "; ".join(
            f"{r[1]['total_throughput']:.2f} / {r[2]['total_throughput']:.2f}" for r in rounds) + ".",
    ]


def markdown(args, rounds: list) -> str:
    best = {name: min(r[name]["seconds"] for r in rounds) for name in ("one", "replicas")}
    best_job = {name: min(r[name]["job_seconds"] for r in rounds) for name in ("one", "replicas")}
    tokens = rounds[0]["one"]["generated_tokens"]
    same = sum(rounds[0]["one"]["texts"][i] == rounds[0]["replicas"]["texts"].get(i) for i in rounds[0]["one"]["texts"])
    lines = [
        "## Data-parallel replicas against one process",
        "",
        f"`python scripts/bench_scale.py --prompts {args.prompts} --batch {args.batch} --max-tokens {args.max_tokens}`: "
        f"SmolLM2-135M-Instruct (GGUF), float32, greedy, {args.prompts} chat prompts, up to {args.max_tokens} new tokens, "
        f"batch {args.batch}, the model in memory; {os.cpu_count()} logical cores; best of {len(rounds)} rounds, "
        "the order alternating.",
        "",
        "| contender | end to end (s) | job wall (s, loading excluded) | generated tok/s (job wall) |",
        "|---|---|---|---|",
        f"| one process, {args.processes} threads | {best['one']:.1f} | {best_job['one']:.1f} | "
        f"{tokens / best_job['one']:.1f} |",
        f"| {args.processes} replicas (torchrun), 1 thread each | {best['replicas']:.1f} | {best_job['replicas']:.1f} | "
        f"{tokens / best_job['replicas']:.1f} |",
        "",
        f"Replicas against one process: **{best['one'] / best['replicas']:.2f}x** end to end, "
        f"**{best_job['one'] / best_job['replicas']:.2f}x** in job wall time. Texts identical to the single "
        f"process's: {same} of {len(rounds[0]['one']['texts'])}.",
        "",
        "Rounds (end to end s / job s): " + "; ".join(
            f"one {r['one']['seconds']:.1f} / {r['one']['job_seconds']:.1f}, replicas {r['replicas']['seconds']:.1f} / "
            f"{r['replicas']['job_seconds']:.1f} (each replica {', '.join(f'{s:.1f}' for s in r['replicas']['replica_job_seconds'])})"
            for r in rounds) + ".",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--processes", type=int, default=2, help="replicas, and the single process's threads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--part", choices=("replicas", "pipeline", "both"), default="both")
    p.add_argument("--pp-batch", type=int, default=8)
    p.add_argument("--pp-prompt-len", type=int, default=128)
    p.add_argument("--pp-gen-len", type=int, default=32)
    p.add_argument("--pp-cap", default="1.2GB", help="--max-memory of every process in the pipeline part")
    p.add_argument("--out", default="results/scale")
    args = p.parse_args()
    saved = json.load(open(args.out + ".json")) if os.path.exists(args.out + ".json") else {}
    with tempfile.TemporaryDirectory(prefix="flexh2o-scale-") as work:
        if args.part in ("replicas", "both"):
            source = os.path.join(work, "prompts.jsonl")
            write_input(args, source)
            rounds = []
            for r in range(args.rounds):
                order = ("one", "replicas") if r % 2 == 0 else ("replicas", "one")
                rounds.append({name: run(name, args, work, source, r) for name in order})
                print({n: round(rounds[-1][n]["seconds"], 1) for n in order}, flush=True)
            saved["replicas"] = {"args": vars(args), "markdown": markdown(args, rounds),
                                 "rounds": [{n: {k: v for k, v in c.items() if k != "texts"} for n, c in r.items()}
                                            for r in rounds]}
        if args.part in ("pipeline", "both"):
            result = pipeline_part(args, work)
            saved["pipeline"] = {"args": vars(args), "markdown": "\n".join(pipeline_markdown(args, result)),
                                 "result": result}
    text = "\n\n".join(["# Scale-out on one machine", *(saved[k]["markdown"] for k in ("replicas", "pipeline")
                                                          if k in saved)]) + "\n"
    with open(args.out + ".json", "w") as f:
        json.dump(saved, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
