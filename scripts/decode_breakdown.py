"""Where a CPU decode step goes, beside llama.cpp's step and the floor set by memory bandwidth.

    python scripts/decode_breakdown.py       # SmolLM2-135M Q4_1, 128 + 64 tokens, batch 1, 8 and 32

flexh2o runs with scripts/bench_vs_llamacpp.py's flags (--compress-weight: the file's blocks
multiplied as stored; weights and cache in memory; the whole batch one gpu-batch; greedy, no stop at
EOS), in this process, with timers around the parts of a step. A part's time is its outermost
timer's, so the LM head's product counts as the LM head, not as the block product:

- layers in C: the Llama layers' decode steps where they run in C (models/llama_decode.py: a run of
  whole layers in one call, or each half of a layer in one; their norms, products, rotary turns,
  cache appends, attention and residuals; --one-by-one turns both off, so that those parts are
  timed apart);
- block product: the layers' weight products (compression/grouped_weight.py's matmul);
- attention: CachedAttention.attend (the cache's append, the scores, the weighted sum);
- LM head: the logits over the vocabulary;
- sampling: choosing the next tokens from the logits;
- the rest: everything else in the step (per-layer Python and torch's dispatch, norms, rotary
  positions, activations, the schedule's and the sequences' bookkeeping).

Only the decode steps (after the prompt's) are counted, averaged per step; each batch's row is its
fastest of --rounds interleaved runs, beside llama.cpp's fastest. The floor: the bytes of
the weights placed (what a step reads once, the LM head included) over this machine's read
bandwidth with the same threads, measured here (read_bandwidth: the fastest of several ways of
reading 256 MB). llama.cpp's step: llama-batched-bench on the same file, batch and threads (built as
bench_vs_llamacpp.py builds it; skipped with the reason where it cannot be). The timers cost a few
microseconds per call, so the step measured here is a little slower than an untimed one.
Writes results/decode_breakdown.{json,md}.
"""

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PARTS = ("layers in C", "block product", "attention", "LM head", "sampling")


class Timers:
    """Time spent inside wrapped functions during decode steps, each call counted only where no
    other wrapped call is running around it."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.depth = 0
        self.decoding = False

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if self.depth or not self.decoding:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.depth -= 1
        return timed


def install(timers: Timers, one_by_one: bool = False):
    """Wraps the parts where the engine calls them; the schedule's begin_token says when decoding starts."""
    from flexh2o.compression import grouped_weight
    from flexh2o.engine.schedule import Schedule
    from flexh2o.engine.sequences import Sequences
    from flexh2o.models import llama_layers, opt_layers
    from flexh2o.models.cached_attention import CachedAttention
    from flexh2o.models.llama_decode import LayersInOneCall

    for owner, name in ((llama_layers, "attention_step"), (llama_layers, "mlp_step"), (LayersInOneCall, "step")):
        setattr(owner, name, (lambda *args: False) if one_by_one else timers.wrap("layers in C", getattr(owner, name)))
    grouped_weight.matmul = timers.wrap("block product", grouped_weight.matmul)
    CachedAttention.attend = timers.wrap("attention", CachedAttention.attend)
    llama_layers.logits = timers.wrap("LM head", llama_layers.logits)
    opt_layers.logits = timers.wrap("LM head", opt_layers.logits)
    Sequences.pick = timers.wrap("sampling", Sequences.pick)
    begin = Schedule.begin_token

    def begin_token(self, i):
        timers.decoding = i > 0
        return begin(self, i)
    Schedule.begin_token = begin_token


READ_WAYS = [(streams, ahead) for streams in (1, 4, 8) for ahead in (0, 256, 1024)]


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second this machine reads with `threads` threads: the fastest of native/read_rate.c's
    ways of reading 256 MB (READ_WAYS: side-by-side sequences, bytes prefetched ahead) and a torch sum
    over it, each the best of `repeats`. The sum alone is not a bound: it waits on its arithmetic (on a
    2-core EPYC it read 0.5-0.7 of what the plain loads read)."""
    import ctypes

    import torch

    from flexh2o import native
    torch.set_num_threads(threads)
    x = torch.ones(64 << 20)
    x.sum()
    rates = [x.nbytes / min(_timed(x.sum) for _ in range(repeats))]
    lib = native.library()
    if lib is not None:
        fold = ctypes.c_uint64()
        for streams, ahead in READ_WAYS:
            read = lib.read_bytes(x.data_ptr(), x.nbytes, threads, streams, ahead, ctypes.byref(fold))
            rates.append(read / min(_timed(lambda: lib.read_bytes(x.data_ptr(), x.nbytes, threads, streams, ahead,
                                                                  ctypes.byref(fold)))
                                    for _ in range(repeats)))
    return max(rates)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_flexh2o(batch: int, a, timers: Timers, extra=()) -> dict:
    """One run's decode step and its parts; `extra`: more flexh2o.run flags (--flexh2o-flags)."""
    from bench_vs_llamacpp import flexh2o_flags
    from flexh2o.run import main
    timers.seconds = dict.fromkeys(PARTS, 0.0)
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "run.json")
        with contextlib.redirect_stdout(io.StringIO()):  # (the run's own report)
            code = main(flexh2o_flags(batch, a, out) + list(extra))
        if code != 0:
            raise RuntimeError(f"flexh2o.run exited {code}")
        with open(out) as f:
            r = json.load(f)
    steps = r["steps_done"] - 1
    step = r["decode_latency_s"] / steps
    parts = {p: s / steps for p, s in timers.seconds.items()}
    parts["the rest"] = step - sum(parts.values())
    return {"step_s": step, "parts_s": parts, "weight_bytes": r["model_size_bytes"]}


