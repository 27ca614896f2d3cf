"""A Llama layer's small operations (RMSNorm, the rotary turn, SiLU(gate) * up) in one C call each
(native/layer_ops.c) where a float32 run computes on the CPU, else in torch. `lib` is the kernels
(Layer.cpu_kernels: None on CUDA, where these tensors live on the device, or without kernels).

At a decode step's few rows these operations cost their dispatch, not their arithmetic: RMSNorm is
seven torch operations, the rotary turn ten, and the two norms, the turn and the SwiGLU of a layer
were about a third of the operations of a SmolLM2 decode step at batch 1 (docs/design.md, "Where a
CPU decode step goes").
"""

import torch
import torch.nn.functional as F


def _takes(lib, x: torch.Tensor) -> bool:
    """Whether the kernels are there and take x: float32 on the CPU, contiguous."""
    return lib is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib=None) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalized in float32, scaled in the input's dtype."""
    if _takes(lib, x) and _takes(lib, weight):
        n = x.shape[-1]
        out = torch.empty(x.shape)
        lib.rms_norm_rows(x.data_ptr(), n, x.numel() // n, n, weight.data_ptr(), eps, out.data_ptr(), n,
                          torch.get_num_threads())
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotate(x, cos, sin):
    """x [b, heads, n, d] turned by its phase: each value i of the first half paired with i + d/2."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rotate_heads(qkv: torch.Tensor, heads: int, d: int, cos, sin, lib=None) -> torch.Tensor:
    """The first `heads` heads of qkv [b, n, all heads * d] turned by cos, sin [b, 1, n, d]; returns
    them as [b, heads, n, d]. In place where the kernels take qkv (it must be the caller's own),
    else a new tensor."""
    b, n, width = qkv.shape
    if _takes(lib, qkv) and _takes(lib, cos) and _takes(lib, sin):
        lib.rotate_rows(qkv.data_ptr(), width, b * n, heads, d, cos.data_ptr(), sin.data_ptr(), d,
                        torch.get_num_threads())
        return qkv.view(b, n, width // d, d).transpose(1, 2)[:, :heads]
    return rotate(qkv.view(b, n, width // d, d).transpose(1, 2)[:, :heads], cos, sin)


def silu_times_up(gate_up: torch.Tensor, lib=None) -> torch.Tensor:
    """SiLU(gate) * up of a product [..., 2f] that holds gate then up."""
    if _takes(lib, gate_up):
        f = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], f)
        lib.silu_mul_rows(gate_up.data_ptr(), 2 * f, gate_up.numel() // (2 * f), f, out.data_ptr(), f,
                          torch.get_num_threads())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
