"""native/layer_ops.c: a Llama layer's RMSNorm, rotary turn and SiLU(gate) * up in one call each.
The turn is bit-equal to torch's; RMSNorm and SiLU within float32 rounding of transformers'; every
row's result the same alone as among others and on one thread as on two; without kernels (lib
None, as on CUDA) torch's operations run."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from flexh2o import native
from flexh2o.models import layer_ops

lib = native.library()
needs_kernels = pytest.mark.skipif(lib is None, reason="no C compiler: the kernels cannot be built here")


def values(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@needs_kernels
@pytest.mark.parametrize("b,n", [(1, 1), (3, 1), (2, 9)])
def test_the_rotary_turn_is_bit_equal_to_torchs(b, n):
    heads, kv_heads, d = 9, 3, 64
    qkv = values(b, n, (heads + 2 * kv_heads) * d)
    cos, sin = values(b, 1, n, d, seed=1).cos(), values(b, 1, n, d, seed=2).sin()
    by_torch = layer_ops.rotate_heads(qkv.clone(), heads + kv_heads, d, cos, sin)
    turned = qkv.clone()
    ours = layer_ops.rotate_heads(turned, heads + kv_heads, d, cos, sin, lib)
    assert torch.equal(ours, by_torch)
    assert torch.equal(turned[..., (heads + kv_heads) * d:], qkv[..., (heads + kv_heads) * d:])  # v left alone


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 3, 64), (5, 20)])
def test_rms_norm_within_float32_rounding_of_transformers(shape):
    x, weight = values(*shape), values(shape[-1], seed=1)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        want = norm(x)
    ours = layer_ops.rms_norm(x, weight, 1e-5, lib)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours, want, atol=0, rtol=4e-7 * 4)
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (shape[-1],), weight, 1e-5))


@needs_kernels
def test_silu_times_up_within_float32_rounding_of_torch():
    gate_up = values(2, 3, 2 * 1536)
    gate, up = gate_up.chunk(2, dim=-1)
    ours = layer_ops.silu_times_up(gate_up, lib)
    assert ours.shape == (2, 3, 1536)
    torch.testing.assert_close(ours, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    assert torch.equal(layer_ops.silu_times_up(gate_up), F.silu(gate) * up)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_is_the_same_alone_as_among_others(threads, monkeypatch):
    """Enough rows for the kernels to split them over threads (a prompt's), each row alone (a decode step's)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, weight, gate_up = values(300, 576), values(576, seed=1), values(100, 2 * 768, seed=2)
    normed, activated = layer_ops.rms_norm(x, weight, 1e-5, lib), layer_ops.silu_times_up(gate_up, lib)
    for r in (0, 137, 299):
        assert torch.equal(layer_ops.rms_norm(x[r:r + 1], weight, 1e-5, lib), normed[r:r + 1])
    for r in (0, 99):
        assert torch.equal(layer_ops.silu_times_up(gate_up[r:r + 1], lib), activated[r:r + 1])
    qkv = values(300, 1, 4 * 64, seed=3)
    cos, sin = values(300, 1, 1, 64, seed=4), values(300, 1, 1, 64, seed=5)
    turned = layer_ops.rotate_heads(qkv.clone(), 3, 64, cos, sin, lib)
    alone = layer_ops.rotate_heads(qkv[137:138].clone(), 3, 64, cos[137:138], sin[137:138], lib)
    assert torch.equal(alone, turned[137:138])


def test_other_widths_take_torchs_operations():
    """bfloat16 and tensors that are not contiguous are not handed to the kernels."""
    x, weight = values(3, 64).bfloat16(), values(64, seed=1).bfloat16()
    want = weight * F.rms_norm(x.float(), (64,), None, 1e-6).bfloat16()
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-6, lib), want)
    gate_up = values(4, 256)[:, :128]  # every other row's half: not contiguous
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(layer_ops.silu_times_up(gate_up, lib), F.silu(gate) * up)
