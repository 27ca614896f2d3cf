"""How each engine slows down on a shared machine: alone, then beside a fixed CPU hog.

    python scripts/bench_shared_machine.py          # SmolLM2-135M, 16 prompts of 128 + 64 tokens
    python scripts/bench_shared_machine.py --hog 1 --engines flexh2o llama.cpp

The same batch generation (--batch prompts of --prompt-len tokens, --gen-len new tokens each,
greedy, every step run) by three engines, each in a process of its own with the threads it would
take on this machine (flexh2o's default; llama.cpp's -t and -tb set to the usable CPUs;
transformers with torch's default), first alone, then while --hog processes spin on the CPU (a
Python busy loop each: the hog a compile or another job would be). Per engine and condition:
generated tokens per second over the generate call (prefill and decode), and the CPU share it got
(its own CPU seconds over the wall time times the usable CPUs). The slowdown beside the hog over
the share it lost is 1.0 where an engine degrades in proportion to the CPU it gets, more where
the hog costs it more than the CPU it took (threads waiting on a thread the hog stopped, or
spinning while they wait). The runs alternate engines and conditions, --rounds times; tables give
each one's best round, the JSON every round.

flexh2o and transformers read the same GGUF file in float32; llama.cpp (`llama-batched-bench`,
built as bench_vs_llamacpp.py builds it) runs its Q4_1 weights, so only each engine's own ratios
compare, not their tokens per second. llama.cpp's figures are its whole process (its load is a
fraction of a second): its CPU seconds come from the kernel's accounting of the child.
Writes results/shared_machine.{json,md}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flexh2o.host.cpu_limit import usable_cpus  # noqa: E402

MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
ENGINES = ("flexh2o", "llama.cpp", "transformers")
HOG = "while True:\n    pass\n"


def child(args) -> dict:
    """Runs in the engine's own process: one timed generate call after a warm-up; its figures."""
    import torch
    from flexh2o.runs.prompts import synthetic_prompts
    if args.child == "flexh2o":
        from flexh2o import Engine, Policy
        engine = Engine.from_pretrained(MODEL, Policy(gpu_batch_size=args.batch), device="cpu", dtype="float32",
                                        prompt_len=args.prompt_len, gen_len=args.gen_len)
        generate = lambda ids, n: engine.generate(ids, max_new_tokens=n, eos_token_id=None)  # noqa: E731
        vocab = engine.spec.vocab_size
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(MODEL), gguf_file=os.path.basename(MODEL),
                                                     dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0

        def generate(ids, n):
            with torch.inference_mode():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        vocab = model.config.vocab_size
    ids, _ = synthetic_prompts(args.batch, args.prompt_len, vocab, seed=0)
    generate(ids, 2)  # warm-up: one-time kernel selection and allocations
    wall, cpu = time.perf_counter(), time.process_time()
    generate(ids, args.gen_len)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"seconds": wall, "cpu_seconds": cpu, "threads": torch.get_num_threads()}


def run_engine(name: str, args, llama_binary: str | None) -> dict:
    """One engine's generate call in a process of its own: tokens/s and the CPU share it got."""
    if name == "llama.cpp":
        cmd = [llama_binary, "-m", MODEL, "-c", str(args.batch * (args.prompt_len + args.gen_len)), "-b", "2048",
               "-ub", "512", "-npp", str(args.prompt_len), "-ntg", str(args.gen_len), "-npl", str(args.batch),
               "-t", str(args.threads), "-tb", str(args.threads), "--output-format", "jsonl"]
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = process.communicate(timeout=args.timeout)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out + err).splitlines() if line.startswith("{")]
        if process.returncode != 0 or not rows:
            raise RuntimeError(f"llama-batched-bench failed: {err.strip().splitlines()[-1:]}")
        figures = {"seconds": wall, "cpu_seconds": None, "threads": args.threads, "engine_seconds": rows[-1]["t"]}
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed: {done.stderr.strip().splitlines()[-1:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def timed_llama(name, args, llama_binary):
    """llama.cpp's CPU seconds: the child's rusage, read as it is reaped."""
    before = os.times()
    figures = run_engine(name, args, llama_binary)
    after = os.times()
    figures["cpu_seconds"] = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    return figures


def measure(name: str, args, llama_binary: str | None, hog: int) -> dict:
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hog)]
    try:
        if hogs:
            time.sleep(1.0)  # the hog is running before the engine starts
        figures = timed_llama(name, args, llama_binary) if name == "llama.cpp" else run_engine(name, args, None)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    tokens = args.batch * args.gen_len
    figures.update(tok_s=tokens / figures["seconds"],
                   cpu_share=figures["cpu_seconds"] / (figures["seconds"] * args.threads),
                   cpu_seconds_per_token=figures["cpu_seconds"] / tokens)
    return figures


