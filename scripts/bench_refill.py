"""Refilled slots against fixed blocks and the transformers loop: a job whose records stop anywhere.

    python scripts/bench_refill.py                   # 500 prompts in 5 chunks, hours on 2 cores
    python scripts/bench_refill.py --chunks 1        # at most one more chunk now; run again to go on

The prompts are bench_dataset.py's chat prompts about Shakespeare passages (16-400 tokens); each
record asks for its own max_tokens, drawn uniformly from --min-tokens..--max-tokens, and stops at
EOS where the model ends it first. SmolLM2-135M-Instruct from its GGUF, float32, greedy, the same
batch for every contender, each in a child process under the same memory cgroup:

- refilled: flexh2o's dataset job as it runs by default, each stopped record's slot taking the
  next record;
- fixed: the same job with --fixed-blocks (length-sorted blocks, each run to its longest member);
- hf-sorted: transformers' `generate` over the job's sorted blocks, each block to its largest
  max_tokens, padded to its longest prompt (bench_dataset.py's loop).

Chunks run the contenders in turn, the first one rotating from chunk to chunk; finished chunks
are kept in results/refill.json so the command can stop and go on. Writes results/refill.{json,md}.
"""

import argparse
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_quality import MODEL, shakespeare_texts  # noqa: E402
from job_agreement import chat_prompts  # noqa: E402
from memory_budget import exit_on_sigterm, run_in_budget  # noqa: E402

CONTENDERS = ("refilled", "fixed", "hf-sorted")
LABELS = {"refilled": "flexh2o job, refilled slots", "fixed": "flexh2o job, fixed blocks",
          "hf-sorted": "transformers, the job's sorted blocks"}
SETTINGS = ("prompts", "total_chunks", "batch", "min_tokens", "max_tokens", "memory", "seed")
KEYS = ("wall_seconds", "prompt_tokens", "computed_prompt_tokens", "generated_tokens", "decode_slots")


def make_chunks(args, work: str) -> list[str]:
    """Chunk files of one length distribution, each record with its own max_tokens."""
    from flexh2o.runs.prompts import load_tokenizer
    tokenizer = load_tokenizer(MODEL)
    prompts = chat_prompts(shakespeare_texts(args.data_dir).values(), tokenizer, args.prompts, args.seed)
    rng = random.Random(args.seed + 3)
    limits = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    order = list(range(len(prompts)))
    random.Random(args.seed + 2).shuffle(order)
    paths = []
    for c in range(args.total_chunks):
        path = os.path.join(work, f"chunk{c}.jsonl")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for n in order[c:: args.total_chunks]:
                f.write(json.dumps({"id": f"p{n}", "messages": prompts[n], "max_tokens": limits[n]}) + "\n")
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def run_contender(name: str, chunk: str, args, work: str) -> dict:
    out = os.path.join(work, f"{name}.{os.path.basename(chunk)}.out.jsonl")
    if name == "hf-sorted":
        argv = [sys.executable, os.path.join(os.path.dirname(__file__), "bench_dataset.py"), "--child", "hf-sorted",
                "--chunk-file", chunk, "--out-file", out, "--batch", str(args.batch),
                "--max-tokens", str(args.max_tokens)]
    else:
        summary = os.path.join(work, "summary.json")
        argv = [sys.executable, "-m", "flexh2o.run", "--model", MODEL, "--input", chunk, "--output", out,
                "--overwrite", "--quiet", "--dtype", "float32", "--gpu-batch-size", str(args.batch),
                "--gen-len", str(args.max_tokens), "--json-out", summary]
        argv += ["--fixed-blocks"] if name == "fixed" else []
    run = run_in_budget(argv, args.memory, f"flexh2o-refill-{name}", timeout=4 * 3600)
    if run.returncode != 0 or run.oom_killed or run.timed_out:
        return {"failed": True, "returncode": run.returncode, "oom_killed": run.oom_killed,
                "timed_out": run.timed_out, "peak_bytes": run.peak_bytes}
    if name == "hf-sorted":
        result = run.result
    else:
        job = json.load(open(summary))["job"]
        result = {k: job[k] for k in KEYS + ("refills", "join_steps")}
    texts = {}
    for line in open(out, encoding="utf-8"):
        r = json.loads(line)
        texts[r.get("id")] = r["text"]
    return {**result, "peak_bytes": run.peak_bytes, "cpu": args.cpu, "texts": texts}


