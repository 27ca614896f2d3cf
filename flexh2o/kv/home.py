"""The KV cache of one (layer, gpu-batch) at its home tiers, split along the batch.

Sequences [0, a) keep their cache on the compute device, [a, b) in CPU memory, [b, batch) on
disk. A part held in memory the compute device can use is attended over in place; any other part
is loaded into a pooled compute buffer before the step, and after it only what the step changed
goes back: every slot after the prompt, one slot per (sequence, KV head) after a decode step,
plus the small per-slot positions and scores.

On disk, K and V are stored slot-major ([capacity, rows, kv_heads, head_dim]): the full cache's
new slot is one contiguous write, and an evicting policy's scattered slots become one write per
run of neighbours. Positions and scores of a disk part stay in CPU memory (4 bytes per slot
against 2 x head_dim x 2 for K and V).

Compressed (quant.py), every part holds K and V slot-major as 4-bit groups along head_dim. A home
the compute device reads is a CompressedKVCache, attended over in place a block at a time
(kv/compressed.py); any other part's groups are loaded and dequantized into a pooled compute
buffer, and after the step only the slots it wrote are quantized and go back. Positions and
scores stay exact.
"""

from collections import Counter
from contextlib import suppress
from dataclasses import dataclass

import torch

from flexh2o.host.machine import cpu_compute_dtype
from flexh2o.offload.buffers import TIERS
from flexh2o.offload.io_tasks import Pending
from flexh2o.compression.quant import packed_width, quantize
from flexh2o.kv.cache import KVCache
from flexh2o.offload.slots import slot_grid
from flexh2o.kv.compressed import CompressedKVCache, quantize_slot_major

IN_FLIGHT = 3  # sets of compute buffers per loaded part: computing, loading, storing
SLOT_MAJOR = "slot-major block"  # the pool kind of _read's blocks


def batch_split(batch: int, gpu_percent: float, cpu_percent: float) -> dict:
    """Sequences per tier for a gpu-batch: the cache percentages applied along the batch."""
    gpu = round(batch * gpu_percent / 100)
    cpu = min(batch - gpu, round(batch * cpu_percent / 100))
    return {"gpu": gpu, "cpu": cpu, "disk": batch - gpu - cpu}


@dataclass
class CachePart:
    rows: slice
    tier: str
    home: KVCache | None = None  # held where some device attends over it in place
    k_mem: torch.Tensor | None = None  # or K and V slot-major in CPU memory, moved to the GPU each step
    v_mem: torch.Tensor | None = None
    k_file: object = None        # or on disk, slot-major; positions and scores then in CPU memory
    v_file: object = None
    pos: torch.Tensor | None = None
    score: torch.Tensor | None = None
    cpu_attends: bool = False    # on CUDA, decode attention over this part runs on the CPU (home in CPU memory)

    def in_place(self, prefill: bool) -> bool:
        """Whether a step uses the home itself. Under cpu_cache_compute the prompt's attention still
        runs on the GPU, into a buffer whose contents then go home."""
        return self.home is not None and not (self.cpu_attends and prefill)


