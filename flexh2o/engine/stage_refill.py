"""Pipeline stages over refilled slots (slot_pool.py): every stage keeps its own copy of the pool,
and every copy makes the same decisions.

Only the last stage sees logits; it sends each micro-batch's chosen tokens (its decode's, and the
first token of each sequence whose prompt step it ran) to every other stage. Every stage, the
last included, applies micro-batch g's tokens of step i at the same point of the run: as the
micro-batch enters step i + 1 (micro-batch 0's at the end of step i, where the first stage
decides whether to stop, as for fixed batches). Right after, the stage decides which waiting
requests take the micro-batch's free rows. The same tokens applied in the same order give the
same decisions on every stage, so each stage builds the same steps, and knows the shapes of the
hidden states and tokens it is about to receive without being told.

Deciding per micro-batch, not per token step, is what keeps the first stage from waiting: it has
micro-batch g's tokens of step i only once the last stage is done with them, which is just before
g enters step i + 1. The rows a request lands in may so differ from one process's run; a request's
tokens do not (a sequence's result does not depend on its row or neighbours, slot_pool.py).
"""

import torch

from flexh2o.engine.pipeline import HIDDEN, TOKENS, StageSchedule


class RefillStageSchedule(StageSchedule):
    """A stage's zig-zag over a SlotPool (StageSchedule, for a fixed batch, otherwise)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seqs.deferred = True
        self.seqs.fixed_shape = True  # the stages exchange every row of a micro-batch

    def begin_token(self, i: int):
        self.seqs.start_step(i)

    def enter_group(self, i: int, g: int):
        ks, pool = self.groups[g], self.seqs
        if i > 0 and g > 0:  # micro-batch 0's came at the end of the step before
            self._take_tokens(i - 1, g)
        pool.decide(i, ks)
        for k in ks:
            self.steps[k] = pool.step(i, k) if pool.expected(k)[0] else None
            self.refills[k] = pool.refills_of(i, k)
            self.refill_hidden[k] = [None] * len(self.refills[k])
        if self.stage.is_first:
            return
        before, posted = self.stage.rank(self.stage.index - 1), []
        for k in ks:  # the decode's hidden states first, then each prompt step's, as the stage before sent them
            steps = ([(None, self.steps[k])] if self.steps[k] is not None else []) + list(enumerate(self.refills[k]))
            posted += [(k, n, self.link.recv((*step.token_ids.shape, self.hidden_size), self.tiers.dtype, before,
                                             HIDDEN)) for n, step in steps]
        for k, n, received in posted:
            hidden = received.wait().to(self.tiers.compute)
            if n is None:
                self.hidden[k] = hidden
            else:
                self.refill_hidden[k][n] = hidden

    def leave_group(self, i: int, g: int):
        ks = self.groups[g]
        if self.stage.is_last:  # the output layer returned the tokens it chose: [rows, 1], None mid-prompt
            chosen = [(None if self.steps[k] is None else self.hidden[k].view(-1).long().cpu(),
                       [None if t is None else t.view(-1).long().cpu() for t in self.refill_hidden[k]])
                      for k in ks]
            for stage in range(self.stage.count - 1):
                for decode, refills in chosen:
                    for tokens in [decode] + refills:
                        if tokens is not None:
                            self.link.send(tokens, self.stage.rank(stage), TOKENS)
            self.tokens_in[(i, g)] = chosen
            return
        after = self.stage.rank(self.stage.index + 1)
        for k in ks:
            for hidden in ([self.hidden[k]] if self.steps[k] is not None else []) + self.refill_hidden[k]:
                self.link.send(hidden, after, HIDDEN)
        last, posted = self.stage.rank(self.stage.count - 1), []
        for k in ks:
            decodes, starts = self.seqs.expected(k)
            posted.append((self.link.recv((self.b,), torch.long, last, TOKENS) if decodes else None,
                           [self.link.recv((n,), torch.long, last, TOKENS) if n else None for n in starts]))
        self.tokens_in[(i, g)] = posted

    def _take_tokens(self, i: int, g: int):
        def ready(tokens):
            return tokens.wait() if hasattr(tokens, "wait") else tokens
        for k, (decode, refills) in zip(self.groups[g], self.tokens_in.pop((i, g))):
            self.seqs.take(k, ready(decode), [ready(t) for t in refills])

    def end_token(self, i: int) -> bool:
        if not self.stage.is_first:  # the first stage takes them in StageSchedule.end_token, before deciding to stop
            self._take_tokens(i, 0)
        return super().end_token(i)
