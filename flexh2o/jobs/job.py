"""A dataset job: every record of an input generated on one loaded engine.

By default the records of one sampling setting run through a pool of slots (engine/slot_pool.py):
the batch of the plan for the job's longest prompt and largest max_tokens, each slot taking the
next record as soon as its sequence stops (EOS, its own max_tokens, one of its stop strings).
Records join longest max_tokens first, so that the last ones to finish are short. Finished
records go to the output a batch at a time, or after FLUSH_SECONDS (output.py).

With fixed blocks (`fixed_blocks`) the records are cut into blocks (blocks.py), each at its
shape's plan (plans.py), generating until every sequence of the block has stopped. Where a plan's
batch exceeds the block's records (gpu-batches of equal size), the rest is filled with copies of
its last prompt that stop after one token. Records go to the output as each block finishes.
"""

import hashlib
import time
from dataclasses import dataclass, field

from flexh2o.engine.slot_request import Request
from flexh2o.runs.prompts import pad_prompts
from flexh2o.jobs.blocks import ROUND_TO, block_shape, plan_blocks, round_up
from flexh2o.jobs.input import Entry, JobInput
from flexh2o.jobs.plans import FixedPlan, use_plan


@dataclass
class JobStats:
    records: int = 0            # in the input
    skipped: int = 0            # already in the output (a resumed job)
    done: int = 0               # written by this run
    bad: int = 0                # written as error records (--skip-bad)
    blocks: int = 0             # fixed blocks run, or pools of slots
    refills: int = 0            # records that took a slot another record had used
    join_steps: int = 0         # token steps at which records joined a pool
    prompt_tokens: int = 0      # real prompt tokens of the records generated
    computed_prompt_tokens: int = 0  # prompt positions computed (with the blocks' padding)
    generated_tokens: int = 0
    decode_slots: int = 0       # (sequence, token step) pairs computed
    shapes: set = field(default_factory=set)  # distinct (batch, prompt_len, gen_len) of the blocks
    read_seconds: float = 0.0       # reading and checking the input before the model loaded
    seconds: float = 0.0            # running the blocks and writing their records
    generate_seconds: float = 0.0   # of which in the engine's generate calls

    def summary(self) -> dict:
        padding = 1 - self.prompt_tokens / self.computed_prompt_tokens if self.computed_prompt_tokens else 0.0
        wasted = 1 - self.generated_tokens / self.decode_slots if self.decode_slots else 0.0
        wall = self.read_seconds + self.seconds  # the first plan and the model's loading excluded
        own = wall - self.generate_seconds
        return {"records": self.records, "skipped_already_done": self.skipped, "written": self.done,
                "bad_records": self.bad, "blocks": self.blocks, "block_shapes": len(self.shapes),
                "refills": self.refills, "join_steps": self.join_steps,
                "shapes_batch_prompt_gen": sorted(self.shapes),
                "prompt_tokens": self.prompt_tokens, "computed_prompt_tokens": self.computed_prompt_tokens,
                "padding_share": padding, "generated_tokens": self.generated_tokens,
                "decode_slots": self.decode_slots, "slots_wasted_after_stop": wasted,
                "wall_seconds": wall, "generate_seconds": self.generate_seconds, "job_own_seconds": own,
                "job_own_share": own / wall if wall else 0.0,
                "generated_tokens_per_second": self.generated_tokens / wall if wall else 0.0}


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


# Finished records are written (and fsynced) a batch of them at a time, or at the first record to
# finish this long after the last write.
FLUSH_SECONDS = 1.0


