"""A Llama layer's decode step in one C call (native/decode_layers.c), where a float32 run computes
on the CPU with its weights multiplied as stored (GGUF blocks or 4-bit groups) and a full cache
attended over in place; and a run of whole layers in one call (LayersInOneCall), where the
schedule runs a decode step's layers back to back (engine/cpu_decode.py).

At batch 1 the Python between a layer's dozen kernels cost as much as the kernels (SmolLM2-135M:
about 190 us of Python for the attention half, 60 for the MLP half, against 60-180 us of products);
with the halves in one call each, the schedule's and the halves' Python still took about a fifth
of a step, which the run of layers in one call leaves out. The C steps run the same kernels with
the same arguments in the same order, so their results are the same bits as the layer's own path
(tests/models/test_llama_decode.py); every other case takes that path.
"""

import numpy as np
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
    """The layer's (or LayersInOneCall's) room for a step's intermediate rows, made once per size."""
    room = getattr(layer, "_decode_scratch", None)
    if room is None or room.numel() < floats:
        room = layer._decode_scratch = torch.empty(floats)
    return room


def _mlp_weights(layer, b: int):
    """(norm, gate_up weight, down weight) of an MLP layer whose decode step at b rows can run in C
    (weights multiplied as stored); None where it cannot."""
    norm, gate_up, down = layer.weights
    if not _plain(norm) or not (_stored(gate_up, b) and _stored(down, b)):
        return None
    return norm, gate_up, down


def _formats(weight) -> list:
    """A weight multiplied as stored, as the C steps take it: its format, int8 or not, its data."""
    return [NATIVE_FORMATS[weight.fmt], int(weight.int8), weight.data.data_ptr()]


def mlp_step(layer, hidden: torch.Tensor, step, lib) -> bool:
    """layer (llama_layers.MLP)'s decode step on hidden [b, 1, h] in place; False where it does not apply."""
    b, n, h = hidden.shape
    weights = None if lib is None or step.prefill or n != 1 or not _plain(hidden) else _mlp_weights(layer, b)
    if weights is None:
        return False
    norm, gate_up, down = weights
    f = down.shape[1]
    scratch = _scratch(layer, _mlp_floats(b, h, f))
    if lib.llama_mlp_decode(hidden.data_ptr(), b, h, norm.data_ptr(), layer.spec.rms_norm_eps, *_formats(gate_up),
                            *_formats(down), f, scratch.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"no memory left for {b} rows quantized to int8")
    return True


def _one_token_step(step, hidden: torch.Tensor) -> bool:
    """Whether `step` is a decode step of every row at one token each, its new tokens going to the
    full cache's shared slot or each row's refilled slot, as the C steps take it."""
    b, n, _ = hidden.shape
    slots, positions = step.row_slots, step.positions  # row_slots: each sequence's new token at its own slot
    return not step.prefill and n == 1 and step.chunk_start is None and step.computed_rows is None and \
        step.slot is None and _plain(hidden) and positions.dtype == torch.int64 and positions.shape == (b, 1) and \
        (slots is None or slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous()
         and slots.shape == (b,))


def _attention_weights(layer, b: int):
    """(norm, qkv weight, o weight) of a SelfAttention layer whose decode step at b rows can run in
    C (a full cache, no biases, weights multiplied as stored); None where it cannot."""
    norm, qkv_w, qkv_b, o_w, o_b = layer.split_weights()
    if type(layer.kv) is not FullCache or layer.spec.head_dim % 8 or qkv_b is not None or o_b is not None or \
            not _plain(norm) or not (_stored(qkv_w, b) and _stored(o_w, b)):
        return None
    return norm, qkv_w, o_w


