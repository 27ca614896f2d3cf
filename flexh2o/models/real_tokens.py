"""A padded prompt step's real tokens: the token-wise work of a layer runs on them alone.

A block pads each prompt on the left to its longest one. The attention needs that [b, n] grid;
the norms, projections and MLP work token by token, so on a prompt step with enough padding a
layer gathers the real tokens into [tokens, d] rows, runs its products on those rows, and puts
the results back. Padding positions then hold zeros (their keys are masked out, their outputs
never read) where they held a pad token's values.
"""

import torch

MIN_PADDING = 1 / 16  # below this share of padding the copies in and out eat most of the saving


class RealTokens:
    """index: the real tokens' positions in the step's flattened [b * n] grid; None: all of them."""

    def __init__(self, index: torch.Tensor | None):
        self.index = index

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[b, n, d] -> [tokens, d] (unchanged when every position is real)."""
        return x if self.index is None else x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def scatter(self, rows: torch.Tensor, b: int, n: int) -> torch.Tensor:
        """[tokens, d] -> [b, n, d], zeros at padding."""
        if self.index is None:
            return rows
        grid = rows.new_zeros(b * n, rows.shape[-1])
        return grid.index_copy_(0, self.index, rows).view(b, n, -1)

    def add_into(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden [b, n, d] += rows at the real tokens, in place; returns hidden."""
        if self.index is None:
            return hidden.add_(rows)
        hidden.view(-1, hidden.shape[-1]).index_add_(0, self.index, rows)
        return hidden


def real_tokens(step) -> RealTokens:
    """The step's real tokens, found once per step (every layer shares them)."""
    if "real_tokens" not in step.memo:
        index = None
        if step.prefill and step.padded:
            valid = step.key_valid.reshape(-1)
            if 1 - valid.float().mean().item() >= MIN_PADDING:
                index = valid.nonzero().squeeze(1)
        step.memo["real_tokens"] = RealTokens(index)
    return step.memo["real_tokens"]
