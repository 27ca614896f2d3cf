"""The zig-zag block schedule (FlexGen): for each token i, each layer j, each gpu-batch k.

A layer's weights are loaded once per token and used by every gpu-batch of the block. While
(j, k) computes, the weights of layer j+1 and the cache and hidden state of (j, k+1) load, and the
cache and hidden state of (j, k-1) store; the input embedding, which only looks rows up, computes
before its loads are queued, and the two layers after it load while the token step's last layer
computes (load_weight). The layers and tiers do the work; this only orders it.
"""

import time

from flexh2o.common.messages import progress_bar
from flexh2o.engine import cpu_decode, decode_graphs
from flexh2o.offload.held_weights import loaded_with

# Token steps whose own figures (seconds, I/O tasks, allocations...) are kept; the seconds of every
# step are summed. A server's run lasts as long as the server, and its lists would grow for ever.
KEPT_STEPS = 1 << 16


class Schedule:
    """The zig-zag over `layers` for every gpu-batch. `groups`: the gpu-batches as groups that go
    through the layers one after another (a pipeline stage's micro-batches, pipeline.py); by
    default one group of all, the plain zig-zag. A token step's (layer, gpu-batch) units run group
    by group, each group layer by layer, each layer gpu-batch by gpu-batch; a layer's weights load
    once per visit (a group's pass through it)."""

    def __init__(self, layers, sequences, num_gpu_batches, tiers, act_tier="gpu", groups=None):
        self.layers, self.seqs, self.tiers = layers, sequences, tiers
        self.num_gpu_batches = num_gpu_batches
        self.groups = groups or [range(num_gpu_batches)]
        self.group_of = {k: g for g, group in enumerate(self.groups) for k in group}
        self.units = [(j, k) for group in self.groups for j in range(len(layers)) for k in group]
        # With one gpu-batch the next compute needs the hidden state just made: nothing to overlap
        # its move with, so it stays on the compute device.
        self.act_tier = act_tier if num_gpu_batches > 1 else "gpu"
        tiers.parked_slots = num_gpu_batches
        self.hidden = [None] * num_gpu_batches
        self.steps = [None] * num_gpu_batches
        # Where slots are refilled (slot_pool.py): each gpu-batch's prompt steps of the sequences
        # joining at this token step, and their hidden states, computed right after the gpu-batch's
        # decode on the same weights; a gpu-batch with no running sequence has no decode step (None).
        self.refills = [[] for _ in range(num_gpu_batches)]
        self.refill_hidden = [[] for _ in range(num_gpu_batches)]
        self.loaded_early = []  # layers whose loads were queued ahead of their turn (load_weight)
        self.step_seconds = []
        self.step_io_tasks = []  # I/O tasks queued during each token step (none with everything on the device)
        self.step_handoffs = []  # hand-offs to the I/O threads during each token step
        self.step_allocations = []  # tensors allocated during each token step (none after the first decode step)
        self.step_dequant_seconds = []  # time spent dequantizing during each token step (summed over threads)
        self.step_h2d_bytes = []  # bytes copied to the compute device during each token step
        self.per_step = (self.step_io_tasks, self.step_handoffs, self.step_allocations, self.step_dequant_seconds,
                         self.step_h2d_bytes)
        self.whole_steps = None  # runs decode steps whole, where they can be (use_whole_steps)
        self.finish_seconds = 0.0  # after the last token step, until its cache stores are done
        self.compute_seconds = 0.0  # forward passes only, without waiting for their inputs
        self.prefill_seconds = self.decode_seconds = 0.0  # the first token step's, and the others' summed

    def use_whole_steps(self):
        """Decode steps whole (whole_token), where every weight and cache slot stays in place: on CUDA
        as CUDA graphs from the second on (decode_graphs.why_not), on the CPU each run of Llama layers
        in one C call (cpu_decode.why_not)."""
        if decode_graphs.why_not(self) is None:
            self.whole_steps = decode_graphs.DecodeGraphs(self.layers, self.seqs)
            self.seqs.fixed_shape = True  # a graph replays one shape: every row of the gpu-batch
        elif cpu_decode.why_not(self) is None:
            self.whole_steps = cpu_decode.CPUDecode(self)

    def run(self, gen_len: int, progress: bool = False) -> int:
        """Generates up to gen_len tokens; returns how many token steps ran (fewer when all hit EOS)."""
        per_token = len(self.units)
        self.gen_len = gen_len
        self.load_weight(0)
        self.load_cache(0)
        steps_done = gen_len
        # The bar counts token steps of the whole batch, so its rate is steps/s, not tokens/s. It is
        # closed on the way out of an error too: an error's line must not run on from it.
        with progress_bar(total=gen_len, desc="generate", unit="step", disable=not progress, leave=False) as bar:
            for i in range(gen_len):
                start, counts = time.perf_counter(), self.counts()
                self.begin_token(i)
                if self.whole_steps is not None and self.whole_steps.takes(i):
                    self.whole_token(i)
                else:
                    self.token(i, bar)
                if i == 0:
                    bar.set_postfix_str("", refresh=False)
                stop = self.end_token(i)
                seconds = time.perf_counter() - start
                if i == 0:
                    self.prefill_seconds = seconds
                else:
                    self.decode_seconds += seconds
                if i < KEPT_STEPS:
                    self.step_seconds.append(seconds)
                    for per_step, before, now in zip(self.per_step, counts, self.counts()):
                        per_step.append(now - before)
                bar.update(1)
                if stop:
                    self.layers[0].release_weight()  # the next token's first weights may be loading
                    for layer in self.loaded_early:
                        layer.release_weight()
                    steps_done = i + 1
                    break
        start = time.perf_counter()
        self.store_cache(steps_done * per_token - 1)  # the last (layer, gpu-batch)'s cache
        self.sync()
        for layer in self.layers:
            layer.wait_stores()
        self.finish(steps_done)
        self.finish_seconds = time.perf_counter() - start
        return steps_done

    def token(self, i: int, bar):
        """Token step i, unit by unit."""
        num_layers, per_token = len(self.layers), len(self.units)
        for u, (j, k) in enumerate(self.units):
            t = i * per_token + u
            group = self.groups[self.group_of[k]]
            if j == 0 and k == group[0]:
                self.enter_group(i, self.group_of[k])
            if i == 0 and k == group[0]:  # the prompt step can take minutes: it moves per layer
                bar.set_postfix_str(f"prompt: layer {j + 1}/{num_layers}")
            # A layer that only looks rows up (an input embedding) computes before the next
            # loads are queued: its reads are a few kilobytes, and queued behind the next layer's
            # megabytes (the device serves them in order) each took ~10 ms instead of ~0.2.
            lookup_first = self.layers[j].looks_up_only
            if lookup_first:
                self.compute(t)
            # No synchronize per (layer, gpu-batch): on CUDA every copy waits for an event of
            # the compute queued before it (cuda_io.py). A store goes first: the load after it
            # takes the KV buffer set that the store queued one step earlier gives back, and
            # the I/O threads take tasks oldest first.
            with self.tiers.io_group():  # one hand-off to the I/O threads at most
                self.store_cache(t - 1)
                if k == group[0]:  # the next visit's weights load while this visit's first gpu-batch computes
                    self.load_weight(t + len(group))
                self.load_cache(t + 1)
                self.store_hidden(t - 1, i)
                self.load_hidden(t + 1, i)
            if not lookup_first:
                self.compute(t)
            if j == num_layers - 1 and k == group[-1]:
                self.leave_group(i, self.group_of[k])

    def whole_token(self, i: int):
        """Token step i with every layer at once per gpu-batch (a CUDA graph, decode_graphs.py, or
        cpu_decode.py); the prompts of sequences joining the gpu-batch then run layer by layer as usual.
        Weights and cache are all in place: the loads and stores around the step only hand the
        same tensors over, in the order `token` leaves them (the next token's first weights and
        cache loaded, this token's last cache not yet stored)."""
        per_token, n = len(self.units), self.num_gpu_batches
        first = i * per_token
        self.store_cache(first - 1)
        for u in range(1, per_token):
            self.load_cache(first + u)
        for j in range(1, len(self.layers)):
            self.load_weight(first + j * n)
        for k in range(n):
            for layer in self.layers:
                layer.wait_inputs(k)
            start = time.perf_counter()
            if self.steps[k] is not None:
                self.hidden[k] = self.whole_steps.run(i, k, self.steps[k], self.hidden[k])
            for step in self.refills[k]:  # joining prompts, after the decode's writes to their rows
                hidden = None
                for layer in self.layers:
                    hidden = layer.forward(hidden, step)
            self.compute_seconds += time.perf_counter() - start
        for layer in self.layers:
            layer.release_weight()
        for u in range(per_token - 1):
            self.store_cache(first + u)
        self.load_cache(first + per_token)
        self.load_weight(first + per_token)

    # What a pipeline stage adds (pipeline.py); here, one process runs every layer.
    def begin_token(self, i: int):
        self.steps = self.seqs.steps(i, self.num_gpu_batches, device_counters=self.tiers.on_cuda)
        self.refills = self.seqs.refill_steps(i, self.num_gpu_batches)
        self.refill_hidden = [[None] * len(steps) for steps in self.refills]

    def enter_group(self, i: int, g: int):
        """Before group g of token step i reaches the first layer."""

    def leave_group(self, i: int, g: int):
        """After group g of token step i left the last layer."""

    def end_token(self, i: int) -> bool:
        """Whether generation stops after token step i."""
        return self.seqs.all_finished()

    def finish(self, steps_done: int):
        """After the last token step."""

    def counts(self) -> tuple:
        """Running totals kept per token step: I/O tasks, hand-offs, allocations, dequantizing seconds,
        bytes copied to the compute device."""
        t = self.tiers
        return t.io_tasks, t.handoffs, t.allocations, t.dequant_seconds, t.h2d_bytes

    def _at(self, t: int):
        """(i, j, k) of unit t in the run's order (token steps one after another); None past the ends."""
        i, u = divmod(t, len(self.units))
        return (i, *self.units[u]) if t >= 0 and i < self.gen_len else None

    def load_weight(self, t: int):
        """The weights of the layer visit that starts at unit t."""
        at = self._at(t)
        if not at:
            return
        layer = self.layers[at[1]]
        if layer in self.loaded_early:
            self.loaded_early.remove(layer)
            return
        layer.load_weight(0)
        for ahead in loaded_with(self.layers, at[1]):
            self.layers[ahead].load_weight(0)
            self.loaded_early.append(self.layers[ahead])

    def load_cache(self, t: int):
        if at := self._at(t):
            self.layers[at[1]].load_cache(at[0], at[2])

    def store_cache(self, t: int):
        """Stores the cache of unit t; the last unit of a token goes with the next token's first, or
        once the run ends."""
        if at := self._at(t):
            self.layers[at[1]].store_cache(at[0], at[2])

    def load_hidden(self, t: int, i: int):
        at = self._at(t)
        if self.act_tier != "gpu" and at and at[0] == i and at[1] > 0 and self.steps[at[2]] is not None:
            self.hidden[at[2]] = self.tiers.load_act(self.hidden[at[2]])

    def store_hidden(self, t: int, i: int):
        at = self._at(t)
        if self.act_tier != "gpu" and at and at[0] == i and at[1] < len(self.layers) - 1 and \
                self.steps[at[2]] is not None:
            self.hidden[at[2]] = self.tiers.store_act(self.hidden[at[2]])

    def compute(self, t: int):
        i, j, k = self._at(t)
        layer, hidden = self.layers[j], self.hidden[k]
        hidden = hidden.wait() if hasattr(hidden, "wait") else hidden
        layer.wait_inputs(k)
        start = time.perf_counter()
        if self.steps[k] is not None:
            self.hidden[k] = layer.forward(hidden, self.steps[k])
        for n, step in enumerate(self.refills[k]):  # joining sequences' prompts; their hidden states stay on the device
            self.refill_hidden[k][n] = layer.forward(self.refill_hidden[k][n], step)
        self.compute_seconds += time.perf_counter() - start
        if k == self.groups[self.group_of[k]][-1]:
            layer.release_weight()

    def sync(self):
        self.tiers.sync()
