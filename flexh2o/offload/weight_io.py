"""Weights on the tiers: placed by rows, loaded into compute buffers (a mixin of Tiers).

A tensor is placed by rows of its first dimension: some rows on the gpu tier, some in CPU memory,
the rest on disk, so each tier gets the share of bytes the policy asks for. Loading assembles the
rows into a reusable compute buffer; with overlap on, that work runs on the I/O threads and the
caller gets a `Pending` to wait on. Where the compute device is the CPU, a tensor held whole by
the gpu or cpu tier is used in place, never copied. A compressed tensor (quant.py) is placed, and
moved, as its uint8 groups, and dequantized into a compute buffer at the end of every load; where
the CPU computes in bfloat16, a matrix placed in the int4 kernel's layout (int4_tiles.py) is handed
over as it is, to be multiplied as stored (models/linear.py), and so is, in float32, a matrix in
quant.py's groups that flexh2o's own kernel takes (grouped_weight.py). The
moves themselves (run_io, to_device, copy_on_device, read_disk) and the buffer pool are Tiers'.
"""

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from flexh2o import native
from flexh2o.compression import gpu_dequant, int4_tiles
from flexh2o.offload.buffers import TIERS
from flexh2o.compression.grouped_weight import GroupedWeight
from flexh2o.compression.int8_activations import FORMATS as INT8_FORMATS
from flexh2o.offload.io_tasks import IOTaskError, Pending
from flexh2o.offload.placed import Placed, Segment
from flexh2o.compression.quant import Packed, dequantize_as, quantize
from flexh2o.offload.held_weights import most_held
from flexh2o.compression.kernel_choice import kernel_for, multiplied_as_stored


