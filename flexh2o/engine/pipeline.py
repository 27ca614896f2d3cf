"""Pipeline parallelism (FlexGen's): each stage holds a contiguous slice of the layers, and the
gpu-batches flow through the stages as micro-batches, so every stage computes while the others do.

Stage s of a replica holds the layers stage_slices gives it: the input embedding on the first,
the LM head on the last, the slices balanced by their weights' bytes, each holding at least one
decoder layer's attention (so there are at most as many stages as decoder layers). Each stage
places its own slice by its own policy and memory caps, and keeps the KV cache of its own layers.
A block's K gpu-batches go through in min(K, stages) micro-batches (groups of neighbouring
gpu-batches): a stage runs the zig-zag over its layers for one micro-batch, hands its hidden
states to the next stage with a non-blocking send, and goes on with the next micro-batch while
the next stage computes; the last stage's sampled tokens go back to the first, which needs them
for the next token step (with refilled slots, stage_refill.py, they go to every stage).
Everything else (KV policies, compression, offloading) runs unchanged inside a stage.

Whether a run stops early (every sequence finished) is decided by the first stage at the end of
each token step, from the tokens it has then received (micro-batch 0's of this step, the others'
of the step before: it never waits for the rest of the step, which would idle it), and passed down
the stages. It may so run one token step more than one process would, which only adds padding
after finished sequences.

The stages talk through torch.distributed's point-to-point sends (stage_link.py).
"""

import datetime
from dataclasses import dataclass

import torch

from flexh2o.common.errors import UsageError
from flexh2o.engine.schedule import Schedule
from flexh2o.engine.stage_link import Link, run_interruptibly
from flexh2o.models.cached_attention import CachedAttention

HIDDEN, TOKENS, CONTROL = 1, 2, 3  # message tags


def check_stage_count(stages: int, spec):
    """Refuses more stages than the model has decoder layers: a stage without one would hold no KV
    cache and pass the hidden states on untouched."""
    if not 1 <= stages <= spec.num_layers:
        raise UsageError("--pipeline-stages", f"must be between 1 and the {spec.num_layers} decoder layers of "
                         f"{spec.name} (each stage holds at least one), got {stages}")


def model_slices(layers, dtype_bytes: int, stages: int) -> list[range]:
    """The stages' slices of a model's layers, by their bytes uncompressed: every stage computes the
    same slices whatever placement or compression each then chooses for its own."""
    from flexh2o.engine.preflight import layer_bytes
    from flexh2o.engine.policy import Policy
    return stage_slices(layer_bytes(layers, dtype_bytes, Policy()), stages,
                        [isinstance(layer, CachedAttention) for layer in layers])


