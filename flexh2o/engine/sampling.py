"""Next-token choice: greedy, or sampling with temperature, top-k and top-p.

Sampling draws one uniform number per sequence per token for the whole batch at once and picks by
inverse CDF, so a seed gives the same tokens however the batch is split into gpu-batches. With a
seed per sequence (`row_seeds`, a dataset job's records), each draws from its own generator, so a
record's tokens do not depend on which others share its block.
"""

import math

import torch

from flexh2o.common.errors import UsageError


MAX_SEED = (1 << 63) - 1  # torch generators take 64-bit seeds


def check_seed(seed: int):
    if not 0 <= seed <= MAX_SEED:
        raise UsageError("--seed", f"must be within 0..{MAX_SEED}, got {seed}")


def check_sampling(temperature: float, top_k: int, top_p: float):
    if not 0 < temperature < math.inf:
        raise UsageError("--temperature", f"must be a finite number > 0, got {temperature}")
    if top_k < 0:
        raise UsageError("--top-k", f"must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise UsageError("--top-p", f"must be within (0, 1], got {top_p}")


class Sampler:
    def __init__(self, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, row_seeds: list | None = None):
        check_sampling(temperature, top_k, top_p)
        self.do_sample = do_sample
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        # A temperature that is 0 in float32 is the limit of sampling: greedy.
        self.greedy = not do_sample or float(torch.tensor(temperature, dtype=torch.float32)) == 0
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            check_seed(seed)
            self.generator.manual_seed(seed)
        self.row_generators, self.row_seeds = None, row_seeds
        if row_seeds is not None:
            for s in row_seeds:
                check_seed(s)
            self.row_generators = [torch.Generator().manual_seed(s) for s in row_seeds]

    def uniforms(self, batch: int) -> torch.Tensor | None:
        """The random numbers of one token step, one per sequence (None when greedy)."""
        if not self.do_sample:
            return None
        if self.row_generators is not None:
            return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.row_generators])
        return torch.rand(batch, generator=self.generator, dtype=torch.float64)

    def pick(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        """logits [b, vocab] (float32) -> token ids [b]."""
        if self.greedy:
            return logits.argmax(dim=-1)
        # Relative to the largest logit first: each scaled logit is then <= 0 and cannot overflow to
        # inf (and a NaN distribution) however small the temperature.
        logits = logits.float()
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            values, index = logits.topk(self.top_k, dim=-1)
        else:
            values, index = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(values, dim=-1, dtype=torch.float64)
        if self.top_p < 1:
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= self.top_p, 0)  # the first token always stays
        cdf = probs.cumsum(dim=-1)
        target = (uniforms * cdf[:, -1]).unsqueeze(1)
        choice = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[-1] - 1)
        return index.gather(1, choice).squeeze(1)
