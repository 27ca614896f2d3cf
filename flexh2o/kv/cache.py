"""The KV cache of one (layer, gpu-batch): slots preallocated once, never grown or compacted.

K and V are [batch, kv_heads, capacity, head_dim]. Every slot of every (sequence, KV head) also
records the absolute position of the token it holds (-1: empty, e.g. padding or not yet
filled; -2: past the sequence's budget, never filled, kv/eviction.py) and, for policies that
accumulate one, the token's score. Because an evicting policy chooses per head, the same
position can be kept by one head and gone from another.

Slots start empty and zeroed: attention runs over all of them with the empty ones masked, and
garbage there could turn 0 * NaN into NaN.
"""

import torch

from flexh2o import native
from flexh2o.offload.slots import slot_grid


class KVCache:
    lossless = True  # holds K and V as given (a new token read back from it is the token itself)
    cpu_attended = False  # on CUDA, a home in CPU memory that the CPU attends over (cpu_cache_compute)

    def __init__(self, k, v, pos, score=None, length: int = 0):
        self.k, self.v, self.pos, self.score = k, v, pos, score
        self.capacity = k.shape[2]
        self.length = length  # slots [0, length) may hold a token; the rest are still empty
        self.written = None   # what the last step wrote: "all" (the prompt) or slot per [batch, kv_head]
        self.refilled = []    # rows whose sequence the last step replaced, every slot rewritten (slot_pool.py)

    @classmethod
    def allocate(cls, tiers, batch, kv_heads, head_dim, capacity, with_score: bool, tier: str = "gpu", dtype=None):
        shape = (batch, kv_heads, capacity, head_dim)
        pos, score = cls.allocate_state(tiers, batch, kv_heads, capacity, with_score, tier)
        return cls(tiers.alloc(tier, shape, dtype, zero=True), tiers.alloc(tier, shape, dtype, zero=True), pos, score)

    @staticmethod
    def allocate_state(tiers, batch, kv_heads, capacity, with_score: bool, tier: str):
        """The per-slot positions (all empty) and, if asked, scores."""
        pos = tiers.alloc(tier, (batch, kv_heads, capacity), dtype=torch.int32)
        pos.fill_(-1)
        score = tiers.alloc(tier, (batch, kv_heads, capacity), dtype=torch.float32, zero=True) if with_score else None
        return pos, score

    def rows(self, start: int, stop: int) -> "KVCache":
        """Sequences [start, stop)'s slots, as a cache of those sequences whose writes land in this one
        (what it writes is its own `written` and `length`: the caller hands them on)."""
        view = KVCache(*(None if t is None else t[start:stop] for t in (self.k, self.v, self.pos, self.score)),
                       length=self.length)
        view.cpu_attended = self.cpu_attended
        return view

    def row(self, r: int) -> "KVCache":
        """Sequence r's slots (rows)."""
        return self.rows(r, r + 1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.pos, self.score) if t is not None]

    def fill_prompt(self, k, v, pos, score=None, usable=None):
        """The prompt's tokens: k, v [b, kv_heads, s, d], pos [b, kv_heads, s], score likewise, into
        slots [0, s). usable [b]: each sequence's slots; the ones past it are marked UNUSED (-2)."""
        s = k.shape[2]
        if s > self.capacity:
            raise ValueError(f"prompt of {s} tokens exceeds the cache's {self.capacity} slots")
        self.store_first(k, v)
        self.pos[:, :, :s] = pos
        self.pos[:, :, s:] = -1
        if self.score is not None:
            self.score[:, :, :s] = 0 if score is None else score
            self.score[:, :, s:] = 0
        if usable is not None:
            self.pos.masked_fill_(torch.arange(self.capacity, device=self.pos.device) >= usable[:, None, None], -2)
        self.length = s
        self.written = "all"

    def fill_span(self, k, v, pos, start: int):
        """A prompt's tokens k, v [b, kv_heads, n, d] at positions pos [b, kv_heads, n] into slots
        [start, start + n), after the ones its earlier chunks wrote (start 0: the first; the
        slots after it are marked empty)."""
        stop = start + k.shape[2]
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        self.pos[:, :, start:stop] = pos
        if start == 0:
            self.pos[:, :, stop:] = -1
        self.length = stop
        self.written = "all"

    def put(self, slots, k, v, pos, score=None):
        """Writes one new token per (sequence, KV head) into slots [b, kv_heads]: k, v [b, kv_heads, 1, d],
        pos [b, 1], score [b, kv_heads]. A slot's previous token, if any, is evicted."""
        seq, head = slot_grid(slots)
        self.store_at(seq, head, slots, k[:, :, 0], v[:, :, 0])
        self.pos[seq, head, slots] = pos.to(torch.int32)
        if self.score is not None:
            self.score[seq, head, slots] = score
        self.written = slots

    def append(self, k, v, pos, slot=None):
        """The full cache's new token, k, v [b, kv_heads, 1, d] at position pos [b, 1], into the next
        free slot, the same one for every (sequence, KV head): plain slice writes, no index tensors.
        slot: on CUDA, (the slot as a device tensor [1], and as an int): written through the tensor,
        every step runs the same kernels on the same memory (a CUDA graph replays them)."""
        b, kv_heads = k.shape[:2]
        if slot is None:
            t = self.length
            if not self.append_natively(t, k, v, pos):
                self.store_slot(t, k[:, :, 0], v[:, :, 0])
                self.pos[:, :, t] = pos.to(torch.int32)
            self.written = torch.full((b, kv_heads), t, dtype=torch.long, device=k.device)
        else:
            where, t = slot
            self.store_through(where, k[:, :, 0], v[:, :, 0])
            self.pos.index_copy_(2, where, pos.to(torch.int32).view(b, 1, 1).expand(b, kv_heads, 1))
            self.written = where.expand(b, kv_heads).clone()  # its own: a store may read it on another stream
        self.length = t + 1

    def append_natively(self, t: int, k, v, pos) -> bool:
        """append's writes in one C call (native/attention.c) where this cache and the new token are
        float32 and int64 tensors on the CPU that it takes: at a decode step's few rows, torch's eleven
        indexing and copying operations cost more than the copying itself. False where it does not apply."""
        if type(self).store_slot is not KVCache.store_slot or pos.dtype != torch.int64 or pos.device.type != "cpu":
            return False
        tensors = (self.k, self.v, k, v)
        if any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 for x in tensors) or \
                not (self.k.is_contiguous() and self.v.is_contiguous() and self.pos.is_contiguous()):
            return False
        lib = native.library()
        if lib is None:
            return False
        b, kv_heads, capacity, d = self.k.shape
        lib.append_token(self.k.data_ptr(), self.v.data_ptr(), self.pos.data_ptr(), b, kv_heads, capacity, d, t,
                         k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                         pos.data_ptr(), pos.stride(0))
        return True

    def store_through(self, slot, k, v):
        """K and V [b, kv_heads, d] into the slot held by device tensor slot [1], of every (sequence, KV head)."""
        self.k.index_copy_(2, slot, k.unsqueeze(2))
        self.v.index_copy_(2, slot, v.unsqueeze(2))

    def store_slot(self, t: int, k, v):
        """K and V [b, kv_heads, d] into slot t of every (sequence, KV head)."""
        self.k[:, :, t] = k
        self.v[:, :, t] = v

    def store_first(self, k, v):
        """K and V [b, kv_heads, s, d] into slots [0, s)."""
        s = k.shape[2]
        self.k[:, :, :s] = k
        self.v[:, :, :s] = v

    def store_at(self, seq, head, slots, k, v):
        """K and V [b, kv_heads, d] into one slot per (sequence, KV head)."""
        # Indexed assignment: on a CPU, scatter_ along the slot dimension is about 100x slower.
        self.k[seq, head, slots] = k
        self.v[seq, head, slots] = v

    def blocks(self, which: str, dtype: torch.dtype):
        """(start, stop, K or V [b, kv_heads, stop - start, d]) covering the slots attention reads:
        here all of them at once (a compressed cache dequantizes its filled ones block by block)."""
        yield 0, self.capacity, self.k if which == "k" else self.v
