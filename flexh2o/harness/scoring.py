"""Scored items (requests.py) run on a loaded engine in length-sorted blocks, as a dataset job's
records are (jobs/blocks.py): each block padded to its own longest prompt, its fed tokens to its
longest item, at the block's plan (jobs/plans.py)."""

import torch

from flexh2o.jobs.blocks import block_shape, plan_blocks
from flexh2o.jobs.input import Entry, sampling
from flexh2o.jobs.plans import use_plan
from flexh2o.runs.prompts import pad_prompts

GREEDY = sampling(0.0, 1.0, 0)


def entries(items: list) -> list[Entry]:
    return [Entry(n, str(n), 0, 0, len(item.prompt), len(item.fed), GREEDY, None) for n, item in enumerate(items)]


def score(engine, items: list, plans, advance=lambda done: None) -> list[tuple[float, bool]]:
    """(sum of the scored tokens' log-probabilities, whether each was the greedy choice) per item."""
    spec, results = engine.spec, [None] * len(items)
    for block in plan_blocks(entries(items), plans.batch_for, spec.max_positions):
        prompt_len, gen_len = block_shape(block, spec.max_positions)
        policy = use_plan(engine, plans, prompt_len, gen_len, len(block))
        rows = [items[e.number] for e in block]
        rows += [rows[-1]] * (policy.batch_size - len(rows))  # filler, as a dataset job's
        ids, mask = pad_prompts([list(r.prompt) for r in rows], prompt_len, spec.pad_token_id)
        forced = torch.full((len(rows), gen_len), spec.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            forced[i, :len(r.fed)] = torch.tensor(r.fed)
        out = engine.generate(ids, mask, max_new_tokens=gen_len, forced_tokens=forced)
        for i, e in enumerate(block):
            first, end = len(rows[i].fed) - rows[i].scored, len(rows[i].fed)
            logprob = out.forced_logprobs[i, first:end].double().sum().item()
            results[e.number] = (logprob, bool((out.greedy[i, first:end] == forced[i, first:end]).all()))
        advance(len(block))
    return results
