"""Validates a CUDA machine: `make gpu-check`. Results in results/gpu.{json,md} (and in
$GPU_CHECK_OUT/gpu.{json,md} when set), written after every section and row; exit status 1 if a
test, a section or a target failed. Sections, with their budgets on one H100 (7 minutes in all;
check_sections.py says what happens past one):

1. tests: tests/offload/test_cuda.py under pytest, 120 s a test. Its failures do not stop the rest.
2. allocator: a matrix of placements (weights and cache on gpu / cpu / disk / mixed, activations
   on gpu and cpu, 1 and 3 gpu-batches, full and H2O, --cpu-cache-compute, compressed) of OPT-1.3B
   dummy float16, 512+4, each at the largest batch whose projection fits a T4's 16 GB, and each run
   with torch's allocator capped (set_per_process_memory_fraction) at its own projection plus 10%:
   an undercount of more than that ends the row out of memory. Target per row: the allocator's
   reserved peak within 10% of the projection.
3. bandwidth: decode with the cache in CPU memory, and with the weights streamed from CPU memory,
   against the bound = the bytes the run actually copied to the GPU per decode step / the pinned
   host-to-device bandwidth measured here (target >= 0.7 of the bound); and the bytes the weights
   run moves per step against the weights' own size (target: each weight at most once per token;
   an input embedding moves only the rows it looks up).
4. prefill: with the cache in CPU memory (and with --cpu-cache-compute) against the all-on-GPU
   prefill of the same batch, the prompt's cache stores included (target <= 1.3x).
5. cpu-attention: the CPU's decode attention under --cpu-cache-compute reads the cache at >= 0.5 of
   a CPU memcpy (scripts/bench_cpu_attention.py's measurement).

The first line checks what the check needs (CUDA, the GPU's free memory, pytest and
pytest-timeout) and says what is missing; without a CUDA device it is the only line, and the exit
status is 1.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GB = 1 << 30
MODEL = "opt-1.3b"
T4_BYTES = 16 * GB
CUDA_TESTS = "tests/offload/test_cuda.py"  # the tests section runs these, from the checkout
BUDGETS = {"tests": 150, "allocator": 150, "bandwidth": 60, "prefill": 45, "cpu-attention": 30}
TOTAL_BUDGET_S = 8 * 60
DISK_LIMIT, CPU_LIMIT, MAX_BATCH = 8 * GB, 24 * GB, 256  # what one allocator row may use off the GPU

# (name, weights gpu/cpu, cache gpu/cpu, act, gpu-batches, hh_ratio, cpu_cache_compute, compress)
MATRIX = [
    ("all on gpu", (100, 0), (100, 0), "gpu", 1, None, False, False),
    ("all on gpu, h2o", (100, 0), (100, 0), "gpu", 1, 0.1, False, False),
    ("cache cpu, act cpu, 3 batches", (100, 0), (0, 100), "cpu", 3, None, False, False),
    ("weights cpu, h2o", (0, 100), (100, 0), "gpu", 1, 0.1, False, False),
    ("weights disk, cache disk, 3 batches", (0, 0), (0, 0), "cpu", 3, 0.1, False, False),
    ("mixed weights, mixed cache, 3 batches", (50, 30), (34, 33), "cpu", 3, None, False, False),
    ("cache cpu, cpu_cache_compute", (100, 0), (0, 100), "gpu", 1, None, True, False),
    ("weights cpu+disk, cache cpu+gpu, h2o, 3 batches", (20, 60), (50, 50), "cpu", 3, 0.2, False, False),
    ("compressed: weights cpu, cache cpu, h2o, 3 batches", (0, 100), (0, 100), "cpu", 3, 0.1, False, True),
    ("compressed: weights disk, cache gpu", (0, 0), (100, 0), "gpu", 1, None, False, True),
]


def needs() -> list[str]:
    """One line on what this machine has for the check; exits if it cannot run at all."""
    missing = [m for m in ("torch", "psutil", "numpy", "transformers", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"gpu-check: cannot run: missing {', '.join(missing)} (pip install -e . on this machine)")
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"gpu-check: no CUDA device (torch {torch.__version__}): nothing checked")
    free, total = torch.cuda.mem_get_info()
    notes = [f"missing {m}: {what}" for m, what in (("pytest", "the CUDA tests are skipped"),
                                                    ("pytest_timeout", "the CUDA tests run without a per-test timeout"))
             if importlib.util.find_spec(m) is None]
    if free < T4_BYTES * 1.1:
        notes.append(f"only {free / GB:.1f} GiB free: rows near the 16 GB budget may run out of memory")
    print(f"gpu-check: {torch.cuda.get_device_name()}, {free / GB:.1f} of {total / GB:.1f} GiB free, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"{'; '.join(notes) if notes else 'everything it needs is here'}", flush=True)
    return notes


# -- 1. the CUDA tests ---------------------------------------------------------------------------
def tests_section(section):
    if importlib.util.find_spec("pytest") is None:
        section.target("CUDA tests", "not run: pytest is missing", "all pass", False)
        return
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CUDA_TESTS]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv += ["--timeout", "120"]
    try:
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=BUDGETS["tests"])
        out, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in (e.stdout, e.stderr)]
        out, code = "".join(parts) + f"\n(killed after {BUDGETS['tests']} s)", None
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    section.add({"command": " ".join(argv[1:]), "returncode": code, "last_line": tail, "output": out[-4000:]})
    section.target("CUDA tests", tail or f"exit {code}", "all pass", code == 0)


# -- 2. the allocator against the pre-flight ------------------------------------------------------
def policy_of(w, c, act, nb, hh, ccc, compress, batch=1):
    from flexh2o import Policy
    return Policy(gpu_batch_size=batch, num_gpu_batches=nb, w_gpu_percent=w[0], w_cpu_percent=w[1],
                  cache_gpu_percent=c[0], cache_cpu_percent=c[1], act_gpu_percent=100 if act == "gpu" else 0,
                  act_cpu_percent=100 if act == "cpu" else 0, hh_ratio=hh, cpu_cache_compute=ccc,
                  compress_weight=compress, compress_cache=compress)


def projection(engine, batch: int, prompt_len: int, gen_len: int) -> dict:
    """The pre-flight's bytes per tier for the engine's weights and a run at this gpu-batch size."""
    import dataclasses
    from flexh2o.engine.preflight import add, run_need
    policy = dataclasses.replace(engine.policy, gpu_batch_size=batch)
    return add(engine.weight_need, run_need(engine.spec, policy, 2, prompt_len, gen_len, engine.tiers.compute,
                                            False, engine.tiers.io_threads))


def largest_batch(engine, prompt_len: int, gen_len: int) -> tuple[int, str]:
    """The largest gpu-batch size whose projection fits a T4's memory (less what CUDA takes
    outside torch's allocator; and this check's limits on CPU memory and disk), and which limit
    stopped it."""
    from flexh2o.engine.preflight import outside_allocator
    def limit(b):
        p = projection(engine, b, prompt_len, gen_len)
        for tier, cap in (("gpu", T4_BYTES - outside_allocator(False)), ("cpu", CPU_LIMIT), ("disk", DISK_LIMIT)):
            if p[tier] > cap:
                return tier
        return None
    if limit(1):
        return 0, limit(1)
    lo, hi = 1, MAX_BATCH
    if not limit(hi):
        return hi, "max batch"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not limit(mid) else (lo, mid)
    return lo, limit(hi)


def allocator_section(section, offload_dir):
    import torch
    from flexh2o import Engine
    from flexh2o.runs.prompts import synthetic_prompts
    prompt_len, gen_len = 512, 4
    total = torch.cuda.get_device_properties(0).total_memory
    for name, *config in MATRIX:
        if section.over():
            section.skipped.append(name)
            continue
        row = {"name": name}
        try:
            with Engine.from_pretrained(MODEL, policy=policy_of(*config), device="cuda", dtype=torch.float16,
                                        dummy=True, offload_dir=offload_dir, prompt_len=prompt_len,
                                        gen_len=gen_len) as engine:
                batch, limited_by = largest_batch(engine, prompt_len, gen_len)
                row.update(gpu_batch_size=batch, limited_by=limited_by)
                if batch == 0:
                    raise RuntimeError(f"batch 1 does not fit: {limited_by}")
                engine.use_policy(gpu_batch_size=batch)
                projected = projection(engine, batch, prompt_len, gen_len)["gpu"]  # what the allocator holds
                cap = min(T4_BYTES, int(projected * 1.10))
                row.update(projected=projected, enforced_cap=cap)
                ids, _ = synthetic_prompts(engine.policy.batch_size, prompt_len, engine.spec.vocab_size, seed=0)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.set_per_process_memory_fraction(cap / total)
                try:
                    engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
                finally:
                    torch.cuda.set_per_process_memory_fraction(1.0)
                row.update(reserved_peak=torch.cuda.max_memory_reserved(),
                           allocated_peak=torch.cuda.max_memory_allocated(), tracked_gpu=engine.tiers.peak["gpu"],
                           pinned=engine.tiers.pinned_bytes())
                row["ratio"] = row["reserved_peak"] / projected
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory under the cap: {str(e).splitlines()[0]}"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache()
        section.add(row)
        value = (f"{row['reserved_peak'] / GB:.2f} GB reserved / {row['projected'] / GB:.2f} projected "
                 f"(batch {row['gpu_batch_size']})" if "ratio" in row else row.get("error", "?"))
        section.target(f"allocator: {name}", value, "reserved within 10% of the projection",
                       "ratio" in row and abs(row["ratio"] - 1) <= 0.10)


# -- 3. decode against the bytes it moves -----------------------------------------------------------
def pinned_bandwidth(nbytes=1 << 30) -> float:
    """Host-to-device bytes/s from pinned memory, as the engine copies (one stream, non-blocking)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        best = max(best, nbytes / (time.perf_counter() - start))
    return best


