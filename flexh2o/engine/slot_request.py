"""A request of a slot pool (slot_pool.py): its prompt's token ids and how many tokens it may
generate, and what it may bring besides: its sampling seed and sampler, a stop check, the
log-probabilities it wants recorded, a function told of each token as it is chosen (streaming),
and a flag another thread sets to cancel it."""

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(eq=False)  # each request is itself: hashed and compared by identity
class Request:
    ids: list                           # the prompt's token ids
    max_new_tokens: int
    seed: int | None = None             # the seed of this sequence's sampling generator
    stop_check: Callable | None = None  # (its new tokens, a CPU tensor) -> whether they end it (stop strings)
    tag: object = None                  # the caller's, handed back with the result
    sampler: object = None              # its own Sampler (temperature, top-k, top-p); None: the pool's
    logprobs: int | None = None         # record each chosen token's log-probability, with this many alternatives
    prompt_logprobs: int | None = None  # and each prompt token's after the first (echo)
    on_token: Callable | None = None    # on_token(request, token) as each token is chosen (streaming)
    cancelled: bool = False             # set from any thread: it leaves its row at the next token step
    token_scores: list = field(default_factory=list)   # logprobs.scores' entries, one per chosen token
    prompt_scores: list = field(default_factory=list)  # and one per prompt token after the first


def seeds_of(requests: list) -> torch.Tensor:
    """The requests' seeds (0 for none), as Step.row_seeds."""
    return torch.tensor([r.seed or 0 for r in requests], dtype=torch.long)
