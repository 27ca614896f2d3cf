"""How a job's records are cut into blocks, the unit the engine generates at once.

The records are grouped by how their tokens are chosen (temperature, top-p, top-k: one sampler
per block), sorted by prompt length within a group and cut into blocks. A block is padded only to
its own longest prompt, rounded up to a multiple of ROUND_TO so that block shapes repeat, and
generates as many tokens as its largest max_tokens asks. How many records a block takes depends
on its shape (plans.py: short prompts leave room for larger batches).
"""

from flexh2o.jobs.input import Entry

ROUND_TO = 8


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_shape(entries: list[Entry], max_positions: int) -> tuple[int, int]:
    """(prompt_len, gen_len) a block of these records runs at: its longest prompt rounded up (within
    the positions left by its largest max_tokens, for a record that alone needs nearly all of them)."""
    gen_len = max(e.max_tokens for e in entries)
    return min(round_up(max(e.prompt_tokens for e in entries), ROUND_TO), max_positions - gen_len), gen_len


def plan_blocks(entries: list[Entry], batch_for, max_positions: int) -> list[list[Entry]]:
    """Blocks of one sampling setting each, by prompt length; a block takes a record while the batch
    of the shape it would then have, batch_for(prompt_len, gen_len) (or an int: any shape), holds
    one more, and while its longest prompt (rounded up) and largest max_tokens fit the positions."""
    if isinstance(batch_for, int):
        fixed = batch_for
        batch_for = lambda prompt_len, gen_len: fixed  # noqa: E731
    groups: dict = {}
    for e in entries:
        groups.setdefault(e.sampling, []).append(e)
    blocks = []
    for group in groups.values():
        group.sort(key=lambda e: (e.prompt_tokens, e.number))
        block, most_tokens = [], 0
        for e in group:
            longest = round_up(e.prompt_tokens, ROUND_TO)  # the group is sorted: e is the longest
            gen_len = max(most_tokens, e.max_tokens)
            if block and (longest + gen_len > max_positions or len(block) >= batch_for(longest, gen_len)):
                blocks.append(block)
                block, most_tokens = [], 0
            block.append(e)
            most_tokens = max(most_tokens, e.max_tokens)
        if block:
            blocks.append(block)
    return blocks
