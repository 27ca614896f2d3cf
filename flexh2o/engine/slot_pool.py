"""Sequences in a fixed number of slots, each slot taking the next waiting prompt as soon as its
sequence stops: continuous batching.

A slot is one row of the batch, with its KV cache rows preallocated at the size of the longest
request (kv/cache.py). When a sequence stops (EOS, its max_new_tokens, its stop check) its row is
free; at the next token step that joins (every `join_every` steps) the free rows take waiting
requests in order. The joining rows of gpu-batch k get a prompt step of their own, a second call
of each (layer, k) unit right after that unit's decode call, on the weights loaded for it
(schedule.py); the prompt step writes each joining row's cache whole.

Each sequence keeps its own place: its prompt's real tokens fill its cache slots from 0 (no
padding stored), its position and the full cache's slot for a new token are its prompt length
plus the tokens it generated, and it samples from a generator of its own seed, drawing once per
token as it would alone; a request may bring its own sampling settings.

A decode step computes only the rows whose sequence runs: a row whose sequence stopped (or that
has none yet, or takes its prompt in chunks) is left out, its cache untouched, so that a pool's
tail, with nothing left waiting, computes no stopped row. Where every decode step must keep the
gpu-batch's shape (`fixed_shape`: a CUDA graph replays one shape, pipeline stages expect it),
such a row is computed and its output ignored.

A request can be cancelled from any thread (`Request.cancelled`): it leaves its row, or the
queue, at the next token step, and on_done hears "cancelled".
"""

import torch

from flexh2o.common.errors import UsageError
from flexh2o.engine.logprobs import prompt_scores, scores
from flexh2o.engine.sequences import Step, prompt_step
from flexh2o.engine.slot_request import Request, seeds_of


JOIN_PADDING = 0.1  # the most of a joining group's prompt positions that may be padding


