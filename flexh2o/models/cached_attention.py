"""Self-attention over the KV cache, the part every model family shares.

A family's attention layer computes its queries, keys and values (with whatever positional
treatment it has: OPT's is in the input embedding, Llama's rotary phase is applied to q and k
here) and hands them to `attend`. Everything about the cache lives in this base class: the
per-gpu-batch cache homes (kv/home.py) and their loads and stores, the split of a step into the
prompt's attention and a decode step's, the KV policy's view of the attention probabilities, and,
under cpu_cache_compute, the decode attention over a CPU-held part run on the CPU.

Grouped-query attention: q has spec.num_heads heads, k and v spec.num_kv_heads; query heads
[g * group, (g + 1) * group) share KV head g, as in Hugging Face models.
"""

import torch
import torch.nn.functional as F

from flexh2o.kv.eviction import per_kv_head
from flexh2o.kv.home import CacheHome, batch_split
from flexh2o.models.attention import attend_filled, attend_slots, decode_attention, prompt_attention, prompt_attention_observed
from flexh2o.models.layer import Layer


class CachedAttention(Layer):
    """Base of an attention layer: subclasses define weight_specs, prepare and forward, which
    calls attend(q, k, v, step)."""

    def __init__(self, spec):
        self.spec = spec
        self.homes = []
        self.loading = []

    # -- the cache of each gpu-batch ------------------------------------------------------------
    def init_cache(self, batch_sizes, kv, policy, refills: bool = False):
        """kv: this layer's KV policy object (flexh2o.kv), which fixes the capacity. refills: rows
        take new sequences as others decode (slot_pool.py): no step is a whole gpu-batch's prompt."""
        s = self.spec
        self.kv, self.refills = kv, refills
        self.homes = [CacheHome(self.tiers, b, s.num_kv_heads, s.head_dim, kv.capacity, kv.accumulates,
                                batch_split(b, policy.cache_gpu_percent, policy.cache_cpu_percent),
                                policy.cpu_cache_compute, policy.compress_cache) for b in batch_sizes]
        self.loading = [None] * len(batch_sizes)

    def free_cache(self):
        for home in self.homes:
            home.close()
        self.homes, self.loading = [], []

    def load_cache(self, i, k):
        self.loading[k] = self.homes[k].load(prefill=i == 0 and not self.refills)

    def wait_inputs(self, k):
        super().wait_inputs(k)
        self.loading[k].wait()

    def store_cache(self, i, k):
        self.homes[k].store(self.loading[k].wait())
        self.loading[k] = None

    def wait_stores(self):
        for home in self.homes:
            home.wait_store()

    # -- attention -------------------------------------------------------------------------------
    def attend(self, q, k, v, step) -> torch.Tensor:
        """q [b, heads, n, d], k and v [b, kv_heads, n, d] (positions already applied) -> the
        attention output [b, n, heads * d]; the KV policy then takes the new K/V into the cache."""
        scale = self.spec.head_dim ** -0.5
        parts = self.loading[step.k].wait()  # [(rows, KVCache)]: sequences whose cache lives in one place
        if step.chunk_start is not None:
            out = self._prompt_chunk(q, k, v, scale, step, parts)
        elif step.prefill:
            out = self._prompt(q, k, v, scale, step, parts)
        else:
            out = self._decode_parts(q, k, v, scale, step, parts)
        b, heads, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, heads * d)

    def _decode_parts(self, q, k, v, scale, step, parts):
        """One new token per computed sequence, against each part of the cache where it lives."""
        pieces = computed_pieces(step.computed_rows, parts)
        # A part the CPU attends over (cpu_cache_compute): its q and new K/V start towards the
        # CPU first, so that copy and the CPU's attention overlap the device's own parts.
        on_cpu = {n: self.tiers.start_host_copy([t[rows] for t in (q, k, v, step.positions)], cache.k.dtype)
                  for n, (rows, cache, _) in enumerate(pieces) if cache.cpu_attended}
        outs = [None if n in on_cpu else self._decode(*rows_of((q, k, v, step.positions), rows), cache, scale,
                                                      step.for_rows(rows))
                for n, (rows, cache, _) in enumerate(pieces)]
        for n, copied in on_cpu.items():
            rows, cache, _ = pieces[n]
            outs[n] = self._decode(*copied.wait(), cache, scale, step.for_rows(rows)).to(q.device, q.dtype)
        if step.computed_rows is not None:
            hand_back_writes(pieces, parts)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, q, k_new, v_new, positions, cache, scale, step):
        """One new token per sequence against `cache`; the KV policy then stores it (or, for the
        full cache, first: the token is then attended over from its slot)."""
        if self.kv.appends and cache.lossless:
            self.kv.decode(cache, k_new, v_new, positions, None, None, step)
            if self.tiers.on_cuda and not cache.cpu_attended:
                return attend_slots(q, cache, scale)
            return attend_filled(q, cache, scale, step.padded)
        o, logits, probs = decode_attention(q, cache, k_new, v_new, scale)
        self.kv.decode(cache, k_new, v_new, positions, logits, probs, step)
        return o

    def _prompt(self, q, k, v, scale, step, parts):
        """The prompt's attention; the KV policy then takes its tokens into the cache."""
        kv_heads = self.spec.num_kv_heads
        seen = None
        if self.kv.uses_attention:
            out, seen = prompt_attention_observed(
                q, k, v, step.prompt_mask, step.key_valid, scale,
                lambda logits, probs, real_rows, at: self.kv.contribution(logits, probs, real_rows, step, at))
            seen = per_kv_head(seen, kv_heads)
        else:
            out = prompt_attention(q, k, v, step.prompt_mask, scale)
        b, _, n, _ = k.shape
        pos = step.positions.to(torch.int32)[:, None, :].expand(b, kv_heads, n)
        if step.refill is not None:
            self._refill(k, v, pos, seen, step, parts)
            return out
        for rows, cache in parts:
            dev = cache.k.device
            self.kv.prompt(cache, k[rows].to(dev), v[rows].to(dev), pos[rows].to(dev),
                           None if seen is None else seen[rows].to(dev), step)
        return out

    def _prompt_chunk(self, q, k, v, scale, step, parts):
        """One chunk of a joining prompt (full cache): its K and V go to its row's slots after the
        chunks before it, then its queries attend over all of them, each to the positions up to its own."""
        (row, _), = step.refill
        rows, cache = next((rows, cache) for rows, cache in parts if rows.start <= row < rows.stop)
        dev, start, n = cache.k.device, step.chunk_start, k.shape[2]
        view = cache.row(row - rows.start)
        pos = step.positions.to(torch.int32)[:, None, :].expand(1, k.shape[1], n)
        view.fill_span(k.to(dev), v.to(dev), pos.to(dev), start)
        cache.length = max(cache.length, start + n)
        cache.refilled.append(row - rows.start)
        held = view.pos[:, :1, : start + n].to(q.device)  # [1, 1, slots]
        mask = (held[:, :, None, :] <= step.positions[:, None, :, None]) & (held[:, :, None, :] >= 0)
        keys, values = (t[:, :, : start + n].to(q.device, q.dtype) for t in (view.k, view.v))
        grouped = {"enable_gqa": True} if keys.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, **grouped)

    def _refill(self, k, v, pos, seen, step, parts):
        """A refill step's prompts (slot_pool.py) into the cache rows they take, each one's real
        tokens alone from slot 0, the row's previous sequence forgotten (the policy rewrites every
        slot's position)."""
        for n, (row, padding) in enumerate(step.refill):
            rows, cache = next((rows, cache) for rows, cache in parts if rows.start <= row < rows.stop)
            dev = cache.k.device
            own = [None if t is None else t[n: n + 1, :, padding:].to(dev) for t in (k, v, pos, seen)]
            view = cache.row(row - rows.start)
            self.kv.prompt(view, *own, step)
            cache.length = max(cache.length, view.length)
            cache.refilled.append(row - rows.start)


