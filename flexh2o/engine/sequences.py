"""The batch being generated: token ids, padding, positions, finished flags and scores.

It hands each layer a `Step` (what token step i of gpu-batch k needs) and receives the logits
of the output layer to choose the next tokens. Teacher-forced (`forced` [batch, gen_len]), step i
feeds forced[:, i] next whatever the logits say, and keeps the log-probability the logits gave
that token and their greedy choice (flexh2o/eval.py scores text with them).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Step:
    i: int
    k: int
    prefill: bool
    token_ids: torch.Tensor          # [b, s] input tokens of this step
    positions: torch.Tensor          # [b, s] absolute positions (-1 at padding, as transformers)
    key_valid: torch.Tensor | None   # [b, s] real (non-padding) prompt tokens, prefill only
    prompt_mask: torch.Tensor | None  # [b, 1, s, s] who may attend to whom; None: plain causal
    choose_next: Callable[[torch.Tensor], torch.Tensor]
    padded: bool = False             # some prompt of this gpu-batch has padding (empty slots among the filled)
    memo: dict = field(default_factory=dict)  # what layers compute once per step and share (rotary phases)
    host_token_ids: torch.Tensor | None = None  # token_ids and positions in CPU memory (embedding lookups)
    host_positions: torch.Tensor | None = None
    # On CUDA, what a decode step's kernels read from device memory rather than from Python ints,
    # so that every step runs the same kernels with the same arguments (decode_graphs.py): the full
    # cache's slot for the new token ([1], and as an int, slot_index) and i - 1 ([1]).
    slot: torch.Tensor | None = None
    slot_index: int = -1
    before: torch.Tensor | None = None
    # Where slots are refilled (slot_pool.py) each sequence is at its own token: a decode step's
    # `before` is then [b], per sequence, and `row_slots` [b] the full cache's slot for each new
    # token (its position), `fill` the slots in use after the step (the largest row slot + 1). A
    # refill step (a prompt step of some rows of gpu-batch k) names them: `refill` [(row in the
    # gpu-batch, left padding of its prompt)]; a step of one prompt's chunk names its first
    # token, `chunk_start` (the row's cache holds the ones before it).
    row_slots: torch.Tensor | None = None
    fill: int = 0
    refill: list | None = None
    chunk_start: int | None = None
    # Each sequence's seed and, where sequences have their own (a job's records), its max_new_tokens
    # ([b], CPU memory): what Keyformer's noise and temperature follow (kv/keyformer.py).
    row_seeds: torch.Tensor | None = None
    row_gen_lens: torch.Tensor | None = None
    # A decode step over some rows of its gpu-batch only (slot_pool.py leaves out rows whose
    # sequence stopped or has not started): those rows, ascending; its tensors hold them alone.
    # None: every row.
    computed_rows: list | None = None
    # A prompt step whose sequences asked for their prompt tokens' log-probabilities (echo):
    # score_prompt(hidden [b, s, hidden], head) is called by the output layer before it picks,
    # head(h) giving the logits [..., vocab] (float32) of hidden states h [..., hidden].
    score_prompt: Callable | None = None

    def generated_before(self, device):
        """i - 1, the tokens generated before this decode step: the step's device tensor where it
        is on `device` (or per sequence), else an int."""
        if self.before is None:
            return self.i - 1
        if self.before.device == torch.device(device):
            return self.before
        return self.before.to(device) if self.row_slots is not None else self.i - 1

    def for_rows(self, rows: slice) -> "Step":
        """This step as seen by sequences `rows` of its gpu-batch (a part of a cache split along the batch)."""
        if rows.start == 0 and rows.stop >= self.token_ids.shape[0]:
            return self
        # (A fixed batch's `before` is one count for every sequence.)
        names = ("row_seeds", "row_gen_lens") + (("row_slots", "before") if self.row_slots is not None else ())
        changed = {name: getattr(self, name)[rows] for name in names if getattr(self, name) is not None}
        return dataclasses.replace(self, **changed) if changed else self


def prompt_step(i: int, k: int, ids, valid, choose, device, **extra) -> Step:
    """The prompt step of left-padded prompts ids [b, s] whose real tokens are valid [b, s]."""
    padded = not bool(valid.all())
    positions = valid.long().cumsum(dim=1) * valid - 1
    mask = None
    if padded:
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril_()
        # A padding query attends to itself only, so its row stays finite and unused.
        mask = ((causal & valid[:, None, None, :]) | torch.eye(s, dtype=torch.bool)).to(device)
    return Step(i, k, True, ids.to(device), positions.to(device), valid.to(device), mask, choose, padded,
                host_token_ids=ids, host_positions=positions, **extra)


class Sequences:
    refills = False  # a fixed batch: every sequence starts at the prompt step (slot_pool.py refills)
    fixed_shape = True  # and every decode step computes every row

    def __init__(self, input_ids, attention_mask, gen_len, gpu_batch_size, sampler,
                 eos_token_id, pad_token_id, keep_scores, device, forced=None, row_limits=None, stop_check=None):
        batch, self.prompt_len = input_ids.shape
        self.gen_len, self.gpu_batch_size = gen_len, gpu_batch_size
        self.sampler, self.eos, self.pad, self.device = sampler, eos_token_id, pad_token_id, device
        self.ids = torch.full((batch, self.prompt_len + gen_len), pad_token_id, dtype=torch.long)
        self.ids[:, : self.prompt_len] = input_ids
        self.prompt_valid = attention_mask.bool()
        self.real_prompt_len = self.prompt_valid.sum(dim=1)
        self.finished = torch.zeros(batch, dtype=torch.bool)
        seeds = sampler.row_seeds if sampler.row_seeds is not None else range(batch)
        self.seeds = torch.tensor(seeds, dtype=torch.long)
        # Tokens each sequence may generate (a dataset job's records differ); None: gen_len for all.
        self.row_limits = None if row_limits is None else torch.as_tensor(row_limits, dtype=torch.long)
        # stop_check(row, tokens): whether a sequence's tokens so far end it (a dataset job's stop strings).
        self.stop_check = stop_check
        self.scores = [[None] * (batch // gpu_batch_size) for _ in range(gen_len)] if keep_scores else None
        self._uniforms = None
        self.forced = forced
        if forced is not None:
            self.forced_logprobs = torch.zeros(batch, gen_len, dtype=torch.float64)
            self.greedy = torch.zeros(batch, gen_len, dtype=torch.long)

    def rows(self, k: int) -> slice:
        return slice(k * self.gpu_batch_size, (k + 1) * self.gpu_batch_size)

    def steps(self, i: int, num_gpu_batches: int, device_counters: bool = False) -> list[Step]:
        """Token step i of every gpu-batch; device_counters: with the decode step's slot and count
        as device tensors (Step.slot, Step.before)."""
        self.begin(i)
        steps = [self.step(i, k) for k in range(num_gpu_batches)]
        if device_counters and i > 0:
            slot_index = self.prompt_len + i - 1
            slot, before = torch.tensor([slot_index, i - 1]).to(self.device).split(1)
            for step in steps:
                step.slot, step.slot_index, step.before = slot, slot_index, before
        return steps

    def begin(self, i: int):
        """Token step i starts: the sampler's draws for it (made once per step, whatever the order
        in which its gpu-batches then come)."""
        self._uniforms = self.sampler.uniforms(self.ids.shape[0])

    def step(self, i, k) -> Step:
        rows, dev = self.rows(k), self.device
        choose = lambda logits: self._choose_next(i, k, logits)  # noqa: E731
        valid = self.prompt_valid[rows]
        padded = not bool(valid.all())
        if i == 0:
            return prompt_step(i, k, self.ids[rows, : self.prompt_len], valid, choose, dev, row_seeds=self.seeds[rows])
        col = self.prompt_len + i - 1
        ids, positions = self.ids[rows, col: col + 1], (self.real_prompt_len[rows] + i - 1).unsqueeze(1)
        return Step(i, k, False, ids.to(dev), positions.to(dev), None, None, choose, padded,
                    host_token_ids=ids, host_positions=positions, row_seeds=self.seeds[rows],
                    row_gen_lens=None if self.row_limits is None else self.row_limits[rows])

    def _choose_next(self, i, k, logits):
        uniforms = self.uniforms_of(k)
        return self.chosen(i, k, logits, self.pick(logits, None if uniforms is None else uniforms.to(logits.device)))

    def uniforms_of(self, k: int) -> torch.Tensor | None:
        """Gpu-batch k's random numbers of the current token step (None when greedy)."""
        return None if self._uniforms is None else self._uniforms[self.rows(k)]

    def pick(self, logits, uniforms):
        """The device-side choice of the next tokens [b] from logits [b, vocab] and the random
        numbers on their device (None when teacher-forced)."""
        return None if self.forced is not None else self.sampler.pick(logits, uniforms)

    def chosen(self, i, k, logits, picked):
        """The host's side of choosing: scores kept, a teacher-forced step scored, the tokens (picked
        on the device, or forced) recorded; returns them as the next step's input [b, 1]."""
        rows = self.rows(k)
        if self.scores is not None:
            self.scores[i][k] = logits.cpu()
        if self.forced is not None:
            tokens = self.forced[rows, i]
            logprobs = torch.log_softmax(logits.double(), dim=-1).cpu()
            self.forced_logprobs[rows, i] = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            self.greedy[rows, i] = logits.argmax(dim=-1).cpu()
        else:
            tokens = picked.cpu()
        return self.accept(i, k, tokens).unsqueeze(1).to(self.device)

    def accept(self, i, k, tokens) -> torch.Tensor:
        """Gpu-batch k's tokens [b] (CPU) of step i, as chosen (here, or by a pipeline's last stage):
        recorded, with what they finish; returns them as recorded (padding where finished)."""
        rows = self.rows(k)
        finished = self.finished[rows]
        tokens = tokens.masked_fill(finished, self.pad)  # finished sequences emit padding
        if self.eos is not None:  # one id, or several (any of them ends a sequence)
            self.finished[rows] = finished | torch.isin(tokens, torch.tensor(self.eos).view(-1))
        if self.row_limits is not None:
            self.finished[rows] |= self.row_limits[rows] <= i + 1
        self.ids[rows, self.prompt_len + i] = tokens
        if self.stop_check is not None:
            new = self.ids[rows, self.prompt_len: self.prompt_len + i + 1]
            for n, row in enumerate(range(rows.start, rows.stop)):
                if not self.finished[row] and self.stop_check(row, new[n]):
                    self.finished[row] = True
        return tokens

    def refill_steps(self, i: int, num_gpu_batches: int) -> list:
        """Prompt steps of sequences that join at token step i, a list per gpu-batch: none here (a
        fixed batch; slot_pool.py refills)."""
        return [[] for _ in range(num_gpu_batches)]

    def all_finished(self) -> bool:
        return bool(self.finished.all())

    def score_list(self, steps_done: int) -> list[torch.Tensor]:
        return [torch.cat(self.scores[i]) for i in range(steps_done)]