def run_llama(batch: int, a) -> float:
    """llama.cpp's seconds per decode step of the whole batch."""
    from bench_vs_llamacpp import build_llama_cpp, run_llama as batched_bench
    binary = build_llama_cpp(os.path.join(a.workdir, "llama.cpp"), lambda line: print(line, file=sys.stderr))
    return batch / batched_bench(binary, batch, a)["decode_tok_s"]


def table(r: dict) -> str:
    ms = 1e3
    head = ["batch", "step (ms)", *PARTS, "the rest", "floor (ms)", "llama.cpp step (ms)", "flexh2o / llama.cpp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["rows"]:
        step, parts, llama = row["step_s"], row["parts_s"], row.get("llama_step_s")
        cells = [str(row["batch"]), f"{step * ms:.2f}",
                 *(f"{parts[p] * ms:.2f} ({parts[p] / step:.0%})" for p in (*PARTS, "the rest")),
                 f"{row['floor_s'] * ms:.2f}",
                 f"{llama * ms:.2f}" if llama else "skipped", f"{llama / step:.2f}x" if llama else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-llama", action="store_true", help="flexh2o's breakdown only")
    p.add_argument("--one-by-one", action="store_true",
                   help="Llama layers call their kernels one by one (no decode step in one C call): every part timed apart")
    p.add_argument("--flexh2o-flags", default="", metavar="FLAGS",
                   help="more flags for flexh2o's runs, e.g. --flexh2o-flags=--int8-activations")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--out", default=os.path.join(REPO, "results", "decode_breakdown"))
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from flexh2o.host.machine import describe_machine
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic

    timers = Timers()
    install(timers, a.one_by_one)
    bandwidth = read_bandwidth(a.threads)
    best, skipped = {}, None
    for _ in range(a.rounds):  # interleaved; each batch's fastest flexh2o step, with its parts, and llama.cpp's
        for batch in a.batches:
            row = {"batch": batch, **run_flexh2o(batch, a, timers, shlex.split(a.flexh2o_flags))}
            row["floor_s"] = row["weight_bytes"] / bandwidth
            print(json.dumps(row), flush=True)
            llama = best.get(batch, {}).get("llama_step_s")
            if not a.no_llama and skipped is None:
                try:
                    step = run_llama(batch, a)
                    llama = step if llama is None else min(llama, step)
                except RuntimeError as e:
                    skipped = str(e)
            if batch not in best or row["step_s"] < best[batch]["step_s"]:
                best[batch] = row
            if llama is not None:
                best[batch]["llama_step_s"] = llama
    rows = [best[b] for b in a.batches]
    r = {"machine": describe_machine(), "model": os.path.basename(a.model), "dtype": a.dtype,
         "flexh2o_flags": a.flexh2o_flags, "one_by_one": a.one_by_one,
         "prompt_len": a.prompt_len, "gen_len": a.gen_len, "threads": a.threads, "rounds": a.rounds,
         "read_bandwidth_bytes_s": bandwidth, "llama_cpp_skipped": skipped, "rows": rows}
    write_json_atomic(a.out + ".json", r)
    command = "python scripts/decode_breakdown.py" + (f" --flexh2o-flags={a.flexh2o_flags}" if a.flexh2o_flags else "") \
        + (" --one-by-one" if a.one_by_one else "")
    text = (f"# One decode step, part by part\n\n`{command}`: {r['model']}, {a.dtype}, "
            f"{a.prompt_len} + {a.gen_len} tokens, {a.threads} threads, best of {a.rounds} interleaved rounds; "
            f"measured read bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s; floor = weight bytes placed / bandwidth.\n\n{table(r)}\n\n"
            f"Machine: {r['machine']}\n" + (f"\nllama.cpp skipped: {skipped}\n" if skipped else ""))
    write_text_atomic(a.out + ".md", text)
    print(text)


if __name__ == "__main__":
    main()