def _full_cache(layer, step, slots):
    """The KVCache a SelfAttention layer's decode step appends to in place, with room for the new
    token; None where the C step cannot take it (in parts, moved, scored, not float32)."""
    parts = layer.loading[step.k].wait()
    if len(parts) != 1:
        return None
    cache = parts[0][1]
    if cache is not layer.homes[step.k].parts[0].home or type(cache) is not KVCache or cache.score is not None or \
            (slots is None and cache.length >= cache.k.shape[2]) or not (_plain(cache.k) and _plain(cache.v)) or \
            cache.pos.dtype != torch.int32 or not cache.pos.is_contiguous():
        return None
    return cache


def _phases(layer, step):
    cos, sin = layer.rotary.phases(step, torch.float32)
    return (cos, sin) if _plain(cos) and _plain(sin) else None


def _attended(cache, step) -> int:
    """How many slots the step attends over once its token is in: the shared slot's next, or, where
    slots are refilled, the fill of the longest row."""
    return cache.length + 1 if step.row_slots is None else max(cache.length, step.fill)


def attention_step(layer, hidden: torch.Tensor, step, lib) -> bool:
    """layer (llama_layers.SelfAttention)'s decode step on hidden [b, 1, h] in place, its new token
    into the full cache; False where it does not apply."""
    b, _, h = hidden.shape
    if lib is None or not _one_token_step(step, hidden):
        return False
    weights = _attention_weights(layer, b)
    slots = step.row_slots
    cache = weights and _full_cache(layer, step, slots)
    phases = cache and _phases(layer, step)
    if not phases:
        return False
    norm, qkv_w, o_w = weights
    cos, sin = phases
    s = layer.spec
    heads, kv_heads, d = s.num_heads, s.num_kv_heads, s.head_dim
    scratch = _scratch(layer, _attention_floats(b, h, heads, kv_heads, d))
    t, length = cache.length, _attended(cache, step)
    done = lib.llama_attention_decode(
        hidden.data_ptr(), b, h, norm.data_ptr(), s.rms_norm_eps, *_formats(qkv_w), *_formats(o_w), heads, kv_heads,
        d, cos.data_ptr(), sin.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), cache.pos.data_ptr(),
        cache.k.shape[2], t, None if slots is None else slots.data_ptr(), length, step.positions.data_ptr(),
        step.positions.stride(0), d ** -0.5, scratch.data_ptr(), torch.get_num_threads())
    if done == 1:
        return False
    cache.length = length
    if done:
        raise MemoryError(f"no memory left for the attention of {b} rows")
    return True


def _attention_floats(b, h, heads, kv_heads, d) -> int:
    return b * (2 * h + (2 * heads + 2 * kv_heads) * d)


def _mlp_floats(b, h, f) -> int:
    return b * (2 * h + 3 * f)


# A row of llama_layers_decode's table, one per layer (native/decode_layers.c's enum): the
# attention half's norm and weights (format, int8 or not, data), its cache and the slot its new
# token goes to, how many slots it attends over, then the MLP half's norm and weights.
FIELDS = ("attention_norm", "qkv_format", "qkv_int8", "qkv", "o_format", "o_int8", "o", "cache_k", "cache_v",
          "cache_pos", "capacity", "slot", "attended", "mlp_norm", "gate_up_format", "gate_up_int8", "gate_up",
          "down_format", "down_int8", "down")
SLOT, ATTENDED = FIELDS.index("slot"), FIELDS.index("attended")


