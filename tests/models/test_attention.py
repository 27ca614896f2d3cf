"""The observed prompt attention (the one an evicting policy watches) in float16, as on a GPU."""

import torch

from flexh2o.models.attention import prompt_attention_observed


def test_observed_prompt_attention_does_not_overflow_in_float16():
    # q.k = 64 x 40 x 40 = 102,400 is past float16's 65,504; scaled first it is 12,800.
    q = torch.full((1, 2, 4, 64), 40.0)
    k = torch.full((1, 2, 4, 64), 40.0)
    v = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(0))
    real = torch.ones(1, 4, dtype=torch.bool)

    def run(dtype):
        return prompt_attention_observed(q.to(dtype), k.to(dtype), v.to(dtype), None, real, 64 ** -0.5,
                                         lambda logits, probs, rows, at: (probs * rows).sum(-2))
    out, seen = run(torch.float16)
    exact_out, exact_seen = run(torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(seen).all()
    assert torch.allclose(out.float(), exact_out, atol=1e-2) and torch.allclose(seen, exact_seen, atol=1e-3)