def stage_slices(layer_bytes: list[int], stages: int, needed: list[bool] | None = None) -> list[range]:
    """Contiguous slices of the layers, one per stage, each holding at least one layer that `needed`
    marks (every layer where it is None), the largest slice's bytes as small as can be (the first
    and last layers, the embedding and the LM head, fall to the first and last stages by contiguity).
    Balanced by bytes alone, a large embedding (a tiny model with many positions) would be a stage
    by itself, with no decoder layer."""
    n = len(layer_bytes)
    needed = [True] * n if needed is None else needed
    if not 1 <= stages <= sum(needed):
        raise ValueError(f"{stages} stages for {n} layers, {sum(needed)} of which may hold a stage's work")
    prefix, needed_before = [0], [0]
    for b, m in zip(layer_bytes, needed):
        prefix.append(prefix[-1] + b)
        needed_before.append(needed_before[-1] + bool(m))
    inf = float("inf")
    # best[s][j]: the largest slice of the best split of layers [0, j) into s slices; cut: where the last began
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if needed_before[j] == needed_before[i]:  # no needed layer in [i, j)
                    continue
                worst = max(best[s - 1][i], prefix[j] - prefix[i])
                if worst < best[s][j]:
                    best[s][j], cut[s][j] = worst, i
    bounds, j = [n], n
    for s in range(stages, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def micro_batches(num_gpu_batches: int, stages: int) -> list[range]:
    """The gpu-batches as min(K, stages) groups of neighbours, as even as can be."""
    m = min(num_gpu_batches, stages)
    bounds = [num_gpu_batches * g // m for g in range(m + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class Stage:
    """This process's stage of its replica's pipeline: stage `index` of `count`, whose stage 0 is
    global rank `first_rank`."""
    index: int
    count: int
    first_rank: int
    link: Link
    peers: object = None  # distributed.Peers: the world's store (a planned pipeline's plan goes through it)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def rank(self, stage: int) -> int:
        return self.first_rank + stage


def join_pipeline(world, peers) -> Stage:
    """Joins the world's process group (gloo, over the ranks' store) and returns this rank's stage.
    The joining waits for every rank; it runs on a helper thread, so that another rank's failure
    (peers' watcher) can stop this one meanwhile."""
    import torch.distributed as dist

    def join():
        # No time limit: liveness is the watcher's (distributed.py), and a receive may rightly wait
        # for a whole prompt step of the stages before.
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", peers.base), rank=world.rank,
                                world_size=world.size, timeout=datetime.timedelta(days=1))
    try:
        run_interruptibly(join)
    except RuntimeError as e:
        reason = str(e).splitlines()[0].rsplit("] ", 1)[-1][:200]
        raise UsageError("--pipeline-stages", f"the stages could not connect over gloo ({reason}); across machines, "
                         "set GLOO_SOCKET_IFNAME to the network interface they share") from None
    return Stage(world.stage, world.stages, world.rank - world.stage, Link(), peers)


class StageSchedule(Schedule):
    """The zig-zag of one stage over its layers, micro-batch by micro-batch, its inputs received from
    the stage before and its outputs sent to the one after."""

    def __init__(self, layers, sequences, num_gpu_batches, tiers, act_tier, stage: Stage, gpu_batch_size: int,
                 hidden_size: int, prompt_len: int):
        super().__init__(layers, sequences, num_gpu_batches, tiers, act_tier,
                         groups=micro_batches(num_gpu_batches, stage.count))
        self.stage, self.link = stage, stage.link
        self.b, self.hidden_size, self.prompt_len = gpu_batch_size, hidden_size, prompt_len
        self.hidden_in = {}  # (i, g) -> the posted receives of its gpu-batches' hidden states
        self.tokens_in = {}  # (i, g) -> the posted receives of its gpu-batches' tokens (first stage)

    def _post_hidden(self, i: int, g: int):
        if self.stage.is_first or (i, g) in self.hidden_in or g >= len(self.groups) or i >= self.gen_len:
            return
        n = self.prompt_len if i == 0 else 1
        self.hidden_in[(i, g)] = [self.link.recv((self.b, n, self.hidden_size), self.tiers.dtype,
                                                 self.stage.rank(self.stage.index - 1), HIDDEN)
                                  for _ in self.groups[g]]

    def _take_tokens(self, i: int, g: int):
        for k, received in zip(self.groups[g], self.tokens_in.pop((i, g))):
            self.seqs.accept(i, k, received.wait())

    def begin_token(self, i: int):
        self.seqs.begin(i)
        self._post_hidden(i, 0)

    def enter_group(self, i: int, g: int):
        ks = self.groups[g]
        if self.stage.is_first:
            if i > 0 and g > 0:  # micro-batch 0's came at the end of the step before
                self._take_tokens(i - 1, g)
        else:
            self._post_hidden(i, g + 1)  # the next micro-batch's come while this one computes
            for k, received in zip(ks, self.hidden_in.pop((i, g))):
                self.hidden[k] = received.wait().to(self.tiers.compute)
        for k in ks:
            self.steps[k] = self.seqs.step(i, k)

    def leave_group(self, i: int, g: int):
        ks = self.groups[g]
        if self.stage.is_last:
            for k in ks:  # the output layer returned the tokens it chose: [b, 1]
                self.link.send(self.hidden[k].view(-1).long(), self.stage.rank(0), TOKENS)
            return
        for k in ks:
            self.link.send(self.hidden[k], self.stage.rank(self.stage.index + 1), HIDDEN)
        if self.stage.is_first:
            last = self.stage.rank(self.stage.count - 1)
            self.tokens_in[(i, g)] = [self.link.recv((self.b,), torch.long, last, TOKENS) for _ in ks]

    def end_token(self, i: int) -> bool:
        if self.stage.is_first:
            self._take_tokens(i, 0)
            stop = self.seqs.all_finished()  # micro-batch 0 as of this step, the others as of the one before
            if stop:
                for g in range(1, len(self.groups)):
                    self._take_tokens(i, g)
            control = torch.tensor([int(stop)])
        else:
            control = self.link.recv((1,), torch.long, self.stage.rank(self.stage.index - 1), CONTROL).wait()
        if not self.stage.is_last:
            self.link.send(control, self.stage.rank(self.stage.index + 1), CONTROL)
        return bool(control.item())

    def finish(self, steps_done: int):
        for i, g in sorted(self.tokens_in):
            self._take_tokens(i, g)
        self.link.close()