class LayersInOneCall:
    """Whole Llama layers (a SelfAttention, then its MLP, and so on) whose decode steps run in one
    C call (llama_layers_decode), where every one of them would take its one-call steps. Made for
    a run whose weights stay in place (engine/cpu_decode.py), so their pointers are gathered once
    per row count; the caches' once per gpu-batch (again if a cache is another tensor); and a step
    only sets each cache's slot."""

    def __init__(self, layers: list, lib):
        self.layers, self.lib = layers, lib
        self.attention, self.mlp = layers[0::2], layers[1::2]
        if lib.llama_layer_fields() != len(FIELDS):
            raise RuntimeError("the kernels' layer table is not llama_decode.FIELDS")
        self.weight_columns = {}  # rows -> the table's weight columns, or None where a weight is widened then
        self.tables = {}  # (gpu-batch, rows) -> (table [layers, fields] int64, the caches it points at)

    def _weight_columns(self, b: int):
        if b not in self.weight_columns:
            columns = []
            for attention, mlp in zip(self.attention, self.mlp):
                a, m = _attention_weights(attention, b), _mlp_weights(mlp, b)
                if a is None or m is None:
                    columns = None
                    break
                columns.append(([a[0].data_ptr(), *_formats(a[1]), *_formats(a[2])],
                                [m[0].data_ptr(), *_formats(m[1]), *_formats(m[2])]))
            self.weight_columns[b] = columns
        return self.weight_columns[b]

    def _table(self, step, b: int):
        """The table for gpu-batch step.k at b rows with each layer's cache columns checked; None
        where a weight or a cache cannot be taken."""
        key = (step.k, b)
        kept = self.tables.get(key)
        slots = step.row_slots
        if kept is not None:
            table, caches = kept
            for layer, cache in zip(self.attention, caches):
                parts = layer.loading[step.k].wait()
                if len(parts) != 1 or parts[0][1] is not cache or slots is None and cache.length >= cache.k.shape[2]:
                    kept = None
                    break
        if kept is None:
            columns = self._weight_columns(b)
            if columns is None:
                return None
            caches = [_full_cache(layer, step, slots) for layer in self.attention]
            if any(cache is None for cache in caches):
                return None
            table = np.array([attention + [cache.k.data_ptr(), cache.v.data_ptr(), cache.pos.data_ptr(),
                                           cache.k.shape[2], 0, 0] + mlp
                              for (attention, mlp), cache in zip(columns, caches)], dtype=np.int64)
            self.tables[key] = table, caches
            kept = self.tables[key]
        return kept

    def step(self, hidden: torch.Tensor, step) -> bool:
        """These layers' decode step on hidden [b, 1, h] in place; False where it does not apply (then
        nothing is done, and each layer takes its own path)."""
        b, _, h = hidden.shape
        first = self.attention[0]
        if not _one_token_step(step, hidden):
            return False
        kept = self._table(step, b)
        phases = kept and _phases(first, step)
        if not phases:
            return False
        table, caches = kept
        table[:, SLOT] = [cache.length for cache in caches]
        table[:, ATTENDED] = [_attended(cache, step) for cache in caches]
        s = first.spec
        f = self.mlp[0].spec.ffn_dim
        floats = max(_attention_floats(b, h, s.num_heads, s.num_kv_heads, s.head_dim), _mlp_floats(b, h, f))
        scratch = _scratch(self, floats)
        slots, positions = step.row_slots, step.positions
        done = self.lib.llama_layers_decode(
            hidden.data_ptr(), b, h, len(caches), table.ctypes.data, s.rms_norm_eps, s.num_heads, s.num_kv_heads,
            s.head_dim, f, phases[0].data_ptr(), phases[1].data_ptr(), None if slots is None else slots.data_ptr(),
            positions.data_ptr(), positions.stride(0), s.head_dim ** -0.5, scratch.data_ptr(),
            torch.get_num_threads())
        if done == 1:
            return False
        for cache, length in zip(caches, table[:, ATTENDED].tolist()):
            cache.length = length
        if done:
            raise MemoryError(f"no memory left for the decode step of {b} rows")
        return True


def one_call_runs(layers: list, lib) -> dict:
    """{index of a run's first layer: (index after its last, LayersInOneCall)} for each run of two
    or more whole Llama layers (SelfAttention then MLP: llama_layers.py's decode_half) in `layers`."""
    runs, j = {}, 0
    while j < len(layers):
        stop = j
        while stop + 1 < len(layers) and getattr(layers[stop], "decode_half", None) == "attention" and \
                getattr(layers[stop + 1], "decode_half", None) == "mlp":
            stop += 2
        if stop - j >= 4 and lib is not None:
            runs[j] = (stop, LayersInOneCall(layers[j:stop], lib))
        j = max(stop, j + 1)
    return runs
