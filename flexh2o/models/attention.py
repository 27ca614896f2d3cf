"""Attention over the KV slots: where a KV policy sees the attention probabilities.

The prompt step uses PyTorch's fused attention unless the policy needs the probabilities; then
it runs in chunks of (sequence, head) rows so the [s, s] probabilities stay within a fixed amount of
memory. A decode step attends over every slot of the preallocated cache (masking the empty ones:
the slots are one contiguous block, which on a CPU is several times faster than a strided view
of the filled part) plus the new token itself, whose K/V the policy then stores. The full
cache, which needs no probabilities and never evicts, stores the new token first and attends
over its filled slots in one kernel (`attend_filled`: flexh2o's own, native/attention.c, in a
float32 run, each sequence only up to its own last token) on a CPU, and over all its slots, the
empty ones masked, on CUDA (`attend_slots`): there every decode step must run the same kernels on
the same shapes, or a fused attention backend plans anew for each cache length (cuDNN's took 63%
of an H200's CPU time at OPT-6.7B's decode) and no CUDA graph can replay the step.
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexh2o import native
from flexh2o.common.errors import UsageError

PROBS_CHUNK_BYTES = 64 << 20  # bound on the prompt's logits + probabilities held at once


def prompt_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [b, heads, s, d], k and v [b, kv_heads, s, d]; mask bool [b, 1, s, s] (True = may attend),
    None for plain causal."""
    grouped = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if grouped and mask is not None and q.is_cuda:
        # No fused CUDA kernel takes both a mask and grouped heads: the fallback would build the
        # [b, heads, s, s] scores. K and V expanded to every head take the memory-efficient one.
        k, v, grouped = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1]), {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **grouped)


def repeat_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, heads, s, d]: each KV head repeated for the query heads of its group."""
    b, kv_heads, s, d = t.shape
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, s, d).reshape(b, heads, s, d)


def observed_chunk_rows(s: int) -> int:
    """Rows (sequence, head) of the observed prompt attention done at once: a chunk's logits, its
    probabilities and the policy's weighted probabilities, float32 [rows, s, s] each, within
    PROBS_CHUNK_BYTES (one row where a single one is larger)."""
    return max(1, PROBS_CHUNK_BYTES // (3 * s * s * 4))


def observed_chunk_bytes(rows: int, s: int, dtype_bytes: int = 4) -> int:
    """Bytes a chunk of the observed prompt attention holds at once, for `rows` (sequence, head)
    rows; in a 16-bit run also the product as computed and the probabilities cast back."""
    per_value = 3 * 4 + (2 * dtype_bytes if dtype_bytes != 4 else 0)
    return min(rows, observed_chunk_rows(s)) * s * s * per_value


def observed_coordinates(real, seq, r: slice, heads: int) -> tuple:
    """Where the logits [rows, s, s] of rows r (sequence seq of each) sit, as at() gives them: the
    prompts are left-padded, so a real token's position counts the real ones before it."""
    positions = real[seq].long().cumsum(-1) - 1
    head = torch.arange(r.start, r.stop, device=seq.device) % heads
    return seq.view(-1, 1, 1), head.view(-1, 1, 1), positions.unsqueeze(-1), positions.unsqueeze(-2)


