"""A float32 dataset job against the transformers loop on the same blocks, from a float checkpoint.

    python scripts/bench_float32_job.py              # 64 prompts, 2 rounds: about half an hour on 2 cores

bench_refill.py measures the GGUF, whose 4-bit matrices flexh2o multiplies as stored while
transformers widens them. Here both run SmolLM2-135M-Instruct as a float32 safetensors directory
(made once from the GGUF by transformers, in --data-dir), so both multiply the same float32
matrices. The prompts are bench_refill.py's (chat prompts about Shakespeare passages), each record
with its own max_tokens drawn from --min-tokens..--max-tokens, greedy, EOS respected, batch --batch,
each run in its own process under the same memory cgroup:

- fixed: flexh2o's job with --fixed-blocks in the default dtype (float32): length-sorted blocks,
  each run to its longest member;
- hf-sorted: transformers' `generate` over the same blocks (bench_dataset.py's loop);
- refilled: flexh2o's job as it runs by default (refilled slots);
- fixed-bfloat16: the fixed job with --dtype bfloat16, where the CPU multiplies bfloat16 natively
  (AMX, AVX512-BF16): what the float32 default costs there. Left out elsewhere.

The contenders run in turn, --rounds times, the first one rotating. Writes
results/float32_job.{json,md}.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_quality import MODEL  # noqa: E402
from bench_refill import make_chunks  # noqa: E402
from memory_budget import exit_on_sigterm, run_in_budget  # noqa: E402

LABELS = {"fixed": "flexh2o job, fixed blocks, float32", "hf-sorted": "transformers, the same blocks, float32",
          "refilled": "flexh2o job, refilled slots, float32", "fixed-bfloat16": "flexh2o job, fixed blocks, bfloat16"}
KEYS = ("wall_seconds", "prompt_tokens", "generated_tokens", "decode_slots")


def float32_directory(data_dir: str) -> str:
    """SmolLM2 as transformers widens its GGUF, saved as float32 safetensors with its tokenizer."""
    path = os.path.join(data_dir, "smollm2-135m-float32")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import shutil
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        where, name = os.path.dirname(MODEL), os.path.basename(MODEL)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        os.makedirs(path + ".tmp")
        # transformers will not save a model loaded from GGUF: its tensors and config are written here
        tied = model.config.tie_word_embeddings
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
                  os.path.join(path + ".tmp", "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(path + ".tmp", "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def run_contender(name: str, chunk: str, model: str, args, work: str) -> dict:
    out = os.path.join(work, f"{name}.out.jsonl")
    if name == "hf-sorted":
        argv = [sys.executable, os.path.join(os.path.dirname(__file__), "bench_dataset.py"), "--child", "hf-sorted",
                "--model", model, "--chunk-file", chunk, "--out-file", out, "--batch", str(args.batch),
                "--max-tokens", str(args.max_tokens)]
    else:
        summary = os.path.join(work, "summary.json")
        argv = [sys.executable, "-m", "flexh2o.run", "--model", model, "--input", chunk, "--output", out,
                "--overwrite", "--quiet", "--gpu-batch-size", str(args.batch), "--gen-len", str(args.max_tokens),
                "--json-out", summary]
        argv += [] if name == "refilled" else ["--fixed-blocks"]
        argv += ["--dtype", "bfloat16"] if name == "fixed-bfloat16" else []
    run = run_in_budget(argv, args.memory, f"flexh2o-float32-{name}", timeout=2 * 3600)
    if run.returncode != 0 or run.oom_killed or run.timed_out:
        raise SystemExit(f"{name} failed: exit code {run.returncode}, oom killed {run.oom_killed}, "
                         f"timed out {run.timed_out}")
    result = run.result if name == "hf-sorted" else {k: json.load(open(summary))["job"][k] for k in KEYS}
    texts = {}
    for line in open(out, encoding="utf-8"):
        r = json.loads(line)
        texts[r["id"]] = r["text"]
    return {**result, "peak_bytes": run.peak_bytes, "texts": texts}


def markdown(state: dict) -> str:
    a, names = state["settings"], state["contenders"]
    total = {n: {k: sum(r[n][k] for r in state["rounds"]) for k in KEYS} for n in names}
    rate = {n: total[n]["generated_tokens"] / total[n]["wall_seconds"] for n in names}
    first = state["rounds"][0]
    lines = ["# A float32 dataset job against transformers on the same blocks: SmolLM2 from float32 safetensors", "",
             f"Machine: {state['machine']['cpu']}, {state['machine']['physical_cores']} cores, torch "
             f"{state['machine']['torch']}; bfloat16 natively: {'yes' if state['native_bf16'] else 'no'}. Command: "
             f"`{state['command']}`. {a['prompts']} chat prompts about Shakespeare passages, greedy, each record's "
             f"max_tokens drawn from {a['min_tokens']}-{a['max_tokens']}, EOS respected, batch {a['batch']}, each run "
             f"in its own process under a {a['memory'] / 2**30:.1f} GiB memory cgroup, {len(state['rounds'])} "
             f"round{'s' if len(state['rounds']) > 1 else ''} of the contenders in turn, the first one rotating. Wall time from reading the prompts to the last "
             "result written, the model's loading excluded; sums over the rounds.", "",
             "| contender | generated tokens | wall s | generated tok/s | vs transformers | peak memory |",
             "|---|---|---|---|---|---|"]
    for n in names:
        peak = max(r[n]["peak_bytes"] for r in state["rounds"])
        lines.append(f"| {LABELS[n]} | {total[n]['generated_tokens']} | {total[n]['wall_seconds']:.0f} | "
                     f"{rate[n]:.2f} | {rate[n] / rate['hf-sorted']:.2f}x | {peak / 2**30:.2f} GiB |")
    same = {n: sum(first[n]["texts"].get(i) == t for i, t in first["fixed"]["texts"].items()) for n in names}
    lines += ["", "Records whose text equals the float32 fixed blocks' (first round): " +
              "; ".join(f"{LABELS[n]}: {same[n]} of {len(first['fixed']['texts'])}" for n in names if n != "fixed")
              + ".", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--memory", type=float, default=3.0, help="GiB, the cgroup of every contender")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--out", default="results/float32_job")
    args = p.parse_args()
    exit_on_sigterm()
    from flexh2o.common.output_files import write_results
    from flexh2o.host.machine import cpu_has_native_bf16, describe_machine
    args.memory = int(args.memory * 2**30)
    args.total_chunks = 1
    work = os.path.join(args.data_dir, "bench_float32_job")
    os.makedirs(work, exist_ok=True)
    chunk = make_chunks(args, work)[0]
    model = float32_directory(args.data_dir)
    names = ["fixed", "hf-sorted", "refilled"] + (["fixed-bfloat16"] if cpu_has_native_bf16() else [])
    state = {"settings": {k: getattr(args, k) for k in ("prompts", "batch", "min_tokens", "max_tokens", "memory",
                                                          "seed")},
             "command": "python scripts/bench_float32_job.py " + " ".join(sys.argv[1:]), "machine": describe_machine(),
             "native_bf16": cpu_has_native_bf16(), "contenders": names, "rounds": []}
    for r in range(args.rounds):
        results = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            print(f"round {r}: {name}", flush=True)
            results[name] = run_contender(name, chunk, model, args, work)
            print(f"  {results[name]['generated_tokens']} tokens in {results[name]['wall_seconds']:.0f} s", flush=True)
        state["rounds"].append(results)
    write_results(args.out, state, markdown)


if __name__ == "__main__":
    main()
