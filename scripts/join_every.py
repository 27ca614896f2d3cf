"""What --join-every N costs and saves: a finished refilled job's slot schedule replayed for other N.

    python scripts/join_every.py INPUT.jsonl OUTPUT.jsonl --gpu-batch-size 16 [--measured SUMMARY.json]

A record generates the same tokens whatever its slot and whenever it joins (engine/slot_pool.py),
so the schedule of a job with another --join-every follows from each record's own completion
length alone: this replays SlotPool's rules (records join largest max_tokens first; free slots
join at steps that are multiples of N, or whenever nothing runs; a joining record's prompt step
gives its first token) and counts, per N, the token steps, the decode slots (a running row x
step: a decode step computes no stopped row, plus one per joining record), the slots left idle
(a free row x step while records still waited for a join step), and the steps at which records
joined (each a prompt call per layer). With --measured, the replay of the job's own N is checked
against the counts the job reported.
"""

import argparse
import json


def replay(limits: list[int], lengths: list[int], gpu_batch_size: int, join_every: int,
           num_gpu_batches: int = 1) -> dict:
    """limits[n], lengths[n]: record n's max_tokens and the tokens it generated, in input order."""
    batch = gpu_batch_size * num_gpu_batches
    waiting = sorted(range(len(limits)), key=lambda n: (-limits[n], n))
    left = [0] * batch  # tokens each row's sequence has yet to generate (0: free)
    steps = decode_slots = joins = joined = idle = 0
    i = 0
    while waiting or any(left):
        decoding = [r for r in range(batch) if left[r]]
        joining = []
        if i % join_every == 0 or not decoding:
            joining = [r for r in range(batch) if not left[r]][: len(waiting)]
        decode_slots += len(decoding)
        idle += min(batch - len(decoding) - len(joining), len(waiting) - len(joining))
        for r in decoding:
            left[r] -= 1
        for r in joining:
            left[r] = lengths[waiting.pop(0)] - 1  # the prompt step gives the first token
        joined += len(joining)
        joins += bool(joining)
        steps += 1
        i += 1
    slots = decode_slots + joined
    return {"join_every": join_every, "token_steps": steps, "decode_slots": slots, "join_steps": joins,
            "idle_share": idle / (idle + slots)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--gpu-batch-size", type=int, required=True)
    p.add_argument("--num-gpu-batches", type=int, default=1)
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--measured", help="the job's --json-out, whose join_steps and decode_slots the replay of "
                                      "its own --join-every must give")
    p.add_argument("--measured-every", type=int, default=1)
    a = p.parse_args()
    records = [json.loads(line) for line in open(a.input, encoding="utf-8")]
    done = {}
    for line in open(a.output, encoding="utf-8"):
        r = json.loads(line)
        done[str(r.get("custom_id", r.get("id")))] = r["completion_tokens"]
    limits = [r["max_tokens"] for r in records]
    lengths = [done[str(r["id"])] for r in records]
    if a.measured:
        job = json.load(open(a.measured))["job"]
        mine = replay(limits, lengths, a.gpu_batch_size, a.measured_every, a.num_gpu_batches)
        ok = (mine["decode_slots"], mine["join_steps"]) == (job["decode_slots"], job["join_steps"])
        print(f"replay of --join-every {a.measured_every}: {mine['decode_slots']} decode slots, {mine['join_steps']} "
              f"join steps; the job reported {job['decode_slots']} and {job['join_steps']}: "
              f"{'the same' if ok else 'DIFFERENT'}")
    print("| --join-every | token steps | decode slots | idle slots while records waited | join steps |")
    print("|---|---|---|---|---|")
    for n in a.every:
        r = replay(limits, lengths, a.gpu_batch_size, n, a.num_gpu_batches)
        print(f"| {n} | {r['token_steps']} | {r['decode_slots']} | {r['idle_share']:.1%} | {r['join_steps']} |")


if __name__ == "__main__":
    main()
