"""The interface every layer offers the schedule (docs/design.md, "The layer interface").

The schedule drives input embedding, attention, MLP and output embedding through the same
operations and never asks what kind of layer it holds.
"""

import functools

import torch

from flexh2o import native
from flexh2o.common.errors import UsageError
from flexh2o.compression.gguf_blocks import is_low_bit, keeps_16_bit, keeps_low_bit
from flexh2o.compression.quant import Packed, compressible, join, quantize, stored_row_bytes
from flexh2o.offload.placed import split_rows


def quantized(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> Packed:
    """A checkpoint matrix as 4-bit groups, quantized as read, before prepare() joins any (groups are
    rows: joining them is joining the matrices, in a quarter of the bytes or less). Its values are
    rounded to the compute dtype first, except in float32, which holds every width exactly."""
    try:
        return Packed(quantize(tensor if dtype == torch.float32 else tensor.to(dtype)), tuple(tensor.shape))
    except ValueError as e:
        raise UsageError("--compress-weight", f"weight {name}: {e}") from None


@functools.cache
def format_table(stored_formats: tuple) -> dict:
    """A spec's (name, format) pairs as a lookup, made once per spec: the pre-flight asks every
    layer for its formats at every placement it tries (preflight.per_layer)."""
    return dict(stored_formats)


def place_once(tiers, name: str | None, tensor, rows: dict, compressed: bool, tiled: bool):
    """tiers.place, except that checkpoint tensor `name`, placed before with the same rows and layout
    (a tied LM head and its token embedding, both in memory), is that same placed tensor: held once."""
    key = (name, tuple(rows.items()), compressed, tiled) if name is not None else None
    if key in tiers.placed_by_name:
        return tiers.placed_by_name[key]
    placed = tiers.place(tensor, rows, compressed, tiled)
    if key is not None:
        tiers.placed_by_name[key] = placed
    return placed


class Layer:
    """Base class: weights listed by checkpoint name, placed once, loaded once per token."""

    # The first `gathered` weights are tables looked up by rows (an embedding): never loaded whole,
    # forward gathers the rows it needs (Tiers.gather_rows). A tied table is then moved once per
    # token, by the LM head, and an input embedding moves a row per token instead of the vocabulary.
    gathered = 0

    # A layer of its own kind (the LM head) sits on the compute device whatever the weight shares:
    # elsewhere, its loads would need a compute buffer as large as itself, held for the whole run
    # (in real models no other layer's weights share its shapes), and every token would move it too.
    # Compressed or 16-bit, it is multiplied as stored at every row count (a row per sequence; its
    # Placed.any_rows): a float32 copy of it would cost as much memory as it saves.
    one_of_a_kind = False

    @functools.cached_property
    def looks_up_only(self) -> bool:
        """Whether every weight is a gathered table: a step reads a few rows, nothing whole (asked
        for every layer at every token step: kept)."""
        return self.gathered == len(self.weight_specs())

    @property
    def cpu_kernels(self):
        """flexh2o's C kernels (native/) where this run computes on the CPU; None on CUDA, where
        the layers' tensors are the device's (and a simulated device's CPU tensors must see torch's
        operations), or where there are no kernels."""
        return None if self.tiers.on_cuda else native.library()

    def weight_shares(self, policy) -> tuple[float, float]:
        """(gpu, cpu): the percentages of this layer's bytes placed on the gpu tier and in CPU memory."""
        return (100, 0) if self.one_of_a_kind else (policy.w_gpu_percent, policy.w_cpu_percent)

    def weight_specs(self) -> list[tuple[str, tuple]]:
        """(checkpoint name, shape) of every weight this layer reads."""
        raise NotImplementedError

    def stored_formats(self) -> tuple:
        """Per weight, the GGUF block format its file keeps it in (gguf_blocks.py), or None."""
        formats = format_table(getattr(getattr(self, "spec", None), "stored_formats", ()))
        return tuple(formats.get(name) for name, _ in self.weight_specs())

    def prepare(self, tensors: list, cat=torch.cat) -> list:
        """Turns checkpoint tensors into the ones forward uses (e.g. fusing q/k/v), joining them only
        with `cat` (the pre-flight passes shapes and a cat of shapes, preflight.stored_shapes)."""
        return tensors

    def init_weight(self, source, tiers, policy):
        """Reads this layer's weights and places them: weight_shares() of the layer's bytes on the
        gpu tier and in CPU memory, the rest on disk (split by rows); with
        compress_weight, matrices are placed as 4-bit groups and these shares are of compressed bytes
        (so are a GGUF file's low-bit matrices, kept as their blocks in a float32 run)."""
        self.tiers = tiers
        # A float32 run keeps a GGUF file's low-bit matrices as their blocks (gguf_blocks.py);
        # --compress-weight quantizes the other matrices too.
        low_bit = keeps_low_bit(tiers.dtype.itemsize)
        packed = getattr(source, "get_packed", None) if policy.compress_weight or low_bit else None
        # Quantized for a float32 run, a checkpoint's 16-bit matrix is read as it is stored (widening is exact).
        as_stored = getattr(source, "get_as_stored", None) if policy.compress_weight and tiers.dtype == torch.float32 \
            else None
        sixteen_bit = getattr(source, "get_sixteen_bit", None) \
            if keeps_16_bit(policy, tiers.dtype.itemsize) else None
        raw = []
        for (name, shape), fmt in zip(self.weight_specs(), self.stored_formats()):
            wanted = policy.compress_weight or low_bit and is_low_bit(fmt)
            tensor = packed(name, shape, tiers.dtype) if packed is not None and wanted and compressible(shape) else None
            if tensor is None and as_stored is not None and compressible(shape):
                tensor = as_stored(name, shape)
            if tensor is None and sixteen_bit is not None and compressible(shape):
                tensor = sixteen_bit(name, shape)
            tensor = tensor if tensor is not None else source.get(name, shape, tiers.dtype)
            if policy.compress_weight and compressible(shape) and not isinstance(tensor, Packed):
                tensor = quantized(name, tensor, tiers.dtype)
            raw.append(tensor)
        tensors = self.prepare(raw, cat=functools.partial(join, lossless=not policy.compress_weight))
        compressed = [isinstance(t, Packed) or policy.compress_weight and compressible(t.shape) for t in tensors]
        row_bytes = [t.groups[0].numel() if isinstance(t, Packed) else stored_row_bytes(t.shape, tiers.dtype.itemsize, c)
                     for t, c in zip(tensors, compressed)]
        rows = split_rows([tuple(t.shape) for t in tensors], row_bytes, *self.weight_shares(policy))
        # Matrices of quant.py's groups loaded whole (not the gathered tables) go in the int4 kernel's
        # layout where it applies.
        tiled = [c and i >= self.gathered and t.fmt == "groups" and tiers.tiles_for(tuple(t.shape))
                 for i, (t, c) in enumerate(zip(tensors, compressed))]
        tiers.start_placing_layer()
        names = {id(r): name for (name, _), r in zip(self.weight_specs(), raw)}  # for tensors prepare() kept as read
        self.home = [place_once(tiers, names.get(id(t)), t, r, c, tl) for t, r, c, tl in zip(tensors, rows, compressed,
                                                                                              tiled)]
        for placed in self.home if self.one_of_a_kind else ():
            placed.any_rows = True
        self._loading = None
        # Weights all used where they live (or multiplied where they live: WeightIO.loads_once):
        # every token's "load" is this same list, nothing moves.
        loaded = self.home[self.gathered:]
        self._in_place = [tiers.load(h) for h in loaded] if all(tiers.loads_once(h) for h in loaded) else None
        self._may_widen = None  # (home, weight as loaded) of each weight in place that a step of many rows widens

    @property
    def weights_in_place(self) -> bool:
        """Whether every weight but the gathered tables is used where it lives: no step loads any."""
        return len(self.home) == self.gathered or self._in_place is not None

    @property
    def weights_kept(self) -> list:
        """The weights every step uses as they are, where weights_in_place (loaded once for the run)."""
        return [p.wait() for p in self._in_place or ()]

    def load_weight(self, k: int):
        """Starts bringing the weights to the compute device; once per token, at gpu-batch 0."""
        if k == 0:
            self._loading = self._in_place or self.tiers.load_all(self.home[self.gathered:])

    @property
    def weights(self) -> list[torch.Tensor]:
        """The loaded weights (all but the gathered tables)."""
        return [p.wait() for p in self._loading]

    def rows(self, index: int, ids: torch.Tensor, on_device: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (a CPU tensor; on_device: the same on the compute device, if it is there) of
        gathered table `index`, on the compute device: [*ids.shape, columns]."""
        return self.tiers.gather_rows(self.home[index], ids, on_device)

    def wait_inputs(self, k: int):
        """Blocks until this layer's weights (and cache of gpu-batch k) are on the compute device."""
        for pending in self._loading:
            pending.wait()

    def release_weight(self):
        """Hands the compute copies back to the buffer pool once the block's last gpu-batch is done
        (of weights kept loaded, the buffers that a step of many rows widened them into)."""
        if self._loading is None:
            return
        if self._loading is not self._in_place:
            loaded = [(home, p.wait()) for home, p in zip(self.home[self.gathered:], self._loading)]
        else:  # kept loaded: only a weight that widens holds a buffer, and only once a step widened it
            if self._may_widen is None:  # (a GroupedWeight's `values` is None until then)
                kept = [(home, p.wait()) for home, p in zip(self.home[self.gathered:], self._in_place)]
                self._may_widen = [(home, value) for home, value in kept if getattr(value, "widens", False)]
            loaded = [(home, value) for home, value in self._may_widen if getattr(value, "values", True) is not None]
        for home, value in loaded:
            self.tiers.release_loaded(value, home)
        self._loading = None

    def init_cache(self, batch_sizes: list[int], kv, policy, refills: bool = False):
        """Allocates per-gpu-batch KV cache slots at the capacity of `kv`, this layer's KV policy
        (attention layers only)."""

    def free_cache(self):
        pass

    def load_cache(self, i: int, k: int):
        pass

    def store_cache(self, i: int, k: int):
        pass

    def wait_stores(self):
        """Blocks until every cache store queued so far is done (raising a failed one's error)."""

    def forward(self, hidden, step):
        raise NotImplementedError
