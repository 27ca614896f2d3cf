"""Keyformer (Adnan et al. 2024): H2O's accumulation with a noisy score. Each step adds the
softmax of (attention logits + Gumbel noise) / tau, with tau rising linearly from 1 at the prompt
to 2 at the last generated token. The attention output itself uses the clean probabilities."""

import torch

from flexh2o.kv.eviction import Evicting


class Keyformer(Evicting):
    name = "keyformer"
    accumulates = True

    def __init__(self, capacity: int, recent: int, gen_len: int, seed: int, ratios: tuple | None = None):
        super().__init__(capacity, recent, gen_len, seed, ratios)
        self.generators = {}  # device -> its generator, seeded once and advancing with every draw

    def generator(self, device: torch.device) -> torch.Generator:
        """One generator per device: a split cache attends on two devices in turn, and seeding
        again at each switch would give every step the same noise."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[device]

    def temperature(self, i: int) -> float:
        return 1.0 + i / max(self.gen_len - 1, 1)

    def contribution(self, logits, probs, real_rows, step):
        u = torch.rand(logits.shape, generator=self.generator(logits.device), device=logits.device,
                       dtype=torch.float32)
        exponential = torch.log(u.clamp_(min=1e-20)).neg_().clamp_(min=1e-20)
        gumbel = torch.log(exponential).neg_()
        noisy = torch.softmax((logits.float() + gumbel) / self.temperature(step.i), dim=-1)
        return (noisy if real_rows is None else noisy * real_rows).sum(-2)

    def priority(self, pos, score, current):
        return score