def cpu_attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cache the CPU attends over: a float16 run holds it in the dtype the CPU computes
    fastest in (float16 products on a CPU are very slow; float32 takes twice the bytes)."""
    return cpu_compute_dtype() if dtype == torch.float16 else dtype


class CacheHome:
    def __init__(self, tiers, batch, kv_heads, head_dim, capacity, with_score: bool, rows: dict,
                 compute_on_cpu: bool = False, compressed: bool = False):
        self.tiers, self.shape, self.with_score = tiers, (kv_heads, head_dim, capacity), with_score
        self.compressed = compressed
        # What one slot of one (sequence, KV head) holds at home: head_dim values, or their groups.
        self.width, self.stored = (packed_width(head_dim), torch.uint8) if compressed else (head_dim, tiers.dtype)
        self.parts, start = [], 0
        for tier in TIERS:
            n = rows.get(tier, 0)
            if n == 0:
                continue
            part = CachePart(slice(start, start + n), tier)
            slot_major = (capacity, n, kv_heads, self.width)
            nbytes = capacity * n * kv_heads * self.width * self.stored.itemsize
            if tier == "gpu" or (tier == "cpu" and (not tiers.on_cuda or compute_on_cpu)):
                part.cpu_attends = tier == "cpu" and tiers.on_cuda
                dtype = cpu_attention_dtype(tiers.dtype) if part.cpu_attends else None
                kind = CompressedKVCache if compressed else KVCache
                part.home = kind.allocate(tiers, n, kv_heads, head_dim, capacity, with_score, tier, dtype)
                part.home.cpu_attended = part.cpu_attends
                part.pos, part.score = part.home.pos, part.home.score
            else:
                if tier == "disk":
                    part.k_file, part.v_file = tiers.disk.create(nbytes), tiers.disk.create(nbytes)
                    tiers.track("disk", 2 * nbytes)
                else:
                    # Zeroed (kv/cache.py): a refilled row leaves slots below the length unwritten,
                    # which a step loads and attends over, masked.
                    part.k_mem, part.v_mem = (tiers.alloc("cpu", slot_major, self.stored, zero=True) for _ in "kv")
                part.pos, part.score = KVCache.allocate_state(tiers, n, kv_heads, capacity, with_score, "cpu")
            if tier != "gpu":  # the widest this part's data is on its way (the CPU-attended cache may be wider)
                tiers.reserve_staging(nbytes if part.home is None else part.home.k.nbytes)
            self.parts.append(part)
            start += n
        self.length = 0       # slots in use, as of the last store
        self.last_store = None
        self._reserve_buffers()

    def _reserve_buffers(self):
        """The pooled compute buffers of the parts that a step loads, made now. IN_FLIGHT sets: the
        one computing, the one loading and the one storing (a further load waits for that store)."""
        kv_heads, head_dim, capacity = self.shape
        loaded = Counter(p.rows.stop - p.rows.start for p in self.parts if not p.in_place(prefill=True))
        moved = {p.rows.stop - p.rows.start for p in self.parts if p.home is None}
        for n, parts in loaded.items():
            sets = IN_FLIGHT * parts
            self.tiers.reserve((n, kv_heads, capacity, head_dim), count=2 * sets)  # K and V
            self.tiers.reserve((n, kv_heads, capacity), torch.int32, count=sets)
            if self.with_score:
                self.tiers.reserve((n, kv_heads, capacity), torch.float32, count=sets)
        for n in moved:  # _read's slot-major block, one per I/O thread
            self.tiers.reserve((capacity, n, kv_heads, self.width), self.stored, count=self.tiers.io_threads,
                               kind=SLOT_MAJOR)

    def load(self, prefill: bool) -> Pending:
        """The compute-side KVCache of every part: [(rows, KVCache)]."""
        views, todo = [], []
        kv_heads, head_dim, capacity = self.shape
        for part in self.parts:
            if part.in_place(prefill):
                part.home.refilled = []
                views.append((part.rows, part.home))
                continue
            n = part.rows.stop - part.rows.start
            buf = KVCache(self.tiers.buffer((n, kv_heads, capacity, head_dim)),
                          self.tiers.buffer((n, kv_heads, capacity, head_dim)),
                          self.tiers.buffer((n, kv_heads, capacity), torch.int32),
                          self.tiers.buffer((n, kv_heads, capacity), torch.float32) if self.with_score else None,
                          length=self.length)
            views.append((part.rows, buf))
            todo.append((part, buf))
        previous = self.last_store
        if not todo:
            if previous is not None:  # a home attended in place must hold the prompt's cache first
                previous.wait()
            return Pending(views)

        def fill(which):
            if previous is not None:
                previous.wait()
            for part, buf in todo:
                self._read(part, buf, which)
        # K and V in two tasks, so both I/O threads read at once (one stream of reads from this
        # machine's disk ran at 0.65-0.77 GB/s, two at 1.1-1.3).
        keys = self.tiers.run_io(lambda: fill("k"), None, "loading the KV cache")
        values = self.tiers.run_io(lambda: fill("v"), views, "loading the KV cache")
        values.then = keys.wait
        return values

    def _read(self, part, buf, which: str):
        """K (with the positions and scores) or V of a part into its compute buffer."""
        tiers, length = self.tiers, self.length
        if which == "k":
            tiers.to_device(buf.pos, part.pos)
            if buf.score is not None:
                tiers.to_device(buf.score, part.score)
        if not length:
            return
        n, capacity = buf.k.shape[0], self.shape[2]
        mem, file, dst = (part.k_mem, part.k_file, buf.k) if which == "k" else (part.v_mem, part.v_file, buf.v)
        # Slot-major, as at home: slots [0, length) are one contiguous block there and here.
        window = dst[:, :, :length].permute(2, 0, 1, 3)
        # Its own kind of buffer: on CUDA it goes back to the pool while the copy out of it may
        # still be queued on the load stream, where its next user's writes queue too.
        block = tiers.buffer((capacity, n, self.shape[0], self.width), self.stored, kind=SLOT_MAJOR)
        try:
            if file is not None:
                tiers.read_disk(file, 0, block[:length])
            else:
                tiers.to_device(block[:length], mem[:length])
            if self.compressed:
                tiers.dequantize(block[:length], window)
            else:
                tiers.copy_on_device(window, block[:length])
        finally:
            tiers.release(block)

    def store(self, views) -> Pending:
        """Writes what the step changed back home, then frees the buffers. Compressed, what the step
        wrote is quantized here, on the compute thread (in its stream's order), and only that."""
        todo = [(part, buf) for part, (_, buf) in zip(self.parts, views) if buf is not part.home]
        self.length = max(buf.length for _, buf in views)
        for part, buf in todo:
            if part.home is not None:  # the prompt's cache, computed in a buffer, goes to a home used in place
                part.home.length = buf.length
        groups = [self._quantize_written(part, buf) for part, buf in todo]

        def write():
            try:
                for (part, buf), written in zip(todo, groups):
                    self._write(part, buf, written)
            finally:  # also when a write failed: the next load must not wait for these forever
                for _, buf in todo:
                    for t in buf.tensors():
                        self.tiers.release(t)
        if todo:
            self.last_store = self.tiers.run_io(write, None, "storing the KV cache", store=True)
        return self.last_store or Pending(None)

    def _quantize_written(self, part, buf):
        """Compressed: the groups of what the step wrote, K and V (slot-major after the prompt; after
        a decode step, one per (sequence, KV head), and every filled slot of a row that took a new
        sequence), for the I/O thread to write home."""
        if not self.compressed:
            return None
        slots = buf.written
        if isinstance(slots, str):  # the prompt: every slot in use
            shape = (buf.length, buf.k.shape[0], self.shape[0], self.width)
            out = tuple(torch.empty(shape, dtype=torch.uint8, device=buf.k.device) for _ in "kv")
            for src, dst in zip((buf.k, buf.v), out):
                quantize_slot_major(src[:, :, :buf.length], dst)
            return out
        slot_groups = None
        if slots is not None:  # (a row at slot -1, not computed, gives groups that _write_slots drops)
            seq, head = slot_grid(slots)
            slot_groups = tuple(quantize(t[seq, head, slots], check=False) for t in (buf.k, buf.v))
        rows = [tuple(quantize(t[r, :, :buf.length].transpose(0, 1), check=False) for t in (buf.k, buf.v))
                for r in buf.refilled]
        return slot_groups, rows

    def _write(self, part, buf, groups):
        tiers, slots = self.tiers, buf.written
        state = [(part.pos, buf.pos)] + ([(part.score, buf.score)] if buf.score is not None else [])
        if isinstance(slots, str):  # the prompt: every slot in use, its copies queued together
            tiers.to_host_all(state + self._prompt_copies(part, buf, groups))
            return
        tiers.to_host_all(state)
        slot_groups, row_groups = groups or (None, None)
        if slots is not None:  # None: no decode call wrote (every row of the gpu-batch was refilled)
            self._write_slots(part, buf, slots, slot_groups)
        for n, r in enumerate(buf.refilled):  # rows that took a new sequence: all their slots in use
            self._write_row(part, buf, r, row_groups[n] if row_groups else None)

    def _write_slots(self, part, buf, slots, groups):
        """One slot per (sequence, KV head), as a decode step wrote them."""
        tiers = self.tiers
        n, kv_heads = slots.shape
        written = tiers.host(slots)
        seq, head = (t.expand(n, kv_heads) for t in slot_grid(written))
        values = [tiers.host(g) for g in groups] if groups else [tiers.gather_slots(src, slots) for src in (buf.k, buf.v)]
        kept = written >= 0  # -1: a row the step did not compute (slot_pool.py leaves stopped rows out)
        if not bool(kept.all()):
            written, seq, head = written[kept], seq[kept], head[kept]
            values = [data[kept] for data in values]
        if part.k_file is None:
            for mem, data in zip((part.k_mem, part.v_mem), values):
                mem[written, seq, head] = data
            return
        # Disk: the row of (slot, sequence, head) in the slot-major file, written in runs of neighbours.
        rows = (written * (n * kv_heads) + seq * kv_heads + head).flatten()
        order = rows.argsort()
        for file, data in zip((part.k_file, part.v_file), values):
            tiers.disk.write_rows(file, rows[order], data.reshape(rows.shape[0], -1)[order])  # [entries, width]

    def _write_row(self, part, buf, r: int, groups):
        """Slots [0, length) of sequence r, every KV head (slot-major: [length, kv_heads, width])."""
        tiers, length = self.tiers, buf.length
        values = [tiers.host(g) for g in groups] if groups else \
            [tiers.host(src[r, :, :length].transpose(0, 1).contiguous()) for src in (buf.k, buf.v)]
        if part.k_file is None:
            for mem, data in zip((part.k_mem, part.v_mem), values):
                mem[:length, r] = data
            return
        n, kv_heads = buf.k.shape[0], self.shape[0]
        slot = torch.arange(length)[:, None]
        rows = (slot * (n * kv_heads) + r * kv_heads + torch.arange(kv_heads)[None, :]).flatten()
        for file, data in zip((part.k_file, part.v_file), values):
            tiers.disk.write_rows(file, rows, data.flatten(0, 1))  # [length * kv_heads, width]

    def _prompt_copies(self, part, buf, groups) -> list:
        """The (home, computed) pairs of the prompt's K and V that go to CPU memory; a disk part's
        are written here."""
        length = buf.length
        if part.home is not None:  # a home the CPU attends over (cpu_cache_compute)
            return [(home[:, :, :length], computed[:, :, :length])
                    for computed, home in ((buf.k, part.home.k), (buf.v, part.home.v))]
        copies = []
        for i, (src, mem, file) in enumerate(((buf.k, part.k_mem, part.k_file), (buf.v, part.v_mem, part.v_file))):
            slot_major = groups[i] if groups else src[:, :, :length].permute(2, 0, 1, 3)
            if file is not None:
                self.tiers.write_disk(file, 0, slot_major)
            else:
                copies.append((mem[:length], slot_major))
        return copies

    def wait_store(self):
        """Waits for the last write-back (raising its error if it failed)."""
        if self.last_store is not None:
            self.last_store.wait()

    def close(self):
        """Waits for the last write-back (its buffers go back to the pool) and frees the home. A
        write-back that failed has noted its error as the run's (tiers.failure), which the engine
        raises; one cancelled by tiers.abandon never ran."""
        with suppress(Exception):
            self.wait_store()
        self.last_store = None
        parts, self.parts = self.parts, []  # closing again frees nothing twice
        for part in parts:
            if part.home is not None:
                self.tiers.free(part.tier, part.home.tensors())
                continue
            self.tiers.free("cpu", [part.k_mem, part.v_mem, part.pos, part.score])
            if part.tier == "disk":
                self.tiers.track("disk", -(part.k_file.nbytes + part.v_file.nbytes))
                self.tiers.disk.remove(part.k_file)
                self.tiers.disk.remove(part.v_file)