class SlotPool:
    """The state of `batch` slots fed from `requests` (an iterator of Request; it may also yield None
    while nothing waits); `on_done(request, tokens, reason)` receives each finished sequence's new
    tokens (ending with the EOS token where one ended it) and "stop" (EOS or stop check), "length"
    or "cancelled". wait_for_work(), where given, is called when nothing runs and nothing waits: it
    returns once a request may be waiting, True, or False to end the run (a server's pool idles).
    on_step(), where given, is called as each token step ends, its tokens all chosen."""

    refills = True
    fixed_shape = False  # decode steps over every row of the gpu-batch (set by CUDA graphs and pipeline stages)

    def __init__(self, requests, batch: int, gpu_batch_size: int, sampler, eos_token_id, pad_token_id: int, device,
                 on_done, join_every: int = 1, prompt_chunk: int | None = None, wait_for_work=None, on_step=None):
        self.requests, self.waiting, self.wait_for_work, self.on_step = iter(requests), [], wait_for_work, on_step
        self.batch, self.gpu_batch_size, self.join_every = batch, gpu_batch_size, join_every
        self.prompt_chunk = prompt_chunk
        self.prefilling = {}  # row -> (its request, prompt tokens in its cache): a prompt taken in chunks
        self.sampler, self.pad, self.device, self.on_done = sampler, pad_token_id, device, on_done
        self.eos = None if eos_token_id is None else torch.tensor(eos_token_id).view(-1)
        self.request = [None] * batch
        self.generators = [None] * batch
        self.samplers = [sampler] * batch  # each row's request's
        self.new_tokens = [[] for _ in range(batch)]
        self.real_len = torch.zeros(batch, dtype=torch.long)
        self.generated = torch.zeros(batch, dtype=torch.long)
        self.seeds = torch.zeros(batch, dtype=torch.long)      # each row's sequence's seed (Keyformer's noise)
        self.gen_lens = torch.ones(batch, dtype=torch.long)    # and its max_new_tokens (Keyformer's tau)
        self.last = torch.full((batch,), pad_token_id, dtype=torch.long)
        self.active = torch.zeros(batch, dtype=torch.bool)  # running: decoded at the next step
        self.decoding = self.active.clone()  # running as the current step began for its gpu-batch
        gpu_batches = -(-batch // gpu_batch_size)
        self.joining = [[] for _ in range(gpu_batches)]  # per gpu-batch: (row, request), whole prompts joining
        self.chunks = [[] for _ in range(gpu_batches)]   # and (row, request, first token): one chunk each
        self.refill_joins = [[] for _ in range(gpu_batches)]  # per refill step: the rows it starts, or None
        self.computed = [None] * gpu_batches  # per gpu-batch: the rows its decode step in flight computes
        self.uniforms = torch.zeros(batch, dtype=torch.float64)  # each sampling row's number of this step
        # Where tokens are applied later than chosen (a pipeline's stages, stage_refill.py): chosen
        # tokens are only returned, and take() applies them.
        self.deferred = False
        self.in_flight = 0   # rows whose prompt step ran but whose first token is not applied yet
        self._join_step = -1
        self.joined = 0      # requests that took a slot
        self.row_joins = [0] * batch  # of which per slot
        self.joins = 0       # token steps at which some did
        self.decode_slots = 0  # (row, decode step) pairs computed
        self.prompt_positions = 0  # prompt positions computed, padding included

    def rows(self, k: int) -> slice:
        return slice(k * self.gpu_batch_size, (k + 1) * self.gpu_batch_size)

    def _peek(self):
        while not self.waiting:
            request = next(self.requests, None)
            if request is None:
                return None
            if not len(request.ids):
                raise UsageError("requests", "a request without prompt tokens: each needs one at least, to "
                                 "predict its first new token from")
            if request.cancelled:
                self.on_done(request, [], "cancelled")
            else:
                self.waiting = [request]
        return self.waiting[0]

    def _take(self):
        request = self._peek()
        self.waiting.pop(0)
        return request

    def begin(self, i: int):
        """Token step i starts, every gpu-batch decided at once (decide)."""
        self.start_step(i)
        self.decide(i, range(len(self.joining)))

    def start_step(self, i: int):
        """Token step i starts; its gpu-batches are decided by decide (all at once, or per micro-batch)."""
        self.i = i

    def decide(self, i: int, ks):
        """Gpu-batches ks at token step i: their free rows take waiting requests (every join_every
        steps, or whenever nothing runs), in order of rows; their running sequences draw their
        random numbers."""
        rows = range(self.rows(ks[0]).start, min(self.rows(ks[-1]).stop, self.batch))
        part = slice(rows.start, rows.stop)
        self._drop_cancelled(rows)
        self.decoding[part] = self.active[part]
        for k in ks:
            self.joining[k], self.chunks[k] = [], []
        for row, (request, start) in self.prefilling.items():
            if row in rows:
                self.chunks[row // self.gpu_batch_size].append((row, request, start))
        if i % self.join_every == 0 or not (self.active.any() or self.prefilling or self.in_flight):
            for row in (~self.active[part]).nonzero().flatten().add(rows.start).tolist():
                if row in self.prefilling:
                    continue
                if self._peek() is None:
                    break
                request = self._take()
                if self.prompt_chunk is not None and len(request.ids) > self.prompt_chunk:
                    self.chunks[row // self.gpu_batch_size].append((row, request, 0))
                else:
                    self.joining[row // self.gpu_batch_size].append((row, request))
        joined = any(self.joining[k] or any(start == 0 for _, _, start in self.chunks[k]) for k in ks)
        if joined and self._join_step != i:
            self.joins += 1
            self._join_step = i
        for row in self.decoding[part].nonzero().flatten().add(rows.start).tolist():
            if not self.samplers[row].greedy:
                self.uniforms[row] = torch.rand(1, generator=self.generators[row], dtype=torch.float64)

    def _drop_cancelled(self, rows: range):
        """Rows among `rows` whose request was cancelled are freed (a prompt in chunks forgotten)."""
        for row in rows:
            request = self.request[row] or self.prefilling.get(row, (None,))[0]  # (None where the row is free)
            if request is not None and request.cancelled:
                self._leave(row, "cancelled")

    def steps(self, i: int, num_gpu_batches: int, device_counters: bool = False) -> list:
        """The decode step of every gpu-batch with a running sequence (None for the others)."""
        self.begin(i)
        return [self.step(i, k) if self.decoding[self.rows(k)].any() else None for k in range(num_gpu_batches)]

    def step(self, i: int, k: int) -> Step:
        whole, dev = self.rows(k), self.device
        computed = None
        rows = list(range(whole.start, min(whole.stop, self.batch)))
        if not self.fixed_shape and not bool(self.decoding[whole].all()):
            computed = self.decoding[whole].nonzero().flatten().tolist()
            rows = [whole.start + r for r in computed]
        self.computed[k] = rows
        index = torch.tensor(rows)
        ids = self.last[index].unsqueeze(1)
        # (fixed_shape) A row that runs no sequence (stopped, or never filled) repeats its last
        # position: its cache slot there is rewritten with what is never read. A row taking its
        # prompt in chunks writes at its next chunk's first slot, which that chunk then rewrites.
        positions = (self.real_len[index] + self.generated[index] - 1).clamp_(min=0)
        for n, row in enumerate(rows):
            if row in self.prefilling:
                positions[n] = self.prefilling[row][1]
        positions = positions.unsqueeze(1)
        slots = positions.squeeze(1)
        self.decode_slots += slots.shape[0]
        return Step(i, k, False, ids.to(dev), positions.to(dev), None, None,
                    lambda logits: self._choose(k, logits), True, host_token_ids=ids, host_positions=positions,
                    row_slots=slots.to(dev), fill=int(slots.max()) + 1, before=(self.generated[index] - 1).to(dev),
                    row_seeds=self.seeds[index], row_gen_lens=self.gen_lens[index], computed_rows=computed)

    def refill_steps(self, i: int, num_gpu_batches: int) -> list:
        """Per gpu-batch, the prompt steps of the requests joining at token step i: one for the
        whole prompts, one per prompt taken in chunks; a sequence draws its first random number at
        its prompt's last step."""
        return [self.refills_of(i, k) for k in range(num_gpu_batches)]

    def refills_of(self, i: int, k: int) -> list:
        """Gpu-batch k's prompt steps at token step i (refill_steps)."""
        made = self._whole_prompts(i, k) + [self._chunk(i, k, *c) for c in self.chunks[k]]
        self.refill_joins[k] = [joining for _, joining in made]
        return [step for step, _ in made]

    def _chunk(self, i: int, k: int, row: int, request: Request, start: int) -> tuple:
        """The prompt step of request's tokens [start, start + prompt_chunk), after the ones
        [0, start) its row's cache already holds, and the row it starts (None before the last chunk)."""
        stop = min(start + self.prompt_chunk, len(request.ids))
        ids = torch.tensor([request.ids[start:stop]])
        positions = torch.arange(start, stop).unsqueeze(0)
        self.prompt_positions += stop - start
        joining = None
        if stop < len(request.ids):
            self.prefilling[row] = (request, stop)
            choose = lambda logits: None  # noqa: E731 - no token before the prompt's last chunk
        else:
            self.prefilling.pop(row, None)
            joining = [(row, request)]
            choose = self._joiner(i, joining)
        score = None
        if request.prompt_logprobs is not None:  # the chunk's positions, each but the prompt's last
            if start == 0:
                request.prompt_scores = []
            end = min(stop, len(request.ids) - 1)
            score = lambda hidden, head: request.prompt_scores.extend(prompt_scores(  # noqa: E731
                hidden[0, : end - start], head, request.ids[start + 1: end + 1], request.prompt_logprobs))
        return Step(i, k, True, ids.to(self.device), positions.to(self.device),
                    torch.ones_like(ids, dtype=torch.bool).to(self.device), None, choose, False,
                    host_token_ids=ids, host_positions=positions, refill=[(row - k * self.gpu_batch_size, 0)],
                    chunk_start=start, row_seeds=seeds_of([request]), score_prompt=score), joining

    def _joiner(self, i: int, joining: list):
        """The function that takes the joining rows' prompt logits: their generators seeded, each
        drawing its first random number."""
        for row, request in joining:
            self.generators[row] = torch.Generator().manual_seed(request.seed or 0)
            self.samplers[row] = request.sampler or self.sampler
        uniforms = torch.cat([torch.zeros(1, dtype=torch.float64) if self.samplers[row].greedy else
                              torch.rand(1, generator=self.generators[row], dtype=torch.float64)
                              for row, _ in joining])
        self.joined += len(joining)
        self.in_flight += len(joining)
        return lambda logits: self._join(joining, logits, uniforms)

    def _whole_prompts(self, i: int, k: int) -> list:
        """The prompt steps of the whole prompts joining gpu-batch k, each with the rows it starts:
        sorted by length and cut into groups each padded by at most JOIN_PADDING of its positions."""
        joining = sorted(self.joining[k], key=lambda j: len(j[1].ids))
        groups, real = [], 0
        for row, request in joining:
            n = len(request.ids)
            if groups and (real + n) < (1 - JOIN_PADDING) * n * (len(groups[-1]) + 1):
                groups.append([])
                real = 0
            if not groups:
                groups.append([])
            groups[-1].append((row, request))
            real += n
        return [self._prompt_group(i, k, group) for group in groups]

    def _prompt_group(self, i: int, k: int, joining: list) -> tuple:
        """The prompt step of whole prompts joining gpu-batch k together, left-padded to the longest."""
        s = max(len(request.ids) for _, request in joining)
        ids = torch.full((len(joining), s), self.pad, dtype=torch.long)
        valid = torch.zeros(len(joining), s, dtype=torch.bool)
        for n, (row, request) in enumerate(joining):
            ids[n, s - len(request.ids):] = torch.tensor(request.ids)
            valid[n, s - len(request.ids):] = True
        self.prompt_positions += ids.numel()
        scored = [(n, request) for n, (_, request) in enumerate(joining) if request.prompt_logprobs is not None]

        def score(hidden, head):  # each position of a prompt but its last, the token after it
            for n, request in scored:
                request.prompt_scores = prompt_scores(hidden[n, s - len(request.ids): s - 1], head, request.ids[1:],
                                                      request.prompt_logprobs)
        return prompt_step(i, k, ids, valid, self._joiner(i, joining), self.device,
                           refill=[(row - k * self.gpu_batch_size, s - len(request.ids)) for row, request in joining],
                           row_seeds=seeds_of([request for _, request in joining]),
                           score_prompt=score if scored else None), joining

    def _choose(self, k: int, logits):
        """Gpu-batch k's decode logits [b, vocab] -> the next tokens [b, 1] (on the device); the
        running rows' are recorded."""
        uniforms = self.uniforms_of(k)
        return self.chosen(self.i, k, logits, self.pick(logits, None if uniforms is None else uniforms.to(logits.device)))

    # What a replayed decode step (decode_graphs.py) asks of the sequences, as Sequences has it: the
    # pool's own sampler picks every row on the device (a graph holds one pick), and chosen() picks
    # again the rows whose request brought its own.
    def uniforms_of(self, k: int) -> torch.Tensor | None:
        return None if self.sampler.greedy else self.uniforms[self.computed[k]]

    def pick(self, logits, uniforms):
        return self.sampler.pick(logits, uniforms)

    def chosen(self, i: int, k: int, logits, picked):
        """The tokens picked on the device for gpu-batch k's decode: the running rows' recorded
        (unless deferred)."""
        rows = self.computed[k]
        tokens = self._own_picks(rows, logits, picked.cpu(), self.uniforms[rows])
        self._score(rows, logits, tokens)
        if not self.deferred:
            self.take_decode(k, tokens)
        return tokens.unsqueeze(1).to(self.device)

    def _join(self, joining, logits, uniforms):
        """The joining rows' prompt logits [r, vocab] -> their first tokens."""
        rows = [row for row, _ in joining]
        tokens = self._own_picks(rows, logits, self.sampler.pick(logits, uniforms.to(logits.device)).cpu(), uniforms,
                                 [request for _, request in joining])
        self._score(rows, logits, tokens, [request for _, request in joining])
        if not self.deferred:
            self.take_join(joining, tokens)
        return tokens.unsqueeze(1).to(self.device)

    def _own_picks(self, rows: list, logits, tokens, uniforms, requests: list | None = None):
        """tokens [n] (CPU) as the pool's sampler picked them for `rows`, each row whose request
        brings its own sampler picked again by it (requests: the rows' own, where they have not
        taken their rows yet)."""
        own: dict = {}
        for n, row in enumerate(rows):
            request = self.request[row] if requests is None else requests[n]
            sampler = request.sampler if request is not None else None
            if sampler is not None and sampler is not self.sampler:
                own.setdefault(sampler, []).append(n)
        for sampler, index in own.items():
            at = torch.tensor(index)
            picked = sampler.pick(logits[at.to(logits.device)], uniforms[at].to(logits.device))
            tokens[at] = picked.cpu()
        return tokens

    def _score(self, rows: list, logits, tokens, requests: list | None = None):
        """Each row whose request asks for log-probabilities: the chosen token's, kept with it."""
        for n, row in enumerate(rows):
            request = self.request[row] if requests is None else requests[n]
            if request is not None and request.logprobs is not None and (requests is not None or self.decoding[row]):
                request.token_scores += scores(logits[n: n + 1], tokens[n: n + 1], request.logprobs)

    def take(self, k: int, decode, refills: list):
        """Gpu-batch k's chosen tokens of the step in flight, applied: its decode's [b] (None where it
        had none) and each of its prompt steps' [r] (None where it started no row)."""
        if decode is not None:
            self.take_decode(k, decode)
        for joining, tokens in zip(self.refill_joins[k], refills):
            if joining:
                self.take_join(joining, tokens)

    def expected(self, k: int) -> tuple:
        """What take(k, ...) will be given: whether gpu-batch k decodes at the step in flight, and
        the rows each of its prompt steps starts."""
        return bool(self.decoding[self.rows(k)].any()), [len(j) if j else 0 for j in self.refill_joins[k]]

    def take_decode(self, k: int, tokens):
        for n, row in enumerate(self.computed[k]):
            if self.decoding[row]:
                self._accept(row, int(tokens[n]))

    def take_join(self, joining: list, tokens):
        for n, (row, request) in enumerate(joining):
            self.request[row], self.new_tokens[row] = request, []
            self.samplers[row] = request.sampler or self.sampler
            self.real_len[row], self.generated[row] = len(request.ids), 0
            self.seeds[row], self.gen_lens[row] = request.seed or 0, request.max_new_tokens
            self.active[row] = True
            self.row_joins[row] += 1
            self._accept(row, int(tokens[n]))
        self.in_flight -= len(joining)

    def _accept(self, row: int, token: int):
        request, tokens = self.request[row], self.new_tokens[row]
        tokens.append(token)
        self.generated[row] += 1
        self.last[row] = token
        if request.on_token is not None:
            request.on_token(request, token)
        reason = None
        if self.eos is not None and bool((self.eos == token).any()):
            reason = "stop"
        elif request.stop_check is not None and request.stop_check(torch.tensor(tokens)):
            reason = "stop"
        elif len(tokens) >= request.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._leave(row, reason)

    def _leave(self, row: int, reason: str):
        """The row's sequence ends (or its prompt, taken in chunks, is dropped): the row is free."""
        if self.active[row]:
            request, tokens = self.request[row], self.new_tokens[row]
        else:
            request, tokens = self.prefilling.pop(row)[0], []
        self.active[row] = False
        self.request[row], self.generators[row] = None, None
        self.on_done(request, tokens, reason)

    def all_finished(self) -> bool:
        """Nothing runs and nothing waits (where wait_for_work is given: and it ends the run). Asked
        once at the end of every token step."""
        if self.on_step is not None:
            self.on_step()
        while not self.active.any() and not self.prefilling and not self.in_flight and self._peek() is None:
            if self.wait_for_work is None or not self.wait_for_work():
                return True
        return False