class WeightIO:
    def as_stored_kernel(self, shape, fmt: str = "groups") -> str | None:
        """The kernel that multiplies a compressed matrix of this shape as it is (kernel_choice.py)."""
        return kernel_for(shape, self.dtype, not self.on_cuda, native.library() is not None, fmt)

    def multiplied_as_stored(self, placed: Placed) -> bool:
        """Whether a compressed matrix is multiplied as stored at every row count: no compute
        buffer of its values is made (Placed.any_rows, where flexh2o's kernel takes it)."""
        return placed.any_rows and not placed.tiled and \
            multiplied_as_stored(placed.decoded_shape, self.dtype, not self.on_cuda, placed.fmt)

    def tiles_for(self, shape) -> bool:
        """Whether a compressed matrix of this shape is placed in the int4 kernel's layout."""
        return self.as_stored_kernel(shape) == "tiles"

    def place(self, tensor: torch.Tensor, rows: dict, compressed: bool = False, tiled: bool = False) -> Placed:
        """Puts a tensor's rows at their home tiers (rows: tier -> number of rows, in tier order),
        as 4-bit groups when compressed (ValueError if it holds inf, NaN or values beyond float16),
        in the int4 kernel's layout when tiled (the same bytes)."""
        fmt = "groups"
        if isinstance(tensor, Packed):  # already low-bit
            decoded, fmt, tensor = tensor.shape, tensor.fmt, tensor.groups
        else:
            if not (compressed and self.dtype == torch.float32):  # quantize reads any width in float32
                tensor = tensor.to(self.dtype)
            decoded = tuple(tensor.shape) if compressed else None
            if compressed:
                tensor = quantize(tensor)
        if tiled:
            tensor = int4_tiles.pack(tensor, decoded[-1])
        segments, start = [], 0
        for tier in TIERS:
            n = rows.get(tier, 0)
            if n == 0:
                continue
            part = tensor[start: start + n].contiguous()
            seg = Segment(tier, start, start + n)
            if tier == "disk":
                seg.file = self.disk.create(part.numel() * part.element_size())
                self._write_placed(seg.file, part, behind=decoded is not None)
                self.reserve_staging(seg.file.nbytes)
                self.track("disk", seg.file.nbytes)
            elif decoded is not None and n == len(tensor) and not self.on_cuda:
                # Groups made for this placing, held whole in RAM: kept as they are, not copied
                # (a copy doubled loading's peak for a table as large as an embedding).
                seg.data = part
                self.track(tier, part.numel() * part.element_size())
            else:
                seg.data = self.alloc(tier, part.shape, tensor.dtype)
                seg.data.copy_(part)
            segments.append(seg)
            start += n
        return Placed(tuple(tensor.shape), tensor.dtype, segments, decoded, tiled, fmt)

    def _write_placed(self, file, part: torch.Tensor, behind: bool):
        """Writes a placed tensor's disk rows. 4-bit groups (behind) are written in turn by one
        thread while the caller reads and quantizes the next layers' tensors: one after the other,
        quantizing and writing took as long as each other."""
        if not behind:
            self.disk.write(file, 0, part)
            return
        if self._placer is None:
            self._placer = ThreadPoolExecutor(1, thread_name_prefix="flexh2o-place")
        if not self._placing:  # placed outside a layer's placing
            self._placing.append([])
        self._placing[-1].append(self._placer.submit(self.disk.write, file, 0, part))

    def start_placing_layer(self):
        """Before a layer's tensors are placed: waits for the writes of the layers before it but the
        last, so loading holds two layers' groups beyond the one placed at most (preflight.load_transient
        counts them). Waiting for the last layer's too left the writer idle while a small layer (attention)
        was quantized after a large one (MLP)."""
        self._wait_placed(keep=1)
        self._placing.append([])

    def finish_placing(self):
        """Waits for the placed groups' writes still out (raising the first error)."""
        self._wait_placed(keep=0)

    def _wait_placed(self, keep: int):
        while len(self._placing) > keep:
            writes = self._placing.pop(0)
            wait(writes)
            for write in writes:
                write.result()

    def stop_placing(self):
        """Waits for the writes still out, whatever became of them (their files may be removed
        next), and ends the writer's thread."""
        wait([write for writes in self._placing for write in writes])
        self._placing = []
        if self._placer is not None:
            self._placer.shutdown()
            self._placer = None

    # -- loading ----------------------------------------------------------------------------
    def used_in_place(self, placed: Placed) -> bool:
        """Whether compute reads `placed` where it lives: held whole by memory the compute device
        uses, and not compressed. Loading it then moves nothing."""
        return placed.decoded_shape is None and self._in_place(placed)

    def loads_once(self, placed: Placed) -> bool:
        """Whether a load of `placed` hands over the same thing at every token, so that a layer can
        load it once and keep it: a weight used in place, or, where the CPU computes, a compressed
        matrix held in memory that flexh2o's kernel multiplies as it is (the buffer of its widened
        values, for a step of many rows, is taken only then and given back at release_loaded)."""
        if self.used_in_place(placed):
            return True
        return not self.on_cuda and placed.decoded_shape is not None and not placed.tiled and \
            self._in_place(placed) and self.as_stored_kernel(placed.decoded_shape, placed.fmt) == "groups"

    def _in_place(self, placed: Placed) -> bool:
        return placed.resident() is not None and (placed.segments[0].tier == "gpu" or not self.on_cuda)

    def pooled(self, placed: Placed) -> list[tuple]:
        """(shape, dtype, per I/O thread) of each pooled buffer that load(placed) takes: the values
        of a weight not used in place, and the groups of a compressed one moved (on CUDA an I/O
        thread gives its groups' buffer back once their dequantizing is queued, so one per thread is made)."""
        in_place = self._in_place(placed)
        if placed.decoded_shape is None:
            return [] if in_place else [(placed.shape, placed.dtype, False)]
        groups = [] if in_place else [(placed.shape, placed.dtype, self.on_cuda)]
        return ([] if self.multiplied_as_stored(placed) else [(placed.decoded_shape, self.dtype, False)]) + groups

    def reserve_loads(self, layers):
        """Makes, before a run, every pooled buffer the layers' weight loads take. The layers of each
        group of held_weights.held_together (the one computing, the next one loading, and any loaded
        ahead) hold theirs at once, so a shape gets as many as a group ever holds (the pre-flight's
        count, preflight.compute_copy_bytes). Made lazily, the largest (an LM head's) came only after
        the prompt step: a run that cannot hold them failed after its prompt."""
        counts = [Counter(key for p in layer.home[layer.gathered:] for key in self.pooled(p)) for layer in layers]
        for (shape, dtype, per_thread), n in most_held(counts, layers).items():
            self.reserve(shape, dtype, count=self.io_threads if per_thread else n)

    def load(self, placed: Placed) -> Pending:
        """The compute-device tensor of `placed`: the resident tensor itself, or a filled buffer."""
        whole = placed.resident()
        in_place = self._in_place(placed)
        if placed.decoded_shape is not None:
            return self._load_compressed(placed, whole if in_place else None)
        if in_place:
            return Pending(whole)
        buf = self.buffer(placed.shape, placed.dtype)
        return self.run_io(lambda: self.fill(buf, placed.segments), buf, "loading weights")

    def load_all(self, placed: list) -> list[Pending]:
        """load() of each; on CUDA those moved from memory alone go as one I/O task, whose copies
        are queued back to back under one event: per tensor, a task's hand-off and events cost the
        I/O thread more than a bias takes to copy, and left the copy engine idle between them.
        Tensors read from disk keep a task each, so that two threads read at once."""
        grouped = [self.on_cuda and p.decoded_shape is None and not self._in_place(p) and
                   all(seg.tier != "disk" for seg in p.segments) for p in placed]
        if sum(grouped) < 2:
            return [self.load(p) for p in placed]
        buffers = {i: self.buffer(p.shape, p.dtype) for i, p in enumerate(placed) if grouped[i]}
        together = self.run_io(lambda: [self.fill(buffers[i], placed[i].segments) for i in buffers], None,
                               "loading weights")
        return [Pending(buffers[i], then=together.wait) if i in buffers else self.load(p) for i, p in enumerate(placed)]

    def gather_rows(self, placed: Placed, ids: torch.Tensor, on_device: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (a CPU tensor of row indices, any shape) of a placed matrix, as a compute-device
        tensor [*ids.shape, columns]: an embedding's lookup, where only the rows looked up move,
        each once, on the compute thread (a few rows: no I/O task, no pooled buffer). A matrix
        used in place is simply indexed, by on_device (ids on the compute device) where given: no
        copy from the host, which a CUDA graph could not replay."""
        if self.used_in_place(placed):
            return placed.resident()[on_device if on_device is not None else ids.to(self.compute)]
        whole = placed.resident()
        if whole is not None and not self.on_cuda and placed.decoded_shape is not None:
            # compressed in CPU memory, where the CPU computes: each row's bytes looked up and widened,
            # without the sorting and sharing-out below (a score of torch operations for a decode
            # step's few rows)
            flat = ids.flatten()
            picked = whole[flat]
            self.count_h2d(picked[:len(set(flat.tolist()))])  # each row once, as below
            values = torch.empty(len(flat), placed.decoded_shape[1], dtype=self.dtype)
            return dequantize_as(picked, placed.fmt, values.shape[-1], values).view(*ids.shape, -1)
        rows, inverse = torch.unique(ids.flatten(), return_inverse=True)  # sorted
        picked = torch.empty(len(rows), placed.shape[1], dtype=placed.dtype)
        on_device = []  # (positions in `rows`, the rows themselves) of a segment on the compute device
        for seg in placed.segments:
            inside = ((rows >= seg.start) & (rows < seg.stop)).nonzero().flatten()
            if not len(inside):
                continue
            local = rows[inside] - seg.start
            if seg.tier == "gpu" and self.on_cuda:
                on_device.append((inside, seg.data[local.to(self.compute)]))
            elif seg.tier == "disk":
                got = torch.empty(len(local), placed.shape[1], dtype=placed.dtype)
                try:
                    self.disk.read_rows(seg.file, local, got)
                except OSError as e:
                    raise IOTaskError("loading weights", e) from e
                picked[inside] = got
            else:
                picked[inside] = seg.data[local]
        moved = len(rows) - sum(len(inside) for inside, _ in on_device)
        self.count_h2d(picked[:moved])  # the rows not on the device already (their bytes, whichever they are)
        picked = picked.to(self.compute)
        for inside, data in on_device:
            picked[inside.to(self.compute)] = data
        if placed.decoded_shape is not None:
            values = torch.empty(len(rows), placed.decoded_shape[1], dtype=self.dtype, device=self.compute)
            if self.on_cuda:  # the compute stream's: a workspace of its own, made for this call (a few rows)
                picked = gpu_dequant.dequantize(picked, placed.fmt, values)
            else:
                picked = dequantize_as(picked, placed.fmt, values.shape[-1], values)
        return picked[inverse.to(self.compute)].view(*ids.shape, -1)

    def _load_compressed(self, placed: Placed, whole) -> Pending:
        """Its groups, moved to the compute device unless they are there, dequantized into a buffer
        (none for a matrix never widened)."""
        if not self.on_cuda:
            return self._load_compressed_for_cpu(placed, whole)
        out = None if self.multiplied_as_stored(placed) else self.buffer(placed.decoded_shape)
        fmt = placed.fmt
        if whole is None:
            # Its groups go through a buffer that the I/O task gives back once their dequantizing is
            # queued: at most one per thread is out at once, all made up front (later, timing would
            # decide). Given back with the kernel still to run is safe: only weight loads take 2-D
            # uint8 buffers, and they fill them on the load stream, which runs that kernel first.
            self.reserve(placed.shape, placed.dtype, count=self.io_threads)

        def task():
            if whole is not None:
                self.dequantize(whole, out, fmt)
                return
            packed = self.buffer(placed.shape, placed.dtype)
            try:
                self.fill(packed, placed.segments)
                self.dequantize(packed, out, fmt)
            finally:
                self.release(packed)
        return self.run_io(task, out, "loading compressed weights")

    def _load_compressed_for_cpu(self, placed: Placed, whole) -> Pending:
        """Where the CPU computes, the compute thread dequantizes, when it waits for the load: on an
        I/O thread the dequantizing took cores from the compute's own threads (opt-350m, 4-bit
        weights on disk: decode as slow as with overlap off, the dequantizing itself 2.5x slower).
        The groups' buffer is taken and given back on the compute thread, in program order, so
        how many the pool makes does not depend on timing."""
        if placed.tiled or self.as_stored_kernel(placed.decoded_shape, placed.fmt) == "groups":
            # multiplied as it is: nothing to dequantize now (models/linear.py); the buffer of its
            # values is taken when a step of many rows first widens it
            k = placed.decoded_shape[-1]
            take = None if self.multiplied_as_stored(placed) else lambda: self.buffer(placed.decoded_shape)

            def as_stored(data):
                if placed.tiled:
                    return int4_tiles.TiledWeight(data, k, take and take())
                return GroupedWeight(data, k, take, placed.fmt, self.int8_activations and placed.fmt in INT8_FORMATS)
            if whole is not None:
                return Pending(as_stored(whole))
            packed = self.buffer(placed.shape, placed.dtype)
            return self.run_io(lambda: self.fill(packed, placed.segments), as_stored(packed),
                               "loading compressed weights")
        out = self.buffer(placed.decoded_shape)
        if whole is not None:  # nothing to move: no I/O task at all
            return Pending(out, then=lambda: self.dequantize(whole, out, placed.fmt))
        packed = self.buffer(placed.shape, placed.dtype)

        def fill():
            try:
                self.fill(packed, placed.segments)
            except BaseException:  # finish() will not run: the groups' buffer goes back here
                self.release(packed)
                raise

        def finish():
            self.dequantize(packed, out, placed.fmt)
            self.release(packed)
        pending = self.run_io(fill, out, "loading compressed weights")
        pending.then = finish
        return pending

    def release_loaded(self, value, placed: Placed):
        """Gives back the buffers a load of `placed` took: its compute buffer, or a tiled weight's
        values and (where its bytes were moved) the buffer holding them; nothing for a weight
        used where it lives."""
        if isinstance(value, (int4_tiles.TiledWeight, GroupedWeight)):
            values = value.hand_back() if isinstance(value, GroupedWeight) else value.values
            if values is not None:
                self.release(values)
            if value.data is not placed.resident():
                self.release(value.data)
        elif value is not placed.resident():
            self.release(value)

    def dequantize(self, packed: torch.Tensor, out: torch.Tensor, fmt: str = "groups"):
        """out <- the values of `packed` (in format `fmt`, quant.Packed), on the device both are on.
        On CUDA one fused kernel (gpu_dequant.py), queued on the load stream after the loads queued
        there before it and left in flight with them: the I/O thread goes on to the next load."""
        start = time.perf_counter()
        if self.on_cuda:  # where both always are on CUDA: only compute buffers are dequantized into
            self.cuda.on_device(lambda: gpu_dequant.dequantize(packed, fmt, out, self.dequant_space))
        else:
            dequantize_as(packed, fmt, out.shape[-1], out)
        self.count_dequant(time.perf_counter() - start)

    def count_dequant(self, seconds: float):
        with self._lock:
            self.dequant_seconds += seconds

    def fill(self, buf: torch.Tensor, segments: list):
        for seg in segments:
            rows = buf[seg.start: seg.stop]
            if seg.tier == "disk":
                self.read_disk(seg.file, 0, rows)
            elif seg.tier == "gpu":
                self.copy_on_device(rows, seg.data)
            else:
                self.to_device(rows, seg.data)
