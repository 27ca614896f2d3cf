"""flexh2o's server under client load, against the same prompts as an offline job and against
llama.cpp's server with as many slots.

    python scripts/bench_serve.py                      # SmolLM2, 96 prompts, 16 and 64 clients
    python scripts/bench_serve.py --bigger-than-memory # also the 1.26B model in a 1.5 GB cgroup

The prompts are scripts/bench_refill.py's: chat prompts about Shakespeare passages (16-400 tokens),
each record with its own max_tokens drawn from --min-tokens..--max-tokens, greedy, EOS respected.
SmolLM2-135M-Instruct from its Q4_1 GGUF, --batch rows (slots) for every contender, each contender
in its own process under the same memory cgroup, with the same threads:

- job: `python -m flexh2o.run --input` over the records (refilled slots), its own wall time (the
  model's loading excluded);
- flexh2o-serve: `python -m flexh2o.serve --gpu-batch-size B --max-model-len L` (float32), and in
  the same cgroup the clients: C concurrent `openai.AsyncOpenAI` clients, each sending the next
  record as soon as its last answer ended (its chat template applied here, sent as token ids to
  /v1/completions, streamed with usage), the records in the order the job takes them (largest
  max_tokens first: sent in file order, a long record coming last runs alone at the end, in any
  engine);
- llama-server: llama.cpp's server (bench_vs_llamacpp.py builds it) with -np B slots of L tokens,
  the same threads, sent the same requests by the same clients (its /v1/completions).

L is the longest prompt plus --max-tokens (llama-server's context per slot, flexh2o's tokens per
row). Per contender: generated tokens over the wall time from the first request to the last
answer; time to first token and the time between tokens (streamed chunks), p50 and p99 over all
requests. The contenders run in turn, the first rotating from round to round; tables give each
one's best round and the JSON every round. The server's texts are compared with the job's.

--bigger-than-memory adds bench_bigger_than_memory.py's synthetic 1.26B Llama (F16 GGUF, 2.35
GiB, its tokenizer SmolLM2's) in a 1.5 GB cgroup: flexh2o's server planned by its cost model
inside the cgroup (weights streamed from disk) against llama-server mapping the file, --big-prompts
prompts of --big-max-tokens tokens each from 8 clients, 8 slots.

Writes results/serve.{json,md}.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_quality import MODEL  # noqa: E402
from memory_budget import exit_on_sigterm, report_result, run_in_budget  # noqa: E402

GB = 1 << 30


def prompts_file(args, work: str) -> tuple[str, list]:
    """The job's records (bench_refill.py's prompts) and, for the servers, each one's token ids and max_tokens."""
    from bench_refill import make_chunks
    from flexh2o.jobs.input import JobInput
    from flexh2o.runs.prompts import load_tokenizer
    chunk = argparse.Namespace(prompts=args.prompts, total_chunks=1, min_tokens=args.min_tokens,
                               max_tokens=args.max_tokens, seed=args.seed, data_dir=args.data_dir)
    (path,) = make_chunks(chunk, work)
    tokenizer = load_tokenizer(MODEL)
    job_input = JobInput(path, tokenizer, {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                           "seed": None}, 1 << 20)
    requests = []
    for entry in job_input.entries:
        request, ids = job_input.tokens(entry)
        requests.append({"id": request.id, "ids": ids, "max_tokens": request.max_tokens})
    return path, requests


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def load(url: str, model: str, requests: list, clients: int) -> dict:
    """Every request, from `clients` concurrent clients; wall time, tokens, latencies and texts."""
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=24 * 3600)
    # In the order the offline job takes them (largest max_tokens first), so that the servers and the
    # job face the same schedule: a long record sent last would run alone at the end.
    todo = sorted(range(len(requests)), key=lambda n: (-requests[n]["max_tokens"], n))[::-1]
    first, gaps, texts, tokens, errors = [], [], {}, 0, []

    async def one(n: int):
        nonlocal tokens
        r = requests[n]
        sent = last = time.perf_counter()
        parts, seen, usage = [], False, None
        stream = await client.completions.create(model=model, prompt=r["ids"], max_tokens=r["max_tokens"],
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                (gaps if seen else first).append(now - (last if seen else sent))
                seen, last = True, now
                parts.append(chunk.choices[0].text)
        texts[r["id"]] = "".join(parts)
        tokens += usage if usage is not None else len(parts)

    async def worker():
        while todo:
            n = todo.pop()
            try:
                await one(n)
            except Exception as e:  # noqa: BLE001 - counted and reported, the load goes on
                errors.append(f"{requests[n]['id']}: {type(e).__name__}: {e}")
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - start
    await client.close()
    return {"wall_seconds": seconds, "generated_tokens": tokens, "errors": errors, "texts": texts,
            "ttft_p50": percentile(first, 0.5), "ttft_p99": percentile(first, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def child(args):
    """In the cgroup: start the server, wait until it serves, send the load, report."""
    requests = json.load(open(args.requests_file))
    threads = str(os.cpu_count() or 2)
    if args.child == "flexh2o-serve":
        argv = [sys.executable, "-m", "flexh2o.serve", "--model", args.model, "--port", "0", "--quiet",
                "--max-model-len", str(args.context), "--max-queued", str(max(256, args.clients)),
                "--offload-dir", args.offload_dir] + (["--gpu-batch-size", str(args.batch)] if args.batch else
                                                       ["--max-batch", "8"]) + args.engine_flags
        server = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = server.stdout.readline()
        if " serving " not in line:
            raise RuntimeError(f"flexh2o.serve did not start: {line!r}")
        url, model = line.split(" at ")[1].split()[0].removesuffix("/v1"), line.split(" serving ")[1].split(" at ")[0]
    else:
        port = 18500 + os.getpid() % 1000
        server = subprocess.Popen([args.server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                                   "-np", str(args.batch), "-c", str(args.batch * args.context), "-t", threads,
                                   "-tb", threads, "-b", "2048", "-ub", "512", "--no-webui"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, model = f"http://127.0.0.1:{port}", "llama"
        import urllib.request
        for _ in range(1200):
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not come up")
    try:
        result = asyncio.run(load(url, model, requests, args.clients))
    finally:
        server.terminate()
        server.wait()
    report_result(result)


def run_job(args, records: str, work: str) -> dict:
    out, summary = os.path.join(work, "job.out.jsonl"), os.path.join(work, "job.summary.json")
    argv = [sys.executable, "-m", "flexh2o.run", "--model", MODEL, "--input", records, "--output", out, "--overwrite",
            "--quiet", "--dtype", "float32", "--gpu-batch-size", str(args.batch), "--gen-len", str(args.max_tokens),
            "--json-out", summary]
    run = run_in_budget(argv, int(args.memory * GB), "flexh2o-serve-bench-job", timeout=6 * 3600)
    if run.returncode != 0:
        return {"failed": True, "returncode": run.returncode, "oom_killed": run.oom_killed}
    job = json.load(open(summary))["job"]
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in open(out, encoding="utf-8")}
    return {"wall_seconds": job["wall_seconds"], "generated_tokens": job["generated_tokens"], "texts": texts,
            "peak_bytes": run.peak_bytes}


def run_server(name: str, clients: int, args, requests_file: str, model: str, context: int, batch: int | None,
               memory: float, engine_flags: list) -> dict:
    if name == "llama-server" and args.server is None:
        return {"skipped": args.server_missing}
    argv = [sys.executable, __file__, "--child", name, "--requests-file", requests_file, "--model", model,
            "--context", str(context), "--clients", str(clients), "--offload-dir",
            os.path.join(args.data_dir, "bench_serve_offload"), "--server", args.server or "",
            "--engine-flags", json.dumps(engine_flags)] + (["--batch", str(batch)] if batch else [])
    run = run_in_budget(argv, int(memory * GB), f"flexh2o-serve-bench-{name}", timeout=6 * 3600)
    if run.result is None:
        return {"failed": True, "returncode": run.returncode, "oom_killed": run.oom_killed,
                "timed_out": run.timed_out}
    return {**run.result, "peak_bytes": run.peak_bytes}


def rate(r: dict) -> float:
    return r["generated_tokens"] / r["wall_seconds"] if r.get("wall_seconds") else 0.0


def best(rounds: list, key: str) -> dict | None:
    found = [r[key] for r in rounds if "wall_seconds" in r.get(key, {})]
    return max(found, key=rate) if found else None


def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(result: dict) -> str:
    a, m = result["settings"], result["machine"]
    lines = [f"# The server under client load: SmolLM2, {a['prompts']} chat prompts, {a['batch']} rows", "",
             f"Machine: {m['cpu']}, {m['physical_cores']} cores, torch {m['torch']}. Command: `{result['command']}`. "
             f"SmolLM2-135M-Instruct (Q4_1 GGUF; flexh2o in float32 keeping the file's blocks, llama.cpp with 8-bit "
             f"activations), bench_refill.py's prompts, max_tokens {a['min_tokens']}-{a['max_tokens']}, greedy, EOS "
             f"respected; {a['batch']} rows or slots of {result['context']} tokens; each contender in its own "
             f"{a['memory']:.1f} GiB cgroup, the clients in the server's; best of {len(result['rounds'])} round(s), "
             "contenders interleaved. Latencies from the clients' streams.", "",
             "| contender | clients | generated tokens | wall s | generated tok/s | vs the offline job | vs llama-server "
             "| TTFT p50 / p99 ms | between tokens p50 / p99 ms | errors | peak memory |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    job = best(result["rounds"], "job")
    for clients in a["clients"]:
        server = best(result["rounds"], f"llama-server-{clients}")
        for name in ("job", f"flexh2o-serve-{clients}", f"llama-server-{clients}"):
            r = best(result["rounds"], name)
            if r is None or (name == "job" and clients != a["clients"][0]):
                continue
            lines.append(f"| {name.rsplit('-', 1)[0] if name != 'job' else 'flexh2o job (refilled slots)'} | "
                         f"{clients if name != 'job' else '-'} | {r['generated_tokens']} | {r['wall_seconds']:.0f} | "
                         f"{rate(r):.2f} | {rate(r) / rate(job):.2f}x | "
                         f"{f'{rate(r) / rate(server):.2f}x' if server else '-'} | "
                         f"{ms(r.get('ttft_p50'))} / {ms(r.get('ttft_p99'))} | "
                         f"{ms(r.get('itl_p50'))} / {ms(r.get('itl_p99'))} | {len(r.get('errors', []))} | "
                         f"{r['peak_bytes'] / GB:.2f} GiB |")
    for clients in a["clients"]:
        r = best(result["rounds"], f"flexh2o-serve-{clients}")
        if r and job:
            same = sum(r["texts"].get(k) == t for k, t in job["texts"].items())
            lines.append("")
            lines.append(f"Texts the server ({clients} clients) and the offline job agree on: {same} of "
                         f"{len(job['texts'])}.")
    big = result.get("bigger_than_memory")
    if big:
        lines += ["", f"## A model bigger than memory: the 1.26B Llama (2.35 GiB F16 GGUF) in a {big['memory']:.1f} GB "
                  f"cgroup", "", f"{big['prompts']} prompts of {big['max_tokens']} tokens each from 8 clients, 8 rows or "
                  "slots; flexh2o's server planned by its cost model inside the cgroup.", "",
                  "| contender | answered | generated tokens | wall s | generated tok/s | TTFT p50 / p99 s | "
                  "between tokens p50 / p99 s | errors | peak memory |", "|---|---|---|---|---|---|---|---|---|"]
        for name in ("flexh2o-serve", "llama-server"):
            r = big.get(name, {})
            if "wall_seconds" not in r:
                lines.append(f"| {name} | {r.get('skipped') or 'failed: ' + json.dumps(r)} | | | | | | | |")
                continue
            seconds = (f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} | {r['itl_p50']:.2f} / {r['itl_p99']:.2f}"
                       if r.get("itl_p50") is not None else "- | -")
            lines.append(f"| {name} | {len(r['texts'])} of {big['prompts']} | {r['generated_tokens']} | "
                         f"{r['wall_seconds']:.0f} | {rate(r):.2f} | {seconds} | {len(r['errors'])} | "
                         f"{r['peak_bytes'] / GB:.2f} GiB |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16, help="rows of flexh2o, slots of llama-server")
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--memory", type=float, default=3.0, help="GiB, every contender's cgroup")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--bigger-than-memory", action="store_true")
    p.add_argument("--big-prompts", type=int, default=16)
    p.add_argument("--big-max-tokens", type=int, default=16)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "flexh2o_data"))
    p.add_argument("--llama-workdir", default=os.path.join(tempfile.gettempdir(), "flexh2o_bench_llamacpp"))
    p.add_argument("--out", default="results/serve")
    p.add_argument("--child", choices=["flexh2o-serve", "llama-server"], help=argparse.SUPPRESS)
    for hidden in ("--requests-file", "--model", "--server", "--offload-dir", "--engine-flags"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.clients = args.clients[0]
        args.engine_flags = json.loads(args.engine_flags or "[]")
        return child(args)
    exit_on_sigterm()
    from bench_vs_llamacpp import build_llama_cpp
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    from flexh2o.host.machine import describe_machine
    args.server = args.server_missing = None
    try:
        args.server = build_llama_cpp(os.path.join(args.llama_workdir, "llama.cpp"), lambda line: print(line),
                                      "llama-server")
    except (RuntimeError, OSError, subprocess.TimeoutExpired, IndexError) as e:
        args.server_missing = f"llama.cpp's server could not be built here ({e})"
        print(f"note: {args.server_missing}", flush=True)
    work = os.path.join(args.data_dir, "bench_serve")
    os.makedirs(work, exist_ok=True)
    records, requests = prompts_file(args, work)
    requests_file = os.path.join(work, "requests.json")
    with open(requests_file, "w") as f:
        json.dump(requests, f)
    context = max(len(r["ids"]) for r in requests) + args.max_tokens
    names = ["job"] + [f"{kind}-{c}" for c in args.clients for kind in ("flexh2o-serve", "llama-server")]
    result = {"settings": {k: getattr(args, k) for k in ("prompts", "batch", "clients", "min_tokens", "max_tokens",
                                                          "memory", "seed")},
              "command": "python scripts/bench_serve.py " + " ".join(sys.argv[1:]), "machine": describe_machine(),
              "context": context, "rounds": []}
    flexh2o_flags = ["--dtype", "float32"]
    for r in range(args.rounds):
        turn, out = names[r % len(names):] + names[: r % len(names)], {}
        for name in turn:
            print(f"round {r}: {name}", flush=True)
            if name == "job":
                out[name] = run_job(args, records, work)
            else:
                kind, clients = name.rsplit("-", 1)
                out[name] = run_server(kind, int(clients), args, requests_file, MODEL, context, args.batch,
                                       args.memory, flexh2o_flags)
            print(f"  {name}: {rate(out[name]):.2f} tok/s" if "wall_seconds" in out[name] else f"  {out[name]}",
                  flush=True)
        result["rounds"].append(out)
        write_json_atomic(args.out + ".json", result)
    if args.bigger_than_memory:
        result["bigger_than_memory"] = bigger_than_memory(args, work)
    write_json_atomic(args.out + ".json", result)
    write_text_atomic(args.out + ".md", markdown(result))
    print(markdown(result))


def bigger_than_memory(args, work: str) -> dict:
    """bench_bigger_than_memory.py's model, 1.5 GB: both servers, 8 slots, 8 clients."""
    from bench_bigger_than_memory import drop_page_cache
    from synthetic_gguf import write_model
    model = os.path.join(tempfile.gettempdir(), "flexh2o_bench_bigger", "llama-1.26b-f16.gguf")
    os.makedirs(os.path.dirname(model), exist_ok=True)
    write_model(model)
    requests = json.load(open(os.path.join(work, "requests.json")))[: args.big_prompts]
    for r in requests:
        r["ids"], r["max_tokens"] = r["ids"][:128], args.big_max_tokens
    path = os.path.join(work, "requests_big.json")
    with open(path, "w") as f:
        json.dump(requests, f)
    out = {"memory": 1.5, "prompts": len(requests), "max_tokens": args.big_max_tokens}
    for name in ("flexh2o-serve", "llama-server"):
        drop_page_cache(model)
        print(f"bigger than memory: {name}", flush=True)
        out[name] = run_server(name, 8, args, path, model, 128 + args.big_max_tokens,
                               None if name == "flexh2o-serve" else 8, 1.5, ["--max-memory", "1.5GB"])
    return out


if __name__ == "__main__":
    main()
