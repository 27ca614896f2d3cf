"""Refilled slots against fixed blocks and the transformers loop: a job whose records stop anywhere.

    python scripts/bench_refill.py                   # 500 prompts in 5 chunks, hours on 2 cores
    python scripts/bench_refill.py --chunks 1        # at most one more chunk now; run again to go on

The prompts are bench_dataset.py's chat prompts about Shakespeare passages (16-400 tokens); each
record asks for its own max_tokens, drawn uniformly from --min-tokens..--max-tokens, and stops at
EOS where the model ends it first. SmolLM2-135M-Instruct from its GGUF, float32 activations, greedy,
the same batch for every contender, each in a child process under the same memory cgroup:

- refilled: flexh2o's dataset job as it runs by default, each stopped record's slot taking the
  next record (the file's Q4_1 matrices kept as their blocks, as flexh2o does in float32);
- fixed: the same job with --fixed-blocks (length-sorted blocks, each run to its longest member);
- hf-sorted: transformers' `generate` over the job's sorted blocks, each block to its largest
  max_tokens, padded to its longest prompt (bench_dataset.py's loop), the file widened to float32
  (transformers' GGUF loading);
- llama-server: llama.cpp's own server with continuous batching, --batch parallel slots, built
  from the tree the llama-cpp-python sdist vendors (bench_vs_llamacpp.py), on the same GGUF with
  the same threads; the job's prompt token ids (chat template applied) are sent to /completion by
  --batch client threads at once, greedy, each with its own n_predict. It multiplies the file's
  Q4_1 weights by 8-bit activations, its KV cache in float16; its generated tokens are its
  `tokens_predicted`. Where it cannot be built its rows are left out.

Chunks run the contenders in turn, the first one rotating from chunk to chunk; finished chunks
are kept in results/refill.json so the command can stop and go on. Writes results/refill.{json,md}.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_quality import MODEL, shakespeare_texts  # noqa: E402
from job_agreement import chat_prompts  # noqa: E402
from memory_budget import exit_on_sigterm, run_in_budget  # noqa: E402

CONTENDERS = ("refilled", "fixed", "hf-sorted", "llama-server")
LABELS = {"refilled": "flexh2o job, refilled slots", "fixed": "flexh2o job, fixed blocks",
          "hf-sorted": "transformers, the job's sorted blocks", "llama-server": "llama-server, parallel slots"}
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


def child_llama_server(args):
    """Starts llama-server (in this child's cgroup), waits until it has loaded the model, then sends
    every record of the chunk from --batch threads and reports the wall time of the sending."""
    import queue
    import subprocess
    import threading
    import time
    import urllib.request
    from bench_dataset import read_requests
    from flexh2o.runs.prompts import load_tokenizer
    tokenizer = load_tokenizer(MODEL)
    requests, rows = read_requests(args.chunk_file, tokenizer)
    context = max(len(r) for r in rows) + args.max_tokens + 8
    port = 18000 + os.getpid() % 1000
    threads = str(os.cpu_count() or 2)
    server = subprocess.Popen([args.server, "-m", MODEL, "--host", "127.0.0.1", "--port", str(port),
                               "-np", str(args.batch), "-c", str(args.batch * context), "-t", threads, "-tb", threads,
                               "-b", "2048", "-ub", "512", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not come up")
        todo, results = queue.Queue(), {}
        for n in range(len(requests)):
            todo.put(n)

        def client():
            while True:
                try:
                    n = todo.get_nowait()
                except queue.Empty:
                    return
                body = json.dumps({"prompt": rows[n], "n_predict": requests[n].max_tokens, "temperature": 0,
                                   "top_k": 1, "cache_prompt": False}).encode()
                reply = urllib.request.urlopen(urllib.request.Request(url + "/completion", body,
                                                                      {"Content-Type": "application/json"}),
                                               timeout=3600)
                results[n] = json.loads(reply.read())
        start = time.perf_counter()
        workers = [threading.Thread(target=client) for _ in range(args.batch)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait()
    with open(args.out_file, "w", encoding="utf-8") as f:
        for n, request in enumerate(requests):
            f.write(json.dumps({"id": request.id, "text": results[n]["content"]}) + "\n")
    generated = sum(results[n]["tokens_predicted"] for n in results)
    prompt = sum(len(r) for r in rows)
    from memory_budget import report_result
    report_result({"wall_seconds": seconds, "prompt_tokens": prompt, "computed_prompt_tokens": prompt,
                   "generated_tokens": generated, "decode_slots": generated})


def run_contender(name: str, chunk: str, args, work: str) -> dict:
    out = os.path.join(work, f"{name}.{os.path.basename(chunk)}.out.jsonl")
    if name == "llama-server":
        if args.server is None:
            return {"skipped": args.server_missing}
        argv = [sys.executable, __file__, "--child", "llama-server", "--server", args.server, "--chunk-file", chunk,
                "--out-file", out, "--batch", str(args.batch), "--max-tokens", str(args.max_tokens)]
    elif name == "hf-sorted":
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
    if name in ("hf-sorted", "llama-server"):
        result = run.result
    else:
        job = json.load(open(summary))["job"]
        result = {k: job[k] for k in KEYS + ("refills", "join_steps")}
    texts = {}
    for line in open(out, encoding="utf-8"):
        r = json.loads(line)
        texts[r.get("id")] = r["text"]
    return {**result, "peak_bytes": run.peak_bytes, "cpu": args.cpu, "texts": texts}


def ran(state: dict) -> list[str]:
    """The contenders with results (llama-server is left out where it could not be built)."""
    return [n for n in CONTENDERS if any("wall_seconds" in c.get(n, {}) for c in state["chunks"].values())]


def totals(state: dict) -> dict:
    names = ran(state)
    done = [c for c in state["chunks"].values() if all("wall_seconds" in c.get(name, {}) for name in names)]
    out = {"chunks": len(done), "cpus": sorted({c[name].get("cpu", "?") for c in done for name in names}),
           "contenders": names}
    for name in names:
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
             f"{state['machine']['torch']}. Command: `{state['command']}`. SmolLM2-135M-Instruct (its Q4_1 GGUF, float32 "
             "activations: flexh2o keeps the file's blocks, transformers widens them, llama-server multiplies "
             "them by 8-bit activations), "
             f"chat prompts about Shakespeare passages of 16-400 tokens, greedy, each record's max_tokens drawn "
             f"uniformly from {a['min_tokens']}-{a['max_tokens']}, EOS respected, batch {a['batch']}, each run in its "
             f"own process under a {a['memory'] / 2**30:.1f} GiB memory cgroup; {t['chunks']} of "
             f"{a['total_chunks']} chunks, the contenders in turn, the first one rotating. Wall time from reading "
             "the prompts to the last result written, the model's loading excluded.", "",
             "| contender | generated tokens | wall s | generated tok/s | vs fixed blocks | vs transformers sorted "
             "| vs llama-server | padding | slots wasted after stop | peak memory |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    server = t.get("llama-server", {}).get("tokens_per_second")
    for name in t["contenders"]:
        s = t[name]
        rate = s["tokens_per_second"]
        lines.append(f"| {LABELS[name]} | {s['generated_tokens']} | {s['wall_seconds']:.0f} | {rate:.2f} | "
                     f"{rate / t['fixed']['tokens_per_second']:.2f}x | "
                     f"{rate / t['hf-sorted']['tokens_per_second']:.2f}x | "
                     f"{f'{rate / server:.2f}x' if server else '-'} | {s['padding_share']:.1%} | "
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
    p.add_argument("--llama-workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--child", choices=["llama-server"], help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--chunk-file", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_llama_server(args)
    exit_on_sigterm()
    from bench_vs_llamacpp import build_llama_cpp
    args.server = args.server_missing = None
    try:
        args.server = build_llama_cpp(os.path.join(args.llama_workdir, "llama.cpp"),
                                      lambda line: print(line, flush=True), "llama-server")
    except (RuntimeError, OSError, subprocess.TimeoutExpired, IndexError) as e:
        args.server_missing = f"llama.cpp's server could not be built here ({e})"
        print(f"note: {args.server_missing}", flush=True)
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
        for name in [n for n, r in done.items() if r.get("skipped") and args.server]:
            del done[name]  # llama-server could not be built before and can now
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
            print(f"  {name}: " + ("failed" if r.get("failed") else r["skipped"] if r.get("skipped") else
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