class Job:
    """Runs the records of `job_input` not yet in `output` on `engine`; `formatter` makes each
    output record (format.py)."""

    def __init__(self, engine, job_input: JobInput, output, tokenizer, formatter, eos_ids, job_seed: int = 0,
                 progress=None, plans=None, fixed_blocks: bool = False, join_every: int = 1,
                 prompt_chunk: int | None = None):
        """plans: each block shape's policy (plans.py); default: the engine's own for every block.
        fixed_blocks: blocks that run to their longest member instead of refilled slots; join_every:
        free slots take new records every this many token steps; prompt_chunk: a longer prompt
        joins this many tokens per step (Engine.generate_refilled)."""
        self.engine, self.input, self.output, self.tokenizer = engine, job_input, output, tokenizer
        self.formatter, self.eos_ids, self.job_seed, self.progress = formatter, eos_ids, job_seed, progress
        self.plans = plans or FixedPlan(engine.policy)
        self.fixed_blocks = fixed_blocks
        self.join_every, self.prompt_chunk = join_every, prompt_chunk
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
        good = [e for e in todo if e.error is None]
        if not self.fixed_blocks:
            groups: dict = {}
            for e in good:
                groups.setdefault(e.sampling, []).append(e)
            for group in groups.values():
                yield from self._generate_refilled(group, start)
            self.stats.seconds = time.perf_counter() - start
            return
        for block in plan_blocks(good, self.plans.batch_for, self.engine.spec.max_positions):
            records = self._generate(block)
            self.output.append(records)
            self.stats.seconds = time.perf_counter() - start
            yield records
        self.stats.seconds = time.perf_counter() - start

    def _generate_refilled(self, entries: list[Entry], start: float):
        """One sampling setting's records through a pool of slots; yields its output records as
        they are written."""
        engine, spec = self.engine, self.engine.spec
        gen_len = max(e.max_tokens for e in entries)
        prompt_len = min(round_up(max(e.prompt_tokens for e in entries), ROUND_TO), spec.max_positions - gen_len)
        policy = use_plan(engine, self.plans, prompt_len, gen_len, len(entries))
        entries = sorted(entries, key=lambda e: (-e.max_tokens, e.number))
        finished, written, last_write, unreported = [], [], [time.perf_counter()], [0]  # tokens not yet in progress()

        def requests():
            for entry in entries:
                yield record_request(self.input, entry, self.tokenizer, self.job_seed)

        def flush():
            if finished:
                self.output.append(finished)
                written.append(list(finished))
                self._advance(len(finished), unreported[0])
                finished.clear()
                unreported[0] = 0
            last_write[0] = time.perf_counter()

        def done(request, tokens, reason):
            record, completion = self._record(*request.tag, tokens)
            self.stats.generated_tokens += completion
            unreported[0] += completion
            self.stats.done += 1
            finished.append(record)
            if len(finished) >= policy.batch_size or time.perf_counter() - last_write[0] >= FLUSH_SECONDS:
                flush()

        began = time.perf_counter()
        sampling = entries[0].sampling
        pool = engine.generate_refilled(requests(), done, prompt_len, gen_len, do_sample=sampling.temperature > 0,
                                        temperature=sampling.temperature or 1.0, top_k=sampling.top_k,
                                        top_p=sampling.top_p, eos_token_id=self.eos_ids, join_every=self.join_every,
                                        prompt_chunk=self.prompt_chunk)
        self.stats.generate_seconds += time.perf_counter() - began
        flush()
        s = self.stats
        s.blocks += 1
        s.refills += max(0, pool.joined - policy.batch_size)
        s.join_steps += pool.joins
        s.shapes.add((policy.batch_size, prompt_len, gen_len))
        s.prompt_tokens += sum(e.prompt_tokens for e in entries)
        s.computed_prompt_tokens += pool.prompt_positions
        s.decode_slots += pool.decode_slots + pool.joined  # a joining record's first token comes from its prompt step
        s.seconds = time.perf_counter() - start
        yield from written

    def _advance(self, records: int, tokens: int):
        if self.progress is not None:
            self.progress(records, tokens)

    def _generate(self, block: list[Entry]) -> list[dict]:
        engine, spec = self.engine, self.engine.spec
        prompt_len, gen_len = block_shape(block, spec.max_positions)
        policy = use_plan(engine, self.plans, prompt_len, gen_len, len(block))
        batch = policy.batch_size
        requests, tokens = zip(*(self.input.tokens(e) for e in block))
        filler = batch - len(block)
        max_tokens = [r.max_tokens for r in requests] + [1] * filler
        ids, mask = pad_prompts(list(tokens) + [tokens[-1]] * filler, prompt_len, spec.pad_token_id)
        sampling = block[0].sampling
        seeds = [r.seed if r.seed is not None else default_seed(self.job_seed, r.id) for r in requests]
        stops = StopStrings(self.tokenizer, [r.stop for r in requests])
        began = time.perf_counter()
        out = engine.generate(ids, mask, max_new_tokens=gen_len, do_sample=sampling.temperature > 0,
                              temperature=sampling.temperature or 1.0, top_k=sampling.top_k, top_p=sampling.top_p,
                              eos_token_id=self.eos_ids, row_seeds=seeds + [seeds[-1]] * filler,
                              row_max_new_tokens=max_tokens, stop_check=stops.check if stops.any else None)
        self.stats.generate_seconds += time.perf_counter() - began
        stats = engine.last_stats
        records, generated = [], 0
        for n, (entry, request, row) in enumerate(zip(block, requests, out)):
            limit = min(request.max_tokens, stops.stopped_at.get(n, request.max_tokens))
            record, completion = self._record(entry, request, row[prompt_len: prompt_len + limit].tolist())
            generated += completion
            records.append(record)
        s = self.stats
        s.done += len(block)
        s.blocks += 1
        s.shapes.add((batch, prompt_len, gen_len))
        s.prompt_tokens += sum(e.prompt_tokens for e in block)
        s.computed_prompt_tokens += batch * prompt_len
        s.generated_tokens += generated
        s.decode_slots += batch * stats.steps_done
        self._advance(len(block), generated)
        return records

    def _record(self, entry, request, tokens: list[int]) -> tuple:
        return result_record(self.formatter, self.tokenizer, self.eos_ids, entry, request, tokens)