def totals(state: dict) -> dict:
    done = [c for c in state["chunks"].values()
            if all(name in c and not c[name].get("failed") for name in CONTENDERS)]
    out = {"chunks": len(done), "cpus": sorted({c[name].get("cpu", "?") for c in done for name in CONTENDERS})}
    for name in CONTENDERS:
        rows = [c[name] for c in done]
        s = {k: sum(r[k] for r in rows) for k in KEYS}
        s["peak_bytes"] = max((r["peak_bytes"] for r in rows), default=0)
        s["tokens_per_second"] = s["generated_tokens"] / s["wall_seconds"] if s["wall_seconds"] else 0.0
        s["padding_share"] = 1 - s["prompt_tokens"] / s["computed_prompt_tokens"] if rows else 0.0
        s["slots_wasted_after_stop"] = 1 - s["generated_tokens"] / s["decode_slots"] if rows else 0.0
        out[name] = s
    out["same_text_as_fixed"] = sum(c["refilled"]["texts"].get(i) == t for c in done
                                    for i, t in c["fixed"]["texts"].items())
    out["records"] = sum(len(c["fixed"]["texts"]) for c in done)
    return out


def markdown(state: dict, t: dict) -> str:
    a = state["settings"]
    lines = [f"# Refilled slots against fixed blocks: SmolLM2, {t['records']} real prompts, max_tokens "
             f"{a['min_tokens']}-{a['max_tokens']}", "",
             f"Machine: {' and '.join(t['cpus'])}, {state['machine']['physical_cores']} cores, torch "
             f"{state['machine']['torch']}. Command: `{state['command']}`. SmolLM2-135M-Instruct (GGUF, float32), "
             f"chat prompts about Shakespeare passages of 16-400 tokens, greedy, each record's max_tokens drawn "
             f"uniformly from {a['min_tokens']}-{a['max_tokens']}, EOS respected, batch {a['batch']}, each run in its "
             f"own process under a {a['memory'] / 2**30:.1f} GiB memory cgroup; {t['chunks']} of "
             f"{a['total_chunks']} chunks, the contenders in turn, the first one rotating. Wall time from reading "
             "the prompts to the last result written, the model's loading excluded.", "",
             "| contender | generated tokens | wall s | generated tok/s | vs fixed blocks | vs transformers sorted "
             "| padding | slots wasted after stop | peak memory |", "|---|---|---|---|---|---|---|---|---|"]
    for name in CONTENDERS:
        s = t[name]
        rate = s["tokens_per_second"]
        lines.append(f"| {LABELS[name]} | {s['generated_tokens']} | {s['wall_seconds']:.0f} | {rate:.2f} | "
                     f"{rate / t['fixed']['tokens_per_second']:.2f}x | "
                     f"{rate / t['hf-sorted']['tokens_per_second']:.2f}x | {s['padding_share']:.1%} | "
                     f"{s['slots_wasted_after_stop']:.1%} | {s['peak_bytes'] / 2**30:.2f} GiB |")
    lines += ["", f"Records whose text the refilled job and the fixed blocks agree on: {t['same_text_as_fixed']} of "
              f"{t['records']}.", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--total-chunks", type=int, default=5)
    p.add_argument("--chunks", type=int, default=None, help="at most this many more chunks in this run")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--memory", type=float, default=3.0, help="GiB, the cgroup of every contender")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--fresh", action="store_true", help="start again instead of going on")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--out", default="results/refill")
    args = p.parse_args()
    exit_on_sigterm()
    from flexh2o.host.machine import describe_machine
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    args.memory = int(args.memory * 2**30)
    settings = {k: getattr(args, k) for k in SETTINGS}
    state_path = args.out + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(state_path)), exist_ok=True)
    state = json.load(open(state_path)) if os.path.exists(state_path) and not args.fresh else None
    if state is not None and state["settings"] != settings:
        sys.exit(f"{state_path} holds a run with other settings ({state['settings']}): give --fresh to start again")
    if state is None:
        state = {"settings": settings, "chunks": {}}
    work = os.path.join(args.data_dir, "bench_refill")
    os.makedirs(work, exist_ok=True)
    chunks = make_chunks(args, work)
    state.update(command="python scripts/bench_refill.py " + " ".join(sys.argv[1:]), machine=describe_machine())
    args.cpu = state["machine"]["cpu"]
    ran = 0
    for c, chunk in enumerate(chunks):
        done = state["chunks"].setdefault(str(c), {})
        for name in [n for n, r in done.items() if r.get("failed")]:
            del done[name]
        if all(name in done for name in CONTENDERS):
            continue
        if args.chunks is not None and ran >= args.chunks:
            break
        turn = CONTENDERS[c % len(CONTENDERS):] + CONTENDERS[: c % len(CONTENDERS)]
        for name in turn:
            if name in done:
                continue
            print(f"chunk {c}: {name}", flush=True)
            done[name] = run_contender(name, chunk, args, work)
            r = done[name]
            print(f"  {name}: " + ("failed" if r.get("failed") else
                                   f"{r['generated_tokens']} tokens in {r['wall_seconds']:.0f} s"), flush=True)
            write_json_atomic(state_path, state)
        ran += 1
    t = totals(state)
    state["totals"] = t
    write_json_atomic(state_path, state)
    if t["chunks"]:
        write_text_atomic(args.out + ".md", markdown(state, t))
        print(markdown(state, t))


if __name__ == "__main__":
    main()
