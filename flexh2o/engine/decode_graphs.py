"""CUDA graphs of decode steps whose weights and KV cache all sit on the GPU.

A decode step of a model that fits the GPU is bound by launching its kernels, not by the GPU
(OPT-6.7B at batch 32 on an H200: about 490 kernels a step, 10.9 ms where its bytes take 4.5).
Every decode step runs the same kernels on the same memory on CUDA (attention over the cache's
fixed capacity; the slot, positions and tokens read from device tensors: sequences.Step), so one
gpu-batch's step, every layer and the pick of the next tokens, is captured once and replayed.
The host's part of a step stays outside the graph: copying the step's tokens, positions, slot
and random numbers into the graph's input tensors before the replay, and recording the tokens
picked after it (Sequences.chosen: kept scores, teacher forcing, end of sequence, stop strings).

The first decode step runs as usual and warms up what a capture may not create (library handles,
workspaces); the graphs are captured at the second and replayed from then on. A capture runs
nothing: the step it captures is then replayed. One that fails (an op a graph cannot hold, or
no memory left for the graph's own) says so in one line on stderr, and the run goes on without
graphs from that step on. FLEXH2O_CUDA_GRAPHS=0 turns graphs off.
"""

import dataclasses
import os

import torch

from flexh2o.common.messages import say
from flexh2o.engine import in_place


def why_not(schedule) -> str | None:
    """Why the schedule's decode steps cannot be captured (None: they can)."""
    if not schedule.tiers.on_cuda:
        return "not on CUDA"
    if os.environ.get("FLEXH2O_CUDA_GRAPHS", "1") == "0":
        return "FLEXH2O_CUDA_GRAPHS=0"
    reason = in_place.why_not(schedule)
    if reason is not None:
        return reason
    for layer in schedule.layers:
        if not all(schedule.tiers.used_in_place(h) for h in layer.home[:layer.gathered]):
            return "weights are loaded anew each step (streamed, or compressed)"  # rows looked up on the host
        kv = getattr(layer, "kv", None)
        if kv is not None and kv.name == "keyformer":
            return "Keyformer's temperature and noise keys are set per step from host numbers"
    return None


# The step's device tensors a replay reads: copied into the graph's own before each replay (slot:
# the full cache's shared slot of a fixed batch; row_slots: each row's own, where slots are refilled).
INPUTS = ("token_ids", "positions", "slot", "before", "row_slots")


class DecodeGraphs:
    """One graph per gpu-batch, captured at decode step `first` and replayed after it."""

    first = 2

    def __init__(self, layers, seqs):
        self.layers, self.seqs = layers, seqs
        self.graphs = {}  # k -> (graph, its step, its random numbers, its outputs)
        self.pool = None  # the memory pool the graphs share (they never run at once)
        self.broken = False

    def takes(self, i: int) -> bool:
        """Whether token step i runs as graphs (schedule.whole_token)."""
        return not self.broken and i >= self.first

    def run(self, i: int, k: int, step, hidden):
        """Gpu-batch k's token step i: replayed (captured first if need be), or run as usual where
        the capture failed. Returns the next tokens [b, 1] on the device."""
        if k not in self.graphs and not self.broken:
            self._capture(k, step)
        if self.broken:
            for layer in self.layers:
                hidden = layer.forward(hidden, step)
            return hidden
        graph, static, uniforms, out = self.graphs[k]
        self._set_inputs(static, uniforms, step, k)
        graph.replay()
        return self.seqs.chosen(i, k, out["logits"], out["picked"])

    def _set_inputs(self, static, uniforms, step, k: int):
        for name in INPUTS:
            if getattr(static, name) is not None:
                getattr(static, name).copy_(getattr(step, name))
        if uniforms is not None:
            uniforms.copy_(self.seqs.uniforms_of(k))

    def _capture(self, k: int, step):
        out = {}
        uniforms = self.seqs.uniforms_of(k)
        uniforms = None if uniforms is None else uniforms.to(step.token_ids.device)

        def choose(logits):
            out["logits"], out["picked"] = logits, self.seqs.pick(logits, uniforms)
            return logits
        inputs = {name: getattr(step, name).clone() for name in INPUTS if getattr(step, name) is not None}
        static = dataclasses.replace(step, **inputs, choose_next=choose, memo={})
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a CUDA call of another thread (an I/O thread) does not end the capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                hidden = None
                for layer in self.layers:
                    hidden = layer.forward(hidden, static)
        except Exception as e:  # noqa: BLE001 - any failure to capture only means running without graphs
            self.broken = True
            self.graphs.clear()
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            say(f"flexh2o: CUDA graph capture failed ({reason}); decoding without graphs")
            return
        self.pool = graph.pool()
        self.graphs[k] = (graph, static, uniforms, out)