def record_request(job_input, entry, tokenizer, job_seed: int, **extra) -> Request:
    """A record as a slot pool's request, tagged (entry, parsed record): its prompt's ids, its
    max_tokens, its seed (its own, or the job's for its id) and its stop strings; `extra`: more of
    Request's fields."""
    request, ids = job_input.tokens(entry)
    check = None if not request.stop else (lambda new, stops=request.stop: holds_stop(tokenizer, new, stops))
    seed = request.seed if request.seed is not None else default_seed(job_seed, request.id)
    return Request(ids, request.max_tokens, seed, check, (entry, request), **extra)


def result_record(formatter, tokenizer, eos_ids, entry, request, tokens: list[int]) -> tuple:
    """(the output record, tokens generated) of a record whose sequence generated `tokens`."""
    new, hit_eos = until_eos(tokens, eos_ids)
    text, stopped = cut_at_stop(tokenizer.decode(new, skip_special_tokens=True), request.stop)
    completion = len(new) + hit_eos  # the EOS token counts as generated
    return formatter.result(entry, request, text, "stop" if hit_eos or stopped else "length",
                            entry.prompt_tokens, completion), completion


def holds_stop(tokenizer, tokens, stops) -> bool:
    """Whether the text of tokens (a CPU tensor) holds one of the stop strings."""
    text = tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    return any(s in text for s in stops)


class StopStrings:
    """Ends a sequence as soon as its text holds one of its stop strings (Engine.generate's
    stop_check), noting after how many tokens."""

    def __init__(self, tokenizer, stops: list[tuple]):
        self.tokenizer, self.stops = tokenizer, stops
        self.any = any(stops)
        self.stopped_at: dict = {}

    def check(self, row: int, tokens) -> bool:
        stops = self.stops[row] if row < len(self.stops) else ()
        if not stops:
            return False
        if holds_stop(self.tokenizer, tokens, stops):
            self.stopped_at[row] = len(tokens)
            return True
        return False
