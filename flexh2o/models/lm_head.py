"""The LM head's product: each sequence's last hidden state against the whole vocabulary.

x [rows, hidden] @ head[vocab, hidden]^T. On the CPU, with a decode step's few rows, MKL runs
the same product as head @ x^T (turned back) far faster than F.linear's own call: SmolLM2's
head at 32 rows in 40 ms instead of 61, at 2 rows in 15 instead of 43, and its decode step at
batch 32 in 0.274 s instead of 0.298 (results/linear.md). The layers' own matrices are too small
for a gain that holds in the engine, so they keep F.linear.
"""

import torch
import torch.nn.functional as F

from flexh2o.compression.grouped_weight import GroupedWeight
from flexh2o.compression.int4_tiles import TiledWeight
from flexh2o.models.linear import linear

FEW_ROWS = (2, 128)  # the row counts, inclusive, that take the transposed layout on the CPU


def logits(x: torch.Tensor, head) -> torch.Tensor:
    """x [rows, hidden] -> [rows, vocab], in x's dtype (head: a tensor, or a 4-bit weight)."""
    if isinstance(head, (TiledWeight, GroupedWeight)):
        return linear(x, head)
    rows = x.shape[0]
    if x.device.type != "cpu" or not FEW_ROWS[0] <= rows <= FEW_ROWS[1]:
        return F.linear(x, head)
    return torch.mm(head, x.t()).t().contiguous()
