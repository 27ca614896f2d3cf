"""Refilled slots against fixed blocks where weights stream: OPT-6.7B dummy weights, offloaded (a GPU).

    python scripts/bench_refill_gpu.py                          # OPT-6.7B, half the weights in CPU memory
    python scripts/bench_refill_gpu.py --model opt-13b --w-gpu 30
    python scripts/bench_refill_gpu.py --model opt-125m --device cpu --records 24 --max-tokens 48   # a check

Every record is a random prompt of --min-prompt..--max-prompt tokens asking for max_tokens drawn
uniformly from --min-tokens..--max-tokens (dummy weights never say EOS, so each runs to its own
max_tokens, as a job's records stop anywhere). One engine, loaded once, runs the records twice,
in turn: as fixed blocks (sorted by prompt length, --batch each, each block until its largest
max_tokens, Engine.generate) and through refilled slots (Engine.generate_refilled, --batch slots).
Each gets the same placement and batch; generated tokens per second of its wall time, the
model's loading excluded. Writes results/refill_gpu.{json,md}.
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def records(a) -> list:
    rng = random.Random(a.seed)
    return [([rng.randrange(4, 50000) for _ in range(rng.randint(a.min_prompt, a.max_prompt))],
             rng.randint(a.min_tokens, a.max_tokens)) for _ in range(a.records)]


def fixed_blocks(engine, recs, batch: int) -> int:
    """Sorted by prompt length, cut into blocks of `batch`; returns the tokens generated."""
    from flexh2o.runs.prompts import pad_prompts
    order = sorted(recs, key=lambda r: len(r[0]))
    generated = 0
    for start in range(0, len(order), batch):
        block = order[start: start + batch]
        engine.use_policy(gpu_batch_size=len(block))
        ids, mask = pad_prompts([prompt for prompt, _ in block], max(len(p) for p, _ in block), 1)
        engine.generate(ids, mask, max_new_tokens=max(m for _, m in block), eos_token_id=None,
                        row_max_new_tokens=[m for _, m in block])
        generated += sum(m for _, m in block)
    engine.use_policy(gpu_batch_size=batch)
    return generated


def refilled(engine, recs) -> int:
    from flexh2o.engine.slot_request import Request
    done = []
    engine.generate_refilled(iter([Request(ids, m) for ids, m in recs]), lambda r, t, why: done.append(len(t)),
                             max(len(ids) for ids, _ in recs), max(m for _, m in recs), eos_token_id=None)
    return sum(done)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="opt-6.7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--w-gpu", type=float, default=50, help="percent of the weights on the GPU, the rest in CPU memory")
    p.add_argument("--records", type=int, default=96)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "refill_gpu"))
    a = p.parse_args()
    import torch
    from flexh2o import Engine, Policy
    from flexh2o.common.output_files import write_json_atomic, write_text_atomic
    from flexh2o.host.machine import describe_machine
    torch.set_grad_enabled(False)
    policy = Policy(gpu_batch_size=a.batch, w_gpu_percent=a.w_gpu, w_cpu_percent=100 - a.w_gpu)
    recs = records(a)
    runs = {"fixed": [], "refilled": []}
    with Engine.from_pretrained(a.model, policy=policy, dummy=True, device=a.device, dtype=a.dtype) as engine:
        for name in ("fixed", "refilled", "refilled", "fixed"):  # in turn, each twice, the order mirrored
            start = time.perf_counter()
            tokens = fixed_blocks(engine, recs, a.batch) if name == "fixed" else refilled(engine, recs)
            seconds = time.perf_counter() - start
            runs[name].append({"tokens": tokens, "seconds": seconds})
            print(f"{name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s", flush=True)
    rate = {n: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for n, rs in runs.items()}
    result = {"settings": vars(a), "machine": describe_machine(), "runs": runs, "tokens_per_second": rate,
              "refilled_vs_fixed": rate["refilled"] / rate["fixed"]}
    write_json_atomic(a.out + ".json", result)
    text = (f"# Refilled slots against fixed blocks: {a.model}, dummy weights, {a.w_gpu:g}% of them on the "
            f"{a.device}\n\n`python scripts/bench_refill_gpu.py {' '.join(sys.argv[1:])}` on "
            f"{result['machine'].get('gpu') or result['machine']['cpu']}: {a.records} records, prompts "
            f"{a.min_prompt}-{a.max_prompt} tokens, max_tokens {a.min_tokens}-{a.max_tokens}, batch {a.batch}; each "
            f"way run twice, in turn.\n\n| way | generated tok/s |\n|---|---|\n"
            f"| fixed blocks | {rate['fixed']:.1f} |\n| refilled slots | {rate['refilled']:.1f} "
            f"({result['refilled_vs_fixed']:.2f}x) |\n")
    write_text_atomic(a.out + ".md", text)
    print(text)


if __name__ == "__main__":
    main()
