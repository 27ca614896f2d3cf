"""Decode steps on the CPU whose weights and KV cache all stay in place (in_place.py): every layer
back to back, each run of whole Llama layers in one C call (models/llama_decode.LayersInOneCall).

With one call per half of a layer, SmolLM2-135M's step at batch 1 still spent about a fifth of its
time in Python: each layer's turn in the schedule (its loads and stores queued, its weights
released) and each half's checks before its call. Where nothing moves, the loads and stores only
hand the same tensors over, so the schedule does them for the whole step at once
(schedule.whole_token) and the layers run here. A weight multiplied as stored that a step of many
rows widens (linear.py) takes a buffer of the pool until the step ends, for every layer at once
here; the pool holds a few (offload/buffers.py), so a step that would widen one runs unit by unit.
"""

from flexh2o import native
from flexh2o.engine import in_place
from flexh2o.models.linear import never_widened
from flexh2o.models.llama_decode import one_call_runs


def why_not(schedule) -> str | None:
    """Why the schedule's decode steps cannot run here (None: they can)."""
    if schedule.tiers.on_cuda:
        return "on CUDA"
    return in_place.why_not(schedule)


class CPUDecode:
    """A decode step's layers, one after another, with each run of Llama layers in one C call where
    the step allows it (LayersInOneCall.step), layer by layer otherwise."""

    def __init__(self, schedule):
        self.schedule, self.layers = schedule, schedule.layers
        self.runs = one_call_runs(self.layers, native.library())
        self.unwidened = {}  # rows -> whether no layer's weight widens at that row count

    def takes(self, i: int) -> bool:
        """Whether token step i runs here: a decode step whose steps (each gpu-batch's, and the
        prompts of sequences joining) widen no weight."""
        if i < 1:
            return False
        steps = [step for step in self.schedule.steps if step is not None]
        steps += [step for refills in self.schedule.refills for step in refills]
        return all(self._unwidened(step.token_ids.numel()) for step in steps)

    def _unwidened(self, rows: int) -> bool:
        if rows not in self.unwidened:
            self.unwidened[rows] = all(never_widened(weight, rows) for layer in self.layers for weight in layer.weights_kept)
        return self.unwidened[rows]

    def run(self, i: int, k: int, step, hidden):
        """Gpu-batch k's token step i; returns what the last layer returns (the next tokens)."""
        j = 0
        while j < len(self.layers):
            run = self.runs.get(j)
            if run is not None and run[1].step(hidden, step):
                j = run[0]
                continue
            hidden = self.layers[j].forward(hidden, step)
            j += 1
        return hidden
