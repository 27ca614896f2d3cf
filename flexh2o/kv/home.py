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
"""

from dataclasses import dataclass

import torch

from ..tiers import TIERS, Pending
from .cache import KVCache, slot_grid


def batch_split(batch: int, gpu_percent: float, cpu_percent: float) -> dict:
    """Sequences per tier for a gpu-batch: the cache percentages applied along the batch."""
    gpu = round(batch * gpu_percent / 100)
    cpu = min(batch - gpu, round(batch * cpu_percent / 100))
    return {"gpu": gpu, "cpu": cpu, "disk": batch - gpu - cpu}


@dataclass
class CachePart:
    rows: slice
    tier: str
    home: KVCache | None = None  # gpu / cpu
    k_file: object = None        # disk: K and V in files, positions and scores in CPU memory
    v_file: object = None
    pos: torch.Tensor | None = None
    score: torch.Tensor | None = None
    in_place: bool = False       # the compute device attends over the home itself


class CacheHome:
    def __init__(self, tiers, batch, kv_heads, head_dim, capacity, with_score: bool, rows: dict,
                 compute_on_cpu: bool = False):
        self.tiers, self.shape, self.with_score = tiers, (kv_heads, head_dim, capacity), with_score
        self.parts, start = [], 0
        for tier in TIERS:
            n = rows.get(tier, 0)
            if n == 0:
                continue
            if tier == "disk":
                nbytes = capacity * n * kv_heads * head_dim * tiers.dtype.itemsize
                part = CachePart(slice(start, start + n), tier, k_file=tiers.disk.create(nbytes),
                                 v_file=tiers.disk.create(nbytes))
                part.pos, part.score = KVCache.allocate_state(tiers, n, kv_heads, capacity, with_score, "cpu")
                tiers.track("disk", 2 * nbytes)
            else:
                part = CachePart(slice(start, start + n), tier,
                                 KVCache.allocate(tiers, n, kv_heads, head_dim, capacity, with_score, tier))
                part.pos, part.score = part.home.pos, part.home.score
            # On CUDA a CPU-resident part is attended over on the CPU itself under cpu_cache_compute.
            part.in_place = tier == "gpu" or (tier == "cpu" and (not tiers.on_cuda or compute_on_cpu))
            self.parts.append(part)
            start += n
        self.length = 0       # slots in use, as of the last store
        self.last_store = None

    def load(self) -> Pending:
        """The compute-side KVCache of every part: [(rows, KVCache)]."""
        views, todo = [], []
        kv_heads, head_dim, capacity = self.shape
        for part in self.parts:
            if part.in_place:
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

        def fill():
            if previous is not None:
                previous.wait()
            for part, buf in todo:
                self._read(part, buf)
        return self.tiers.run_io(fill, views) if todo else Pending(views)

    def _read(self, part, buf):
        length = self.length
        self.tiers.copy_to_compute(buf.pos, part.pos)
        if buf.score is not None:
            self.tiers.copy_to_compute(buf.score, part.score)
        if not length:
            return
        if part.tier == "cpu":
            self.tiers.copy_to_compute(buf.k[:, :, :length], part.home.k[:, :, :length])
            self.tiers.copy_to_compute(buf.v[:, :, :length], part.home.v[:, :, :length])
            return
        n, (kv_heads, head_dim, capacity) = buf.k.shape[0], self.shape
        for file, dst in ((part.k_file, buf.k), (part.v_file, buf.v)):
            stage = self.tiers.buffer((capacity, n, kv_heads, head_dim), tier="cpu")  # slot-major, as on disk
            self.tiers.disk.read(file, 0, stage[:length])
            self.tiers.copy_to_compute(dst[:, :, :length], stage[:length].permute(1, 2, 0, 3))
            self.tiers.release(stage)

    def store(self, views) -> Pending:
        """Writes what the step changed back home, then frees the buffers."""
        todo = [(part, buf) for part, (_, buf) in zip(self.parts, views) if not part.in_place]
        self.length = views[0][1].length

        def write():
            for part, buf in todo:
                self._write(part, buf)
                for t in buf.tensors():
                    self.tiers.release(t)
        if todo:
            self.last_store = self.tiers.run_io(write, None)
        return self.last_store or Pending(None)

    def _write(self, part, buf):
        home, slots = part.home, buf.written
        self.tiers.to_cpu(buf.pos, part.pos)
        if buf.score is not None:
            self.tiers.to_cpu(buf.score, part.score)
        if isinstance(slots, str):  # the prompt: every slot in use
            if part.tier == "cpu":
                for src, dst in ((buf.k, home.k), (buf.v, home.v)):
                    self.tiers.to_cpu(src[:, :, :buf.length], dst[:, :, :buf.length])
            else:
                for src, file in ((buf.k, part.k_file), (buf.v, part.v_file)):
                    self.tiers.write_disk(file, 0, src[:, :, :buf.length].permute(2, 0, 1, 3))
            return
        n, kv_heads = slots.shape
        seq, head = slot_grid(slots)
        if part.tier == "cpu":
            for src, dst in ((buf.k, home.k), (buf.v, home.v)):
                dst[seq.cpu(), head.cpu(), slots.cpu()] = src[seq, head, slots].cpu()
            return
        # Disk: the row of (slot, sequence, head) in the slot-major file, written in runs of neighbours.
        rows = (slots * (n * kv_heads) + seq * kv_heads + head).flatten()
        order = rows.argsort()
        rows = rows[order].cpu()
        for src, file in ((buf.k, part.k_file), (buf.v, part.v_file)):
            data = src[seq, head, slots].flatten(0, 1)[order].cpu()  # [n * kv_heads, head_dim]
            self.tiers.disk.write_rows(file, rows, data)

    def close(self):
        """Waits for the last write-back (its buffers go back to the pool) and frees the home."""
        if self.last_store is not None:
            self.last_store.wait()
        for part in self.parts:
            held = part.home.tensors() if part.home is not None else [part.pos, part.score]
            self.tiers.track("cpu" if part.tier == "disk" else part.tier,
                             -sum(t.numel() * t.element_size() for t in held if t is not None))
            if part.tier == "disk":
                self.tiers.track("disk", -(part.k_file.nbytes + part.v_file.nbytes))
                self.tiers.disk.remove(part.k_file)
                self.tiers.disk.remove(part.v_file)
