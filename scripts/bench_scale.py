"""Data-parallel replicas against one process on the same cores: a dataset job, SmolLM2 in memory.

    python scripts/bench_scale.py                  # 96 prompts, 2 rounds, about 5 minutes on 2 cores

The job: --prompts chat prompts about passages of Shakespeare (as scripts/job_agreement.py makes
them), SmolLM2-135M-Instruct from its GGUF, float32, greedy, up to --max-tokens new tokens, batch
--batch, the model in memory. Two contenders on the same machine, the same total threads:

- one: `python -m flexh2o.run --input ... --output ...`, one process with torch's 2 threads;
- replicas: `torchrun --nproc-per-node 2 -m flexh2o.run ...` (the same flags), each replica one
  thread (torchrun's OMP_NUM_THREADS=1), each taking half the records, rank 0 merging the parts.

Each is timed from the command's start to its exit (both load the model: the replicas twice, at
once), and its job wall time (reading, generating, writing; loading excluded) is read from
--json-out (the replicas': the slower one's). The rounds alternate which goes first. The merged
output is checked against the single process's, text for text. Writes results/scale.{json,md}.
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
    from flexh2o.prompts import load_tokenizer
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


def markdown(args, rounds: list) -> str:
    best = {name: min(r[name]["seconds"] for r in rounds) for name in ("one", "replicas")}
    best_job = {name: min(r[name]["job_seconds"] for r in rounds) for name in ("one", "replicas")}
    tokens = rounds[0]["one"]["generated_tokens"]
    same = sum(rounds[0]["one"]["texts"][i] == rounds[0]["replicas"]["texts"].get(i) for i in rounds[0]["one"]["texts"])
    lines = [
        "# Data-parallel replicas against one process",
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
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--processes", type=int, default=2, help="replicas, and the single process's threads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--out", default="results/scale")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="flexh2o-scale-") as work:
        source = os.path.join(work, "prompts.jsonl")
        write_input(args, source)
        rounds = []
        for r in range(args.rounds):
            order = ("one", "replicas") if r % 2 == 0 else ("replicas", "one")
            rounds.append({name: run(name, args, work, source, r) for name in order})
            print({n: round(rounds[-1][n]["seconds"], 1) for n in order}, flush=True)
    text = markdown(args, rounds)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "rounds": [{n: {k: v for k, v in c.items() if k != "texts"}
                                                   for n, c in r.items()} for r in rounds]}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
