"""The log-probabilities a sequence may ask for: of each token it chose, and of each token of its
prompt after the first (an OpenAI request's `logprobs` and `echo`), each with the likeliest
tokens beside it. They come from the logits as the model gives them, before any temperature or
top-k/top-p, in float64 as teacher forcing computes them (sequences.py)."""

import torch

PROMPT_POSITIONS_AT_ONCE = 128  # prompt positions whose logits are made at once ([vocab] each)


def scores(logits: torch.Tensor, tokens: torch.Tensor, alternatives: int) -> list[tuple]:
    """For each row of logits [n, vocab] and the token tokens [n] that followed it: (its
    log-probability, ((id, log-probability), ...) of the `alternatives` likeliest tokens)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
    if not alternatives:
        return [(c, ()) for c in chosen]
    values, ids = logprobs.topk(min(alternatives, logprobs.shape[-1]), dim=-1)
    return [(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def prompt_scores(hidden: torch.Tensor, head, following: list[int], alternatives: int) -> list[tuple]:
    """scores() of consecutive prompt positions, hidden [n, hidden] at the output layer, each
    followed by the token of `following` [n]; head(h) gives the logits of hidden states h.
    A few positions at a time, so that a long prompt's [positions, vocab] logits never exist at once."""
    out = []
    for start in range(0, len(following), PROMPT_POSITIONS_AT_ONCE):
        stop = min(start + PROMPT_POSITIONS_AT_ONCE, len(following))
        out += scores(head(hidden[start:stop]), torch.tensor(following[start:stop]), alternatives)
    return out