def timed_run(policy, prompt_len, gen_len, offload_dir):
    """GenerationStats of one run of OPT-1.3B dummy float16 (after a first, untimed one)."""
    import torch
    from flexh2o import Engine
    from flexh2o.runs.prompts import synthetic_prompts
    with Engine.from_pretrained(MODEL, policy=policy, device="cuda", dtype=torch.float16, dummy=True,
                                offload_dir=offload_dir, prompt_len=prompt_len, gen_len=gen_len) as engine:
        ids, _ = synthetic_prompts(policy.batch_size, prompt_len, engine.spec.vocab_size, seed=0)
        engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
        return engine.last_stats, engine.spec


def bandwidth_section(section, offload_dir, result):
    bandwidth = result["pinned_h2d_Bps"] = pinned_bandwidth()
    prompt_len, gen_len = 512, 8
    runs = [("decode, cache in CPU memory (32 x 2 gpu-batches, 512+8)", policy_of((100, 0), (0, 100), "gpu", 2, None,
                                                                                   False, False, batch=32)),
            ("decode, weights streamed from CPU memory (32 x 2 gpu-batches, 512+8)",
             policy_of((0, 100), (100, 0), "gpu", 2, None, False, False, batch=32))]
    for name, policy in runs:
        if section.over():
            section.skipped.append(name)
            continue
        stats, spec = timed_run(policy, prompt_len, gen_len, offload_dir)
        steps = stats.steps_done - 1
        # The median decode step: a step's copies run on I/O threads, and one may land on either side
        # of a step's end; the last step prefetches nothing for a next token.
        middle = sorted(stats.step_h2d_bytes[1:-1])
        moved = middle[len(middle) // 2]
        bound = policy.batch_size * bandwidth / moved
        measured = policy.batch_size * steps / stats.decode_seconds
        row = {"name": name, "bytes_per_step": moved, "bound_tok_s": bound, "measured_tok_s": measured,
               "ratio": measured / bound}
        section.add(row)
        section.target(name, f"{measured:.1f} tok/s of {bound:.1f} ({row['ratio']:.2f})", ">= 0.7 of the bound",
                       row["ratio"] >= 0.7)
        if policy.w_gpu_percent == 0:
            weights = spec.param_count() * 2
            section.target("weights moved per decode step", f"{moved / 1e9:.2f} GB for {weights / 1e9:.2f} GB "
                           "of weights", "each weight at most once per token (within 1%)", moved <= weights * 1.01)


# -- 4. prefill with the cache's stores ------------------------------------------------------------
def prefill_section(section, offload_dir):
    def seconds(cache, ccc):
        stats, _ = timed_run(policy_of((100, 0), cache, "gpu", 1, None, ccc, False, batch=64), 512, 1, offload_dir)
        return stats.prefill_seconds + stats.finish_seconds  # the prompt step, then its last stores
    base = seconds((100, 0), False)
    for name, ccc in (("cache in CPU memory", False), ("cache in CPU memory, cpu_cache_compute", True)):
        if section.over():
            section.skipped.append(name)
            continue
        s = seconds((0, 100), ccc)
        section.add({"name": name, "prefill_s": s, "all_on_gpu_s": base, "ratio": s / base})
        section.target(f"prefill, {name}", f"{s:.2f} s vs {base:.2f} s ({s / base:.2f}x)", "<= 1.3x the all-on-GPU",
                       s / base <= 1.3)


def cpu_attention_section(section):
    import torch
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_cpu_attention import measure
    from flexh2o.kv.home import cpu_attention_dtype
    a = measure(32, 32, 128, 544, cpu_attention_dtype(torch.float16), 5)
    section.add(a)
    section.target("CPU decode attention's read of the cache", f"{a['ratio']:.2f} of a memcpy", ">= 0.5",
                   a["ratio"] >= 0.5)


def describe(r, header: bool) -> str:
    if header:
        from check_sections import machine_line
        notes = " Notes: " + "; ".join(r["notes"]) if r["notes"] else ""
        return "\n".join([f"# GPU check on {r['device']}", "",
                          f"{machine_line(r)} Model: {MODEL} dummy weights, float16. Pinned host-to-device "
                          f"bandwidth measured here: {r.get('pinned_h2d_Bps', 0) / 1e9:.1f} GB/s.{notes}"])
    s = r["sections"]
    lines = []
    rows = s.get("allocator", {}).get("rows", [])
    if rows:
        lines += ["## Allocator peaks against the pre-flight (512+4, the largest batch that fits 16 GB, capped at "
                  "the projection + 10%)", "",
                  "| placement | gpu-batch (limited by) | projected GB | reserved peak GB | allocated peak GB | "
                  "reserved / projected | pinned host GB |", "|---|---|---|---|---|---|---|"]
        for x in rows:
            if "ratio" not in x:
                lines.append(f"| {x['name']} | {x.get('gpu_batch_size', '')} | | | | **{x.get('error')}** | |")
                continue
            lines.append(f"| {x['name']} | {x['gpu_batch_size']} ({x['limited_by']}) | {x['projected'] / GB:.2f} | "
                         f"{x['reserved_peak'] / GB:.2f} | {x['allocated_peak'] / GB:.2f} | {x['ratio']:.2f} | "
                         f"{x['pinned'] / GB:.2f} |")
        lines.append("")
    rows = s.get("bandwidth", {}).get("rows", [])
    if rows:
        lines += ["## Decode against the bytes it copied (target >= 0.7 of the bound)", "",
                  "| run | GB copied per step | bound tok/s | measured tok/s | measured / bound |", "|---|---|---|---|---|"]
        lines += [f"| {x['name']} | {x['bytes_per_step'] / 1e9:.2f} | {x['bound_tok_s']:.1f} | "
                  f"{x['measured_tok_s']:.1f} | **{x['ratio']:.2f}** |" for x in rows]
        lines.append("")
    rows = s.get("prefill", {}).get("rows", [])
    if rows:
        lines += ["## Prefill, its cache stores included (batch 64, 512 tokens; target <= 1.3x)", "",
                  "| run | prefill s | all-on-GPU prefill s | ratio |", "|---|---|---|---|"]
        lines += [f"| {x['name']} | {x['prefill_s']:.2f} | {x['all_on_gpu_s']:.2f} | **{x['ratio']:.2f}** |"
                  for x in rows]
        lines.append("")
    rows = s.get("tests", {}).get("rows", [])
    if rows:
        lines += ["## CUDA tests", "", f"`{rows[0]['command']}`: exit {rows[0]['returncode']}, "
                  f"`{rows[0]['last_line']}`", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="Validates a CUDA machine (make gpu-check).")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "gpu"))
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for the whole check")
    args = ap.parse_args()
    notes = needs()
    import torch
    sys.path.insert(0, REPO)
    from check_sections import Check
    from flexh2o.host.machine import describe_machine
    torch.set_grad_enabled(False)
    outs = [args.out] + ([os.path.join(os.environ["GPU_CHECK_OUT"], "gpu")] if os.environ.get("GPU_CHECK_OUT") else [])
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "command": "make gpu-check", "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "notes": notes, "machine": describe_machine()}
    check = Check(outs, args.budget, header, describe)
    with tempfile.TemporaryDirectory(prefix="flexh2o-gpu-check-") as offload_dir:
        check.run("tests", BUDGETS["tests"], tests_section)
        check.run("allocator", BUDGETS["allocator"], lambda s: allocator_section(s, offload_dir))
        check.run("bandwidth", BUDGETS["bandwidth"], lambda s: bandwidth_section(s, offload_dir, check.result))
        check.run("prefill", BUDGETS["prefill"], lambda s: prefill_section(s, offload_dir))
        check.run("cpu-attention", BUDGETS["cpu-attention"], cpu_attention_section)
    print(check.markdown())
    return 0 if check.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
