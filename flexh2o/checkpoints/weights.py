"""Weight sources: a Hugging Face checkpoint directory, a GGUF file, or deterministic dummy weights.

Each hands out one tensor at a time by its checkpoint name (without the leading `model.`), in the
run's dtype, so a model larger than memory is never read whole, and a checkpoint tensor stored in
another width is not held in both (preflight.load_transient counts one layer's tensors in the run's
width; a GGUF tensor is dequantized to float32 first, unless it is kept as its own low-bit blocks:
GGUFWeights.get_packed), and a float32 run may keep a 16-bit matrix as it is (get_sixteen_bit,
gguf_blocks.keeps_16_bit). `check` validates names and shapes up front, so a wrong
checkpoint is a clear error before anything runs.
"""

import glob
import hashlib
import os
import pickle
import struct
import warnings
import zipfile

import torch

from flexh2o.common.errors import UsageError, check_regular_file
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.compression.gguf_blocks import SIXTEEN_BIT, holds
from flexh2o.compression.quant import GROUP, GROUP_BYTES, Packed, groups_buffer, quantize


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
CONVERT_BYTES = 64 << 20  # a tensor stored in another width is converted this many bytes at a time


def load_bin(file: str):
    """A torch.save file, loaded with weights_only=True: memory-mapped when it is a zip archive
    (the format since torch 1.6), read whole when it is the legacy format, which cannot be mapped."""
    with warnings.catch_warnings():  # e.g. about a raw pickle's protocol: the error, if any, says enough
        warnings.simplefilter("ignore")
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))


def is_state_dict(handle) -> bool:
    return isinstance(handle, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in handle.items())


def canonical_name(name: str) -> str:
    return name.removeprefix("model.")


def is_norm(name: str) -> bool:
    """A normalization's weight or bias: OPT's `*layer_norm.*`, Llama's `*layernorm.weight` and `norm.weight`."""
    return "layer_norm" in name or "layernorm" in name or name == "norm.weight"


MAX_HEADER = 100 << 20  # bytes of a safetensors JSON header (the safetensors package's own limit)


class DuplicateKey(Exception):
    pass


def unique_keys(pairs):
    keys = set()
    for key, _ in pairs:
        if key in keys:
            raise DuplicateKey(key)
        keys.add(key)
    return dict(pairs)


