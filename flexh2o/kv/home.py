"""The KV cache of one (layer, gpu-batch) at its home tiers, split along the batch.

Sequences [0, a) keep their cache on the compute device, [a, b) in CPU memory, [b, batch) on
disk. A part held in memory the compute device can use is attended over in place; any other part
is loaded into a pooled compute buffer before the step and its new slots are written back after.
On disk, K and V are stored slot-major ([capacity, rows, heads, head_dim]) so that the slots of
one step are one contiguous write.
"""

from dataclasses import dataclass

import torch

from ..tiers import TIERS, Pending
from .cache import KVCache


def batch_split(batch: int, gpu_percent: float, cpu_percent: float) -> dict:
    """Sequences per tier for a gpu-batch: the cache percentages applied along the batch."""
    gpu = round(batch * gpu_percent / 100)
    cpu = min(batch - gpu, round(batch * cpu_percent / 100))
    return {"gpu": gpu, "cpu": cpu, "disk": batch - gpu - cpu}


@dataclass
class CachePart:
    rows: slice
    tier: str
    home: KVCache | None = None   # gpu / cpu
    k_file: object = None         # disk
    v_file: object = None
    valid: torch.Tensor | None = None  # disk: which slots hold a token, kept in CPU memory
    in_place: bool = False        # the compute device attends over the home itself


class CacheHome:
    def __init__(self, tiers, batch, kv_heads, head_dim, capacity, rows: dict, compute_on_cpu: bool = False):
        self.tiers, self.shape = tiers, (kv_heads, head_dim, capacity)
        self.parts, start = [], 0
        for tier in TIERS:
            n = rows.get(tier, 0)
            if n == 0:
                continue
            part = CachePart(slice(start, start + n), tier)
            if tier == "disk":
                slot_bytes = n * kv_heads * head_dim * tiers.dtype.itemsize
                part.k_file = tiers.disk.create(capacity * slot_bytes)
                part.v_file = tiers.disk.create(capacity * slot_bytes)
                tiers.track("disk", 2 * capacity * slot_bytes)
                part.valid = torch.zeros(n, capacity, dtype=torch.bool)
            else:
                part.home = KVCache.allocate(tiers, n, kv_heads, head_dim, capacity, tier)
            # On CUDA a CPU-resident part is attended over on the CPU itself under cpu_cache_compute.
            part.in_place = tier == "gpu" or (tier == "cpu" and (not tiers.on_cuda or compute_on_cpu))
            self.parts.append(part)
            start += n
        self.stored = 0       # slots already written back home
        self.last_store = None

    def load(self) -> Pending:
        """The compute-side KVCache of every part: [(rows, KVCache)]."""
        views, todo = [], []
        for part in self.parts:
            if part.in_place:
                views.append((part.rows, part.home))
                continue
            n = part.rows.stop - part.rows.start
            kv_heads, head_dim, capacity = self.shape
            buf = KVCache(self.tiers.buffer((n, kv_heads, capacity, head_dim)),
                          self.tiers.buffer((n, kv_heads, capacity, head_dim)),
                          self.tiers.buffer((n, capacity), torch.bool), length=self.stored)
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
        length = self.stored
        if part.tier == "cpu":
            self.tiers.copy_to_compute(buf.valid, part.home.valid)
            if length:
                self.tiers.copy_to_compute(buf.k[:, :, :length], part.home.k[:, :, :length])
                self.tiers.copy_to_compute(buf.v[:, :, :length], part.home.v[:, :, :length])
            return
        self.tiers.copy_to_compute(buf.valid, part.valid)
        if length:
            n, (kv_heads, head_dim, capacity) = buf.k.shape[0], self.shape
            for file, dst in ((part.k_file, buf.k), (part.v_file, buf.v)):
                stage = self.tiers.buffer((capacity, n, kv_heads, head_dim), tier="cpu")  # slot-major, as on disk
                self.tiers.disk.read(file, 0, stage[:length])
                self.tiers.copy_to_compute(dst[:, :, :length], stage[:length].permute(1, 2, 0, 3))
                self.tiers.release(stage)

    def store(self, views) -> Pending:
        """Writes the slots filled since the last store back home, then frees the buffers."""
        todo = [(part, buf) for part, (_, buf) in zip(self.parts, views) if not part.in_place]
        start, stop = self.stored, views[0][1].length
        self.stored = stop

        def write():
            for part, buf in todo:
                self._write(part, buf, start, stop)
                for t in (buf.k, buf.v, buf.valid):
                    self.tiers.release(t)
        if todo:
            self.last_store = self.tiers.run_io(write, None)
        return self.last_store or Pending(None)

    def _write(self, part, buf, start, stop):
        if part.tier == "cpu":
            for src, dst in ((buf.k, part.home.k), (buf.v, part.home.v)):
                self.tiers.to_cpu(src[:, :, start:stop], dst[:, :, start:stop])
            self.tiers.to_cpu(buf.valid[:, start:stop], part.home.valid[:, start:stop])
            return
        slot_bytes = buf.k[:, :, 0].numel() * buf.k.element_size()
        for src, file in ((buf.k, part.k_file), (buf.v, part.v_file)):
            self.tiers.write_disk(file, start * slot_bytes, src[:, :, start:stop].permute(2, 0, 1, 3))
        part.valid[:, start:stop] = buf.valid[:, start:stop].cpu()

    def close(self):
        """Waits for the last write-back (its buffers go back to the pool) and frees the home."""
        if self.last_store is not None:
            self.last_store.wait()
        for part in self.parts:
            if part.home is not None:
                self.tiers.track(part.tier, -sum(t.numel() * t.element_size()
                                                 for t in (part.home.k, part.home.v, part.home.valid)))
            else:
                self.tiers.track("disk", -(part.k_file.nbytes + part.v_file.nbytes))
                self.tiers.disk.remove(part.k_file)
                self.tiers.disk.remove(part.v_file)
