"""A dataset job: every record of an input generated in length-sorted blocks on one loaded engine.

The records still to do are grouped by how their tokens are chosen (temperature, top-p, top-k:
one sampler per block), sorted by prompt length within a group and cut into blocks of the
engine's batch. A block is padded only to its own longest prompt, rounded up to a multiple of
ROUND_TO so that block shapes repeat; it generates as many tokens as its largest max_tokens asks,
each sequence stopping at EOS or at its own max_tokens, and the block stops once all have. A last
block short of the batch is filled with copies of its last prompt that stop after one token.
Records go to the output as each block finishes (output.py).
"""

import hashlib
import time
from dataclasses import dataclass, field

from .input import Entry, JobInput
from ..prompts import pad_prompts

ROUND_TO = 8


@dataclass
class JobStats:
    records: int = 0            # in the input
    skipped: int = 0            # already in the output (a resumed job)
    done: int = 0               # written by this run
    bad: int = 0                # written as error records (--skip-bad)
    blocks: int = 0
    prompt_tokens: int = 0      # real prompt tokens of the records generated
    computed_prompt_tokens: int = 0  # prompt positions computed (with the blocks' padding)
    generated_tokens: int = 0
    decode_slots: int = 0       # (sequence, token step) pairs computed
    shapes: set = field(default_factory=set)  # distinct (prompt_len, gen_len) of the blocks
    seconds: float = 0.0

    def summary(self) -> dict:
        padding = 1 - self.prompt_tokens / self.computed_prompt_tokens if self.computed_prompt_tokens else 0.0
        wasted = 1 - self.generated_tokens / self.decode_slots if self.decode_slots else 0.0
        return {"records": self.records, "skipped_already_done": self.skipped, "written": self.done,
                "bad_records": self.bad, "blocks": self.blocks, "block_shapes": len(self.shapes),
                "prompt_tokens": self.prompt_tokens, "computed_prompt_tokens": self.computed_prompt_tokens,
                "padding_share": padding, "generated_tokens": self.generated_tokens,
                "decode_slots": self.decode_slots, "slots_wasted_after_stop": wasted,
                "wall_seconds": self.seconds,
                "generated_tokens_per_second": self.generated_tokens / self.seconds if self.seconds else 0.0}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_blocks(entries: list[Entry], batch: int, max_positions: int) -> list[list[Entry]]:
    """Blocks of at most `batch` records, each of one sampling setting, by prompt length; a block
    also ends where its longest prompt (rounded up) and largest max_tokens would not fit the
    model's positions together."""
    groups: dict = {}
    for e in entries:
        groups.setdefault(e.sampling, []).append(e)
    blocks = []
    for group in groups.values():
        group.sort(key=lambda e: (e.prompt_tokens, e.number))
        block, most_tokens = [], 0
        for e in group:
            longest = round_up(e.prompt_tokens, ROUND_TO)  # the group is sorted: e is the longest
            if block and (len(block) == batch or longest + max(most_tokens, e.max_tokens) > max_positions):
                blocks.append(block)
                block, most_tokens = [], 0
            block.append(e)
            most_tokens = max(most_tokens, e.max_tokens)
        if block:
            blocks.append(block)
    return blocks


def default_seed(job_seed: int, rid: str) -> int:
    """A record's sampling seed when it gives none: from the job's seed and its id, so it does not
    depend on which block the record lands in."""
    digest = hashlib.sha256(f"{job_seed}:{rid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def until_eos(tokens: list[int], eos_ids) -> tuple[list[int], bool]:
    """The tokens before the first end-of-sequence id, and whether there was one (eos_ids None: never)."""
    cut = None if eos_ids is None else next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    return (tokens, False) if cut is None else (tokens[:cut], True)


def cut_at_stop(text: str, stops: tuple) -> tuple[str, bool]:
    """The text up to the earliest stop string (excluded), and whether one was found."""
    cuts = [text.find(s) for s in stops]
    cuts = [c for c in cuts if c >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class Job:
    """Runs the records of `job_input` not yet in `output` on `engine`; `formatter` makes each
    output record (format.py)."""

    def __init__(self, engine, job_input: JobInput, output, tokenizer, formatter, eos_ids, job_seed: int = 0,
                 progress=None):
        self.engine, self.input, self.output, self.tokenizer = engine, job_input, output, tokenizer
        self.formatter, self.eos_ids, self.job_seed, self.progress = formatter, eos_ids, job_seed, progress
        self.stats = JobStats(records=len(job_input.entries))

    def pending(self) -> list[Entry]:
        return [e for e in self.input.entries if e.id not in self.output.done]

    def run(self):
        """Generates every pending record; yields each block's output records as it is written."""
        start = time.perf_counter()
        todo = self.pending()
        self.stats.skipped = self.stats.records - len(todo)
        bad = [e for e in todo if e.error is not None]
        if bad:
            records = [self.formatter.error(e) for e in bad]
            self.output.append(records)
            self.stats.bad += len(bad)
            self._advance(len(bad), 0)
            yield records
        for block in plan_blocks([e for e in todo if e.error is None], self.engine.policy.batch_size,
                                 self.engine.spec.max_positions):
            records = self._generate(block)
            self.output.append(records)
            self.stats.seconds = time.perf_counter() - start
            yield records
        self.stats.seconds = time.perf_counter() - start

    def _advance(self, records: int, tokens: int):
        if self.progress is not None:
            self.progress(records, tokens)

    def _generate(self, block: list[Entry]) -> list[dict]:
        engine, batch = self.engine, self.engine.policy.batch_size
        requests, tokens = zip(*(self.input.tokens(e) for e in block))
        filler = batch - len(block)
        max_tokens = [r.max_tokens for r in requests] + [1] * filler
        gen_len = max(max_tokens)
        spec = engine.spec
        # plan_blocks keeps the rounded length within the positions, unless one record alone needs them all
        prompt_len = min(round_up(max(len(t) for t in tokens), ROUND_TO), spec.max_positions - gen_len)
        ids, mask = pad_prompts(list(tokens) + [tokens[-1]] * filler, prompt_len, spec.pad_token_id)
        sampling = block[0].sampling
        seeds = [r.seed if r.seed is not None else default_seed(self.job_seed, r.id) for r in requests]
        out = engine.generate(ids, mask, max_new_tokens=gen_len, do_sample=sampling.temperature > 0,
                              temperature=sampling.temperature or 1.0, top_k=sampling.top_k, top_p=sampling.top_p,
                              eos_token_id=self.eos_ids, row_seeds=seeds + [seeds[-1]] * filler,
                              row_max_new_tokens=max_tokens)
        stats = engine.last_stats
        records, generated = [], 0
        for entry, request, row in zip(block, requests, out):
            new, hit_eos = until_eos(row[prompt_len: prompt_len + request.max_tokens].tolist(), self.eos_ids)
            text, stopped = cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), request.stop)
            completion = len(new) + hit_eos  # the EOS token counts as generated
            generated += completion
            records.append(self.formatter.result(entry, request, text, "stop" if hit_eos or stopped else "length",
                                                 entry.prompt_tokens, completion))
        s = self.stats
        s.done += len(block)
        s.blocks += 1
        s.shapes.add((prompt_len, gen_len))
        s.prompt_tokens += sum(e.prompt_tokens for e in block)
        s.computed_prompt_tokens += batch * prompt_len
        s.generated_tokens += generated
        s.decode_slots += batch * stats.steps_done
        self._advance(len(block), generated)
        return records