def rows_of(tensors: tuple, rows: slice) -> tuple:
    """Sequences `rows` of each tensor: the tensors themselves where that is all of them (a decode
    step's usual single part: four slicing operations a layer saved)."""
    if rows.start == 0 and rows.stop >= tensors[0].shape[0]:
        return tensors
    return tuple(t[rows] for t in tensors)


def computed_pieces(computed: list | None, parts: list) -> list:
    """(the step's rows, a cache, where it lies in its part) for each run of neighbouring computed
    rows within one part of the cache: the part's cache itself where the run covers it, else a view
    of the run's rows. computed: the gpu-batch's rows the step computes, ascending (None: every one)."""
    if computed is None:
        return [(rows, cache, None) for rows, cache in parts]
    pieces, n = [], 0
    for rows, cache in parts:
        inside = [r for r in computed if rows.start <= r < rows.stop]
        runs = []
        for r in inside:
            if runs and runs[-1][1] == r:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        for start, stop in runs:
            whole = (start, stop) == (rows.start, rows.stop)
            view = cache if whole else cache.rows(start - rows.start, stop - rows.start)
            pieces.append((slice(n, n + stop - start), view, None if whole else (cache, start - rows.start)))
            n += stop - start
    return pieces


def hand_back_writes(pieces: list, parts: list):
    """What the views of a step over some rows wrote, handed to the caches they view: the slot each
    (sequence, KV head) wrote (-1 for a row the step did not compute) and the slots in use."""
    for _, cache in parts:
        views = [(view, where[1]) for _, view, where in pieces if where is not None and where[0] is cache]
        if not views:
            continue
        written = torch.full(cache.pos.shape[:2], -1, dtype=torch.long, device=cache.pos.device)
        for view, start in views:
            if view.written is not None:
                written[start: start + view.written.shape[0]] = view.written
            cache.length = max(cache.length, view.length)
        cache.written = written