def prompt_attention_observed(q, k, v, mask, real, scale: float, contribution):
    """Prompt attention that also returns contribution(logits, probs, real_rows, at) per key and
    query head: [b, heads, s]. real bool [b, s] marks real (non-padding) query rows. k and v may
    have fewer (KV) heads than q. at() gives where the logits [rows, s, s] sit: (sequence [rows, 1, 1],
    head [rows, 1, 1], query position [rows, s, 1], key position [rows, 1, s])."""
    b, heads, s, d = q.shape
    rows = b * heads
    qf, kf, vf = (repeat_kv_heads(t, heads).reshape(rows, s, d) for t in (q, k, v))
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_() if mask is None else None
    out = torch.empty_like(qf)
    seen = torch.empty(rows, s, dtype=torch.float32, device=q.device)
    chunk = observed_chunk_rows(s)
    for start in range(0, rows, chunk):
        r = slice(start, min(start + chunk, rows))
        seq = torch.arange(r.start, r.stop, device=q.device) // heads  # the sequence of each row
        # q scaled first: in float16 the unscaled q.k can overflow to inf (and the softmax to NaN).
        logits = torch.bmm(qf[r] * scale, kf[r].transpose(1, 2)).float()
        logits.masked_fill_(~(causal if mask is None else mask[seq, 0]), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[r] = torch.bmm(probs.to(v.dtype), vf[r])
        seen[r] = contribution(logits, probs, real[seq].unsqueeze(-1).float(),
                               lambda: observed_coordinates(real, seq, r, heads))
    return out.view(b, heads, s, d), seen.view(b, heads, s)


def decode_attention(q, cache, k_new, v_new, scale: float):
    """q [b, heads, 1, d] against every slot of cache.k / cache.v [b, kv_heads, capacity, d] and
    the new token's k_new, v_new [b, kv_heads, 1, d]. Returns the output [b, heads, 1, d] and the
    logits and float32 probabilities [b, heads, 1, capacity + 1] (the new token last)."""
    b, heads, _, d = q.shape
    _, kv_heads, capacity = cache.pos.shape
    qg = (q * scale).view(b, kv_heads, heads // kv_heads, d)  # the query heads sharing each KV head
    logits = torch.empty(b, kv_heads, heads // kv_heads, capacity + 1, dtype=torch.float32, device=q.device)
    # K times q rather than q times K transposed: on a CPU the former streams K's rows in order and
    # ran 1.7x faster (float32, AVX2); on a GPU both are the same kernel.
    for start, stop, k in cache.blocks("k", q.dtype):
        logits[..., start:stop] = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2)
    logits[..., -1:] = torch.matmul(qg, k_new.transpose(-1, -2))
    logits[..., :-1].masked_fill_(cache.pos.unsqueeze(2) < 0, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    p = probs.to(q.dtype)
    out = p[..., -1:] * v_new.view(b, kv_heads, 1, d)
    for start, stop, v in cache.blocks("v", q.dtype):
        out += torch.matmul(p[..., start:stop], v)
    return out.view(b, heads, 1, d), logits.view(b, heads, 1, -1), probs.view(b, heads, 1, -1)


def attend_filled(q, cache, scale: float, padded: bool) -> torch.Tensor:
    """q [b, heads, 1, d] against slots [0, cache.length) of a full cache that already holds the new
    token (every (sequence, KV head) filled alike, so one head's positions mask them all): flexh2o's
    own kernel where it applies (attend_own_slots), else PyTorch's fused attention, 2-3x faster on a
    CPU than decode_attention's separate kernels. padded: some slots hold prompt padding (position
    -1), masked out."""
    out = attend_own_slots(q, cache, scale)
    if out is not None:
        return out
    n = cache.length
    mask = (cache.pos[:, :1, None, :n] >= 0) if padded else None
    grouped = {"enable_gqa": True} if cache.k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, cache.k[:, :, :n], cache.v[:, :, :n], attn_mask=mask, scale=scale,
                                          **grouped)


def attend_own_slots(q, cache, scale: float) -> torch.Tensor | None:
    """attend_filled on a CPU in float32 by native/attention.c, which reads each sequence's slots only
    up to its own last token (refilled slots hold sequences of every length); None where it does not
    apply (another device or width, no kernels built, head_dim not a multiple of 8)."""
    b, heads, _, d = q.shape
    k, v, pos = cache.k, cache.v, cache.pos
    if q.device.type != "cpu" or d % 8 or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (k, v)) \
            or pos.dtype != torch.int32 or not pos.is_contiguous():
        return None
    lib = native.library()
    if lib is None:
        return None
    _, kv_heads, capacity, _ = k.shape
    group = heads // kv_heads  # the query heads sharing a KV head
    if q.stride(-1) != 1 or q.stride(1) != d:  # the kernel takes each sequence's heads as one row
        q = q.contiguous()
    out = torch.empty(b, heads, 1, d)
    if lib.decode_attention(q.data_ptr(), q.stride(0), scale, k.data_ptr(), v.data_ptr(), pos.data_ptr(), b, kv_heads,
                            group, capacity, cache.length, d, out.data_ptr(), torch.get_num_threads()):
        return None
    return out


# The fused backends a CUDA decode step may use, in PyTorch's order of preference, unless
# FLEXH2O_DECODE_ATTENTION names one (cudnn, efficient, flash or math: for measuring them,
# scripts/gpu_diagnose.py). cuDNN's is left out by default: it builds an execution plan per shape,
# and the first plan of each shape cost 1.4 ms of CPU on an H200.
DECODE_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
DEFAULT_DECODE_BACKENDS = ("efficient", "math")


def decode_backends() -> list:
    """The SDPA backends of a CUDA decode step's attention (FLEXH2O_DECODE_ATTENTION, or the default);
    read once per value of the variable, not at every layer of every step."""
    return _backends_for(os.environ.get("FLEXH2O_DECODE_ATTENTION", ""))


@functools.lru_cache(maxsize=4)
def _backends_for(chosen: str) -> list:
    names = [n.strip() for n in chosen.split(",") if n.strip()] or list(DEFAULT_DECODE_BACKENDS)
    unknown = [n for n in names if n not in DECODE_BACKENDS]
    if unknown:
        raise UsageError("FLEXH2O_DECODE_ATTENTION", f"unknown backend {unknown[0]!r}; accepted, in order of "
                         f"preference: {', '.join(DECODE_BACKENDS)}")
    return [DECODE_BACKENDS[n] for n in names]


def attend_slots(q, cache, scale: float) -> torch.Tensor:
    """q [b, heads, 1, d] against every slot of a full cache that already holds the new token, the
    empty ones (position < 0) masked: the same shapes at every step. The query heads sharing a KV
    head are that head's query rows, so grouped heads need no copy of K and V."""
    b, heads, _, d = q.shape
    kv_heads = cache.k.shape[1]
    rows = q.reshape(b, kv_heads, heads // kv_heads, d)
    mask = (cache.pos >= 0).unsqueeze(2)  # [b, kv_heads, 1, capacity], the same for each query row
    with sdpa_kernel(decode_backends()):
        out = F.scaled_dot_product_attention(rows, cache.k, cache.v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, 1, d)