def summary(rounds: list, engines: list) -> dict:
    out = {}
    for name in engines:
        best = {cond: max((r[name][cond] for r in rounds if name in r), key=lambda f: f["tok_s"])
                for cond in ("alone", "hog")}
        slowdown = best["alone"]["tok_s"] / best["hog"]["tok_s"]
        share_lost = best["alone"]["cpu_share"] / best["hog"]["cpu_share"]
        out[name] = {**best, "slowdown": slowdown, "cpu_share_lost": share_lost,
                     "slowdown_per_share_lost": slowdown / share_lost}
    return out


def markdown(result: dict) -> str:
    a = result["settings"]
    lines = [
        "# Engines on a shared machine", "",
        f"Command: `{result['command']}`. {a['batch']} prompts of {a['prompt_len']} tokens, {a['gen_len']} new "
        f"tokens each, greedy; {a['threads']} usable CPUs ({result['machine']['cpu']}); the hog: {a['hog']} "
        f"Python busy loop(s). Best of {a['rounds']} rounds per engine and condition; engines alternate.", "",
        "| engine | threads | tok/s alone | CPU share alone | tok/s beside the hog | CPU share beside it | "
        "slowdown | CPU share lost | slowdown / share lost | CPU s per token alone / beside |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        alone, hog = s["alone"], s["hog"]
        lines.append(f"| {name} | {alone['threads']} | {alone['tok_s']:.1f} | {alone['cpu_share']:.0%} | "
                     f"{hog['tok_s']:.1f} | {hog['cpu_share']:.0%} | {s['slowdown']:.2f}x | "
                     f"{s['cpu_share_lost']:.2f}x | {s['slowdown_per_share_lost']:.2f} | "
                     f"{alone['cpu_seconds_per_token'] * 1e3:.1f} / {hog['cpu_seconds_per_token'] * 1e3:.1f} ms |")
    lines += ["", "Slowdown / share lost: 1.00 where an engine slows in proportion to the CPU it gets; above 1 "
              "the hog costs it more than the CPU it took. flexh2o and transformers run float32 from the GGUF, "
              "llama.cpp its Q4_1 weights: compare each engine's own columns, not tokens per second across "
              "engines.", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--hog", type=int, default=None, help="busy processes beside the engine (default: usable CPUs)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds after which one run is stopped")
    p.add_argument("--llama-workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--out", default=os.path.join(REPO, "results", "shared_machine"))
    p.add_argument("--child", choices=("flexh2o", "transformers"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: `make setup` downloads it")
    args.threads = usable_cpus()
    args.hog = args.threads if args.hog is None else args.hog
    llama_binary = None
    if "llama.cpp" in args.engines:
        from bench_vs_llamacpp import build_llama_cpp
        try:
            llama_binary = build_llama_cpp(os.path.join(args.llama_workdir, "llama.cpp"), print)
        except RuntimeError as e:
            print(f"llama.cpp left out: {e}")
            args.engines.remove("llama.cpp")
    from flexh2o.common.output_files import write_results
    from flexh2o.host.machine import describe_machine
    rounds = []
    for r in range(args.rounds):
        engines = args.engines if r % 2 == 0 else args.engines[::-1]
        row = {}
        for name in engines:
            conditions = ("alone", "hog") if r % 2 == 0 else ("hog", "alone")
            row[name] = {}
            for cond in conditions:
                row[name][cond] = measure(name, args, llama_binary, args.hog if cond == "hog" else 0)
                f = row[name][cond]
                print(f"round {r} {name} {cond}: {f['tok_s']:.1f} tok/s, CPU share {f['cpu_share']:.0%}, "
                      f"{f['threads']} threads", flush=True)
        rounds.append(row)
    settings = {k: getattr(args, k) for k in ("batch", "prompt_len", "gen_len", "hog", "rounds", "threads")}
    result = {"command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
              "machine": describe_machine(), "settings": settings, "rounds": rounds,
              "summary": summary(rounds, args.engines)}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