def safetensors_header(file: str, flag: str) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, its size in bytes), checked as data: a header that is
    cut short, larger than the file or MAX_HEADER, not JSON, nested too deeply or giving one key twice
    is a one-line UsageError naming the file."""
    def bad(reason):
        return UsageError(flag, f"weights file {file} is not a valid safetensors file: {reason}")
    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"it holds {len(prefix)} bytes, less than its header's 8-byte length")
            size, room = struct.unpack("<Q", prefix)[0], os.fstat(f.fileno()).st_size - 8
            if size > min(room, MAX_HEADER):
                raise bad(f"its header's length is {size} bytes, more than the {room} bytes after it"
                          if size > room else f"its header's length is {size} bytes, over {MAX_HEADER >> 20} MB")
            text = f.read(size)
    except OSError as e:
        raise UsageError(flag, f"cannot read weights file {file}: {e.strerror}") from None
    try:
        header = parse_json(text, object_pairs_hook=unique_keys)
    except DuplicateKey as e:
        raise bad(f"its header gives the key {str(e)[:100]!r} twice") from None
    except BadJson as e:
        raise bad(f"its header {e}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    return header, size


def safetensors_ranges(file: str, flag: str = "--path") -> dict:
    """name -> (offset, length) of each tensor's bytes in a safetensors file, from its JSON header."""
    header, size = safetensors_header(file, flag)
    return {name: (8 + size + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"}


def checkpoint_formats(directory: str, flag: str = "--path") -> dict:
    """canonical name -> F16 or BF16 of each 16-bit matrix of a directory's safetensors files that
    gguf_blocks takes as stored, read from their JSON headers alone. A file that is not a regular
    one is refused (naming `flag`), and so is one whose header is not valid (safetensors_header);
    entries of other shapes are left to CheckpointWeights to report."""
    out = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        check_regular_file(file, flag)
        header, _ = safetensors_header(file, flag)
        try:
            out.update({canonical_name(name): info["dtype"] for name, info in header.items()
                        if name != "__metadata__" and info["dtype"] in SIXTEEN_BIT and holds(info["dtype"], info["shape"])})
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


class CheckpointWeights:
    """safetensors shards, or `.bin` shards read with torch.load(weights_only=True) (see load_bin)."""

    def __init__(self, directory: str, flag: str = "--path"):
        self.directory, self.flag = directory, flag
        self._where = {}  # canonical name -> (file, stored name)
        self._open = {}
        self._ranges = {}  # file -> safetensors_ranges(file), for prefetch
        self._stored = None  # canonical name -> F16/BF16, made when first asked for
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        self.format = "safetensors"
        if not files:
            files = sorted(glob.glob(os.path.join(directory, "*.bin")))
            self.format = "bin"
        if not files:
            raise UsageError(flag, f"no *.safetensors or *.bin weight files in {directory}")
        for file in files:
            for name in self._names(file):
                self._where[canonical_name(name)] = (file, name)

    def _handle(self, file):
        if file not in self._open:
            self._open[file] = self._load(file)
        return self._open[file]

    def _load(self, file):
        check_regular_file(file, self.flag)
        try:
            if self.format == "safetensors":
                safetensors_header(file, self.flag)  # checked here: the package's own parser takes duplicate keys
                from safetensors import safe_open
                return safe_open(file, framework="pt")
            return load_bin(file)
        except UsageError:
            raise
        except pickle.UnpicklingError as e:
            if "GLOBAL" in str(e):  # weights_only=True met a class or function to call: never run it
                raise UsageError(self.flag, f"weights file {file} holds objects other than tensors and was "
                                 "refused") from None
            raise UsageError(self.flag, f"cannot read weights file {file}: it is corrupt or not a PyTorch "
                             "checkpoint") from None
        except Exception as e:  # a corrupt or foreign file: say which one, in one line
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(self.flag, f"cannot read weights file {file}: {reason}") from None

    def _names(self, file):
        handle = self._handle(file)
        if self.format == "bin" and not is_state_dict(handle):
            raise UsageError(self.flag, f"weights file {file} holds an object of type "
                             f"{type(handle).__name__!r}, not a dict of named tensors")
        return list(handle.keys())

    def shape(self, name: str):
        if name not in self._where:
            return None
        file, stored = self._where[name]
        handle = self._handle(file)
        if self.format == "safetensors":
            return tuple(handle.get_slice(stored).get_shape())
        return tuple(handle[stored].shape)

    def check(self, specs: list[tuple[str, tuple]]):
        missing = [n for n, _ in specs if n not in self._where]
        if missing:
            raise UsageError(self.flag, f"{self.directory} lacks {len(missing)} weight(s) the model needs, "
                             f"e.g. {missing[0]}")
        for name, want in specs:
            got = self.shape(name)
            if got != tuple(want):
                raise UsageError(self.flag, f"weight {name} in {self.directory} has shape {list(got)}, "
                                 f"expected {list(want)}")

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        file, stored = self._where[name]
        handle = self._handle(file)
        if self.format == "bin":  # memory-mapped (or a legacy file, read whole anyway): converted from the map
            return handle[stored].to(dtype)
        rows = handle.get_slice(stored)
        if rows.get_dtype() == SAFETENSORS_DTYPES.get(dtype) or not shape:
            return handle.get_tensor(stored).to(dtype)
        out = torch.empty(shape, dtype=dtype)  # converted a block of rows at a time, from the file's map
        step = max(1, CONVERT_BYTES // max(1, out[0].numel() * dtype.itemsize))
        for start in range(0, shape[0], step):
            out[start: start + step] = rows[start: start + step]
        return out

    def prefetch(self, names: list[str]):
        """Asks the kernel to start reading these tensors' bytes (readahead, a hint: it returns at
        once), so that a checkpoint not in the page cache is read from disk while the tensors
        before them are quantized and written. safetensors only: a .bin's offsets are the zip's."""
        if self.format != "safetensors":
            return
        wanted = {}
        for name in names:
            if name in self._where:
                file, stored = self._where[name]
                wanted.setdefault(file, []).append(stored)
        for file, stored in wanted.items():
            if file not in self._ranges:
                self._ranges[file] = safetensors_ranges(file, self.flag)
            fd = os.open(file, os.O_RDONLY)
            try:
                for offset, length in (self._ranges[file][s] for s in stored):
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def get_sixteen_bit(self, name: str, shape) -> Packed | None:
        """A safetensors F16/BF16 matrix as its 16-bit values, bit for bit (gguf_blocks.keeps_16_bit),
        or None (other widths, a shape the blocks do not take, .bin checkpoints: their widths are not
        known before they are read, and the pre-flight must count what is placed)."""
        fmt = self._formats().get(name)
        if fmt is None:
            return None
        file, stored = self._where[name]
        values = self._handle(file).get_tensor(stored)
        rows = groups_buffer((values.shape[0], values.shape[1] * 2))
        rows.view(values.dtype).copy_(values)
        return Packed(rows, tuple(shape), fmt)

    def stored_formats(self) -> tuple:
        """(name, format) of every matrix that can be kept as stored (gguf_blocks.py)."""
        return tuple(sorted(self._formats().items()))

    def _formats(self) -> dict:
        if self._stored is None:
            self._stored = checkpoint_formats(self.directory, self.flag) if self.format == "safetensors" else {}
        return self._stored

    def get_as_stored(self, name: str, shape) -> torch.Tensor:
        """The tensor in the file's own float width (float16, bfloat16 or float32), for a caller that
        reads any of them exactly (quant.quantize): a 16-bit checkpoint is not widened first."""
        file, stored = self._where[name]
        handle = self._handle(file)
        tensor = handle[stored] if self.format == "bin" else handle.get_tensor(stored)
        return tensor if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32) else tensor.float()

    def describe(self) -> str:
        return f"{self.directory} ({self.format})"


class GGUFWeights:
    """A GGUF file's tensors (gguf_reader.py), dequantized to float32 one at a time as they are asked for."""

    def __init__(self, path: str):
        from flexh2o.checkpoints.gguf_reader import read_gguf
        self.path, self.model = path, read_gguf(path)
        self._names = set(self.model.names())

    def check(self, specs: list[tuple[str, tuple]]):
        for name, want in specs:
            if name not in self._names:
                raise UsageError("--model", f"{self.path} lacks the weight {name} the model needs")
            if tuple(self.model.shape(name)) != tuple(want):
                raise UsageError("--model", f"weight {name} in {self.path} has shape {list(self.model.shape(name))}, "
                                 f"expected {list(want)}")

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        if dtype.itemsize == 2 and self.model.block_format(name) in SIXTEEN_BIT:
            return self.model.sixteen_bit(name, dtype)  # no float32 copy of it on the way
        return self.model.tensor(name).to(dtype)

    def get_packed(self, name: str, shape, dtype: torch.dtype) -> Packed | None:
        """In a float32 run, a Q4_0/Q4_1/Q8_0 matrix as its own blocks (gguf_blocks.py), never
        widened; None for the others, and in other widths, whose 4-bit kernel (int4_tiles.py) takes
        quant.py's groups: with --compress-weight those are quantized into them as read."""
        fmt = self.model.block_format(name) if dtype == torch.float32 else None
        return Packed(self.model.blocks(name), tuple(shape), fmt) if fmt not in (None, *SIXTEEN_BIT) else None

    def get_sixteen_bit(self, name: str, shape) -> Packed | None:
        """An F16/BF16 matrix as its 16-bit values (gguf_blocks.keeps_16_bit), or None."""
        fmt = self.model.block_format(name)
        return Packed(self.model.blocks(name), tuple(shape), fmt) if fmt in SIXTEEN_BIT else None

    def stored_formats(self) -> tuple:
        """(name, format) of every matrix that can be kept as stored (gguf_blocks.py)."""
        return self.model.stored_formats()

    def describe(self) -> str:
        return f"{self.path} (GGUF; its Q4_0/Q4_1/Q8_0 matrices kept as stored in float32)"


class DummyWeights:
    """Deterministic weights of any size, made without reading files (for benchmarks).

    Norms get weight 1 and bias 0; every other tensor is a window, at an offset derived
    from its name, into one shared block of normal(0, 0.02) numbers, so that a 175B model is as
    quick to make as copying its bytes.
    """

    BLOCK = 1 << 22

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.block = torch.randn(self.BLOCK * 2, generator=gen) * 0.02
        self._groups = {}  # dtype -> the block quantized, GROUP values at a time

    def check(self, specs):
        pass

    def offset(self, name: str) -> int:
        """Where a tensor's window starts in the block: a whole number of groups in, so that a matrix
        whose rows are whole groups is, in its 4-bit form, a window into the block's groups."""
        return int(hashlib.sha256(name.encode()).hexdigest(), 16) % (self.BLOCK // GROUP) * GROUP

    def get_packed(self, name: str, shape, dtype: torch.dtype):
        """The 4-bit groups of get(name, shape, dtype), bit for bit, copied from the block's groups
        (quantized once) instead of quantized anew: placing OPT-1.3B's dummy weights compressed took
        9.3 s, quantizing. None where the rows are not whole groups (then get() and quantize)."""
        if is_norm(name) or len(shape) != 2 or shape[-1] % GROUP:
            return None
        if dtype not in self._groups:
            self._groups[dtype] = quantize(self.block.to(dtype).view(-1, GROUP), check=False)
        block_groups, period = self._groups[dtype], self.BLOCK // GROUP
        total, first = shape[0] * shape[-1] // GROUP, self.offset(name) // GROUP
        out = torch.empty(total * GROUP_BYTES, dtype=torch.uint8)
        source = block_groups.view(-1)[first * GROUP_BYTES: (first + period) * GROUP_BYTES]
        for done in range(0, len(out), len(source)):  # get() repeats the window every BLOCK values
            n = min(len(out) - done, len(source))
            out[done: done + n].copy_(source[:n])  # flat: a plain memcpy (rows of 36 bytes copied 3x slower)
        return Packed(out.view(shape[0], -1), shape)

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        if is_norm(name):
            return torch.ones(shape, dtype=dtype) if name.endswith("weight") else torch.zeros(shape, dtype=dtype)
        numel = 1
        for d in shape:
            numel *= d
        offset = self.offset(name)
        out = torch.empty(numel, dtype=dtype)
        done = 0
        while done < numel:
            n = min(numel - done, self.BLOCK)
            out[done: done + n] = self.block[offset: offset + n]
            done += n
        return out.view(shape)

    def describe(self) -> str:
        return "dummy"
