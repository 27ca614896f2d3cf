"""A Llama layer's decode step in one C call (native/decode_layers.c), where a float32 run computes
on the CPU with its weights multiplied as stored (GGUF blocks or 4-bit groups) and a full cache
attended over in place.

At batch 1 the Python between a layer's dozen kernels cost as much as the kernels (SmolLM2-135M:
about 190 us of Python for the attention half, 60 for the MLP half, against 60-180 us of products).
The C step runs the same kernels with the same arguments in the same order, so its results are
the same bits as the layer's own path (tests/models/test_llama_decode.py); every other case takes
that path.
"""

import torch

from flexh2o.compression.formats import NATIVE_FORMATS
from flexh2o.compression.grouped_weight import GroupedWeight
from flexh2o.kv.cache import KVCache
from flexh2o.kv.eviction import FullCache
from flexh2o.models.linear import as_stored


def _stored(weight, rows: int) -> bool:
    """Whether `weight` is multiplied as stored by the block kernels at this row count, as linear() would."""
    return type(weight) is GroupedWeight and as_stored(weight, rows) and weight.data.is_contiguous()


def _plain(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_contiguous()


def _scratch(layer, floats: int) -> torch.Tensor:
    """The layer's room for a step's intermediate rows, made once per size."""
    room = getattr(layer, "_decode_scratch", None)
    if room is None or room.numel() < floats:
        room = layer._decode_scratch = torch.empty(floats)
    return room


def mlp_step(layer, hidden: torch.Tensor, step, lib) -> bool:
    """layer (llama_layers.MLP)'s decode step on hidden [b, 1, h] in place; False where it does not apply."""
    b, n, h = hidden.shape
    norm, gate_up, down = layer.weights
    if lib is None or step.prefill or n != 1 or not (_plain(hidden) and _plain(norm)) or \
            not (_stored(gate_up, b) and _stored(down, b)):
        return False
    f = down.shape[1]
    scratch = _scratch(layer, b * (2 * h + 3 * f))
    if lib.llama_mlp_decode(hidden.data_ptr(), b, h, norm.data_ptr(), layer.spec.rms_norm_eps,
                            NATIVE_FORMATS[gate_up.fmt], gate_up.int8, gate_up.data.data_ptr(), NATIVE_FORMATS[down.fmt],
                            down.int8, down.data.data_ptr(), f, scratch.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory left for {b} rows quantized to int8")
    return True


def attention_step(layer, hidden: torch.Tensor, step, lib) -> bool:
    """layer (llama_layers.SelfAttention)'s decode step on hidden [b, 1, h] in place, its new token
    into the full cache; False where it does not apply."""
    b, n, h = hidden.shape
    if lib is None or step.prefill or n != 1 or step.chunk_start is not None or step.computed_rows is not None \
            or step.slot is not None or type(layer.kv) is not FullCache:
        return False
    slots = step.row_slots  # refilled slots: each sequence's new token at its own slot
    if slots is not None and (slots.dtype != torch.int64 or slots.device.type != "cpu" or not slots.is_contiguous()
                              or slots.shape != (b,)):
        return False
    norm, qkv_w, qkv_b, o_w, o_b = layer.split_weights()
    if qkv_b is not None or o_b is not None or not (_plain(hidden) and _plain(norm)) or \
            not (_stored(qkv_w, b) and _stored(o_w, b)):
        return False
    parts = layer.loading[step.k].wait()
    if len(parts) != 1:
        return False
    cache = parts[0][1]
    home = layer.homes[step.k].parts[0].home
    s = layer.spec
    positions = step.positions
    if cache is not home or type(cache) is not KVCache or cache.score is not None or s.head_dim % 8 or \
            (slots is None and cache.length >= cache.k.shape[2]) or \
            not (_plain(cache.k) and _plain(cache.v)) or cache.pos.dtype != torch.int32 or \
            not cache.pos.is_contiguous() or positions.dtype != torch.int64 or positions.shape != (b, 1):
        return False
    cos, sin = layer.rotary.phases(step, torch.float32)
    if not (_plain(cos) and _plain(sin)):
        return False
    heads, kv_heads, d = s.num_heads, s.num_kv_heads, s.head_dim
    scratch = _scratch(layer, b * (2 * h + (2 * heads + 2 * kv_heads) * d))
    t = cache.length
    length = t + 1 if slots is None else max(t, step.fill)
    done = lib.llama_attention_decode(
        hidden.data_ptr(), b, h, norm.data_ptr(), s.rms_norm_eps, NATIVE_FORMATS[qkv_w.fmt], qkv_w.int8,
        qkv_w.data.data_ptr(), NATIVE_FORMATS[o_w.fmt], o_w.int8, o_w.data.data_ptr(), heads, kv_heads, d,
        cos.data_ptr(), sin.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), cache.pos.data_ptr(),
        cache.k.shape[2], t, None if slots is None else slots.data_ptr(), length, positions.data_ptr(),
        positions.stride(0), d ** -0.5, scratch.data_ptr(), torch.get_num_threads())
    if done == 1:
        return False
    cache.length = length
    if done:
        raise MemoryError(f"no memory left for the attention of {b} rows")
    return True
