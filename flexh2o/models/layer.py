"""The interface every layer offers the schedule (DESIGN.md, 'The layer interface').

The schedule drives input embedding, attention, MLP and output embedding through the same five
operations and never asks what kind of layer it holds.
"""

import torch


class Layer:
    """Base class: weights listed by checkpoint name, placed once, loaded per token step."""

    def weight_specs(self) -> list[tuple[str, tuple]]:
        """(checkpoint name, shape) of every weight this layer reads, in forward's order."""
        raise NotImplementedError

    def prepare(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Turns checkpoint tensors into the ones forward uses (e.g. fusing q/k/v)."""
        return tensors

    def init_weight(self, source, tiers):
        """Reads this layer's weights from `source` and places them at their home tiers."""
        self.tiers = tiers
        tensors = [source.get(name, shape) for name, shape in self.weight_specs()]
        self.home = [tiers.place_weight(t) for t in self.prepare(tensors)]
        self.weights = None

    def load_weight(self, k: int):
        """Starts bringing the weights to the compute device; once per token, at gpu-batch 0."""
        if k == 0:
            self.weights = [self.tiers.load(h) for h in self.home]

    def init_cache(self, batch_sizes: list[int], capacity: int):
        """Allocates per-gpu-batch KV cache slots (attention layers only)."""

    def free_cache(self):
        pass

    def load_cache(self, i: int, k: int):
        pass

    def store_cache(self, i: int, k: int):
        pass

    def forward(self, hidden, step):
        raise NotImplementedError
