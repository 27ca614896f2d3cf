"""The layout of a GGUF file: its metadata values and its tensor table, read straight from the
memory-mapped file. The gguf package's own reader makes numpy views of every metadata item and
took 2.3 s for SmolLM2 (a 49k-token vocabulary, read twice per run); this reads what a model
needs in milliseconds: string arrays (the vocabulary, the merges) are skipped, as counts.

A tensor's `data` is a view of the file in the form gguf.dequantize takes: float arrays for the
float types, rows of uint8 blocks for the quantized ones.
"""

import math
import struct
from dataclasses import dataclass

import numpy as np

STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
         10: np.uint64, 11: np.int64, 12: np.float64}
# Float and integer tensor types: stored as plain values, viewed as such.
PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_DIMS = 8  # ggml's tensors have at most 4; a larger count is a corrupt header


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout (cut short, or an unknown value type)."""


@dataclass
class StringArray:
    """A metadata array of strings, left unread: only how many it holds."""
    count: int


@dataclass
class TensorEntry:
    name: str
    shape: tuple          # dimensions innermost first, as the file lists them
    tensor_type: object   # gguf.GGMLQuantizationType
    data: np.ndarray      # a view of the file (see the module's docstring)
    offset: int = 0       # where its bytes start in the file


@dataclass
class Layout:
    fields: dict     # metadata key -> value (a StringArray for an array of strings)
    tensors: list    # TensorEntry, in file order


def read_layout(path: str) -> Layout:
    """The metadata and the tensor table of a GGUF file of version 2 or 3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    reader = _Cursor(blob)
    if bytes(blob[:4]) != b"GGUF":
        raise GGUFFormatError("it does not start with 'GGUF'")
    reader.pos = 4
    version = reader.scalar(4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (versions 2 and 3 are read)")
    tensor_count, kv_count = reader.scalar(10), reader.scalar(10)
    left = len(blob) - reader.pos
    for what, count, least in (("tensors", tensor_count, 8 + 4 + 4 + 8), ("metadata items", kv_count, 8 + 4)):
        if count * least > left:  # each takes at least `least` bytes
            raise GGUFFormatError(f"its header counts {count} {what}, more than its {len(blob)} bytes can hold")
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar(4))
    table = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.scalar(4)
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(reader.scalar(10) for _ in range(n_dims))
        table.append((name, dims, reader.scalar(4), reader.scalar(10)))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, (bool, np.bool_)) or not isinstance(alignment, (int, np.integer)) or \
            not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment is {alignment!r}: a power of two up to {MAX_ALIGNMENT} is accepted")
    alignment = int(alignment)
    start = -(-reader.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in table:
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has an unknown type {type_id}") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        count = math.prod(dims)
        if dims and dims[0] % block:
            raise GGUFFormatError(f"tensor {name!r} has rows of {dims[0]} values, not whole blocks of {block}")
        nbytes = count * block_bytes // block
        first = start + offset
        if first + nbytes > len(blob):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        raw = blob[first: first + nbytes]
        outer = tuple(reversed(dims))  # numpy's order
        if kind.name in PLAIN:
            data = raw.view(PLAIN[kind.name]).reshape(outer)
        else:  # rows of blocks
            data = raw.reshape(*outer[:-1], outer[-1] * block_bytes // block)
        tensors.append(TensorEntry(name, dims, kind, data, first))
    return Layout(metadata, tensors)


class _Cursor:
    def __init__(self, blob):
        self.blob, self.view, self.pos = blob, memoryview(blob), 0

    def _take(self, nbytes: int):
        if self.pos + nbytes > len(self.blob):
            raise GGUFFormatError("it is cut short")
        start, self.pos = self.pos, self.pos + nbytes
        return start

    def scalar(self, type_id: int):
        fmt = SCALARS.get(type_id)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {type_id}")
        return struct.unpack_from(fmt, self.view, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar(10)
        start = self._take(length)
        return bytes(self.view[start: start + length]).decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id == STRING:
            return self.string()
        if type_id != ARRAY:
            return self.scalar(type_id)
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type == STRING:
            for _ in range(count):  # skipped: a vocabulary or merges
                self._take(self.scalar(10))
            return StringArray(count)
        if item_type not in NUMPY:
            raise GGUFFormatError(f"unknown metadata array type {item_type}")
        dtype = np.dtype(NUMPY[item_type])
        start = self._take(count * dtype.itemsize)
        return np.frombuffer(self.view[start: start + count * dtype.itemsize], dtype=dtype)
