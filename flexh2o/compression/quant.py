"""4-bit group quantization: pure functions, no state.

A tensor [..., n] is quantized along its last dimension in groups of GROUP values (the last group
padded by repeating the final value). Each group is stored as one self-contained record of
GROUP_BYTES bytes: GROUP / 2 bytes of 4-bit codes (two per byte: the group's first half in the
low nibbles, its second half in the high ones), then its scale and its minimum as float16. So a
compressed tensor is a plain uint8 tensor [..., packed_width(n)]: 36 bytes per 64 values, 4.5
bits per value, and any slice of its leading dimensions is a compressed tensor of those rows.

A value x becomes code round((x - minimum) / scale), 0..15, and comes back as minimum + code * scale.
The stored minimum is rounded down and the scale up to float16, so every value of a group lies
within [minimum, minimum + 15 * scale] and comes back within half a step (scale / 2) of itself.
"""

import math

import torch

from flexh2o import native
from flexh2o.host.aligned_memory import aligned_empty

from flexh2o.compression import gguf_blocks, gpu_dequant
from flexh2o.compression.formats import BLOCK_VALUES, GROUP, GROUP_BYTES, NATIVE_DTYPES, SIXTEEN_BIT

LEVELS = 15                 # codes 0..15
FLOAT16_MAX = 65504.0
ALIGNED_BYTES = 1 << 20  # groups of at least this many bytes are made at a disk block boundary


def groups(n: int) -> int:
    return -(-n // GROUP)


def packed_width(n: int) -> int:
    """Bytes that n values (one row along the grouped dimension) take compressed."""
    return groups(n) * GROUP_BYTES


def packed_shape(shape) -> tuple:
    """The uint8 shape a tensor of `shape` is stored in."""
    return (*shape[:-1], packed_width(shape[-1]))


def packed_bytes(shape) -> int:
    return math.prod(packed_shape(shape))


def check_quantizable(x: torch.Tensor):
    """Raises ValueError for what 4-bit groups cannot hold: inf, NaN, values beyond float16's range.
    Checked BLOCK_VALUES at a time, so its temporaries stay small beside a large weight."""
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), BLOCK_VALUES):
        block = flat[start: start + BLOCK_VALUES]
        low, high = torch.aminmax(block)  # one pass (isfinite took 10 s of placing OPT-1.3B); NaN gives NaN
        # As Python floats: against a bfloat16 tensor, 65504 would be rounded to bfloat16's 65536 first.
        if float(low) >= -FLOAT16_MAX and float(high) <= FLOAT16_MAX:
            continue
        if not torch.isfinite(block).all():
            raise ValueError("cannot quantize a tensor holding inf or NaN")
        raise ValueError(f"cannot quantize values beyond float16's range (|x| > {FLOAT16_MAX:g}): "
                         "the group minimum and scale are stored as float16")


def _round_float16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) as float16, rounded towards +inf (up) or -inf (down) instead of to nearest.
    The neighbour is found on the bits (float16's order is its sign-magnitude bits' order), not with
    torch.nextafter, which lacks float16 on CUDA in older torch releases."""
    y = x.to(torch.float16)
    wrong = y.float() < x if up else y.float() > x
    bits = y.view(torch.int16)
    away_from_zero = (y > 0) if up else (y < 0)  # one step further from zero: magnitude bits + 1
    step = torch.where(away_from_zero, 1, -1).to(torch.int16)
    # +-2^-24 (bits 0x0001 / 0x8001), as a Python number: a tensor made for it would be a blocking
    # host-to-device copy on CUDA at every quantize.
    smallest = 1 if up else -32767
    neighbour = torch.where(y == 0, smallest, bits + step).view(torch.float16)
    return torch.where(wrong, neighbour, y)


def quantize(x: torch.Tensor, check: bool = True) -> torch.Tensor:
    """x [..., n] (any float dtype, any device) -> uint8 [..., packed_width(n)] on the same device.
    With check, inf, NaN and values beyond float16's range raise ValueError; without (hot paths),
    such a group comes back as inf or NaN, never as finite garbage."""
    lib = _native_for(x)
    if lib is not None:  # the kernel counts the groups it cannot hold as it goes: checked for free
        out, bad = _quantize_native(lib, x)
        if check and bad:
            check_quantizable(x)  # raises, naming what is wrong
        return out
    if check:
        check_quantizable(x)
    if _over_a_block(x, x[0].numel() if x.dim() > 1 else 0):
        out = groups_buffer(packed_shape(x.shape)) if x.device.type == "cpu" else \
            torch.empty(packed_shape(x.shape), dtype=torch.uint8, device=x.device)
        _by_row_blocks(x, out, x[0].numel(), lambda block, dst: dst.copy_(quantize(block, check=False)))
        return out
    n = x.shape[-1]
    g = groups(n)
    x = x.float()
    if g * GROUP != n:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], g * GROUP - n)], -1)
    x = x.reshape(*x.shape[:-1], g, GROUP)
    low = _round_float16(x.amin(-1, keepdim=True), up=False)
    scale = _round_float16((x.amax(-1, keepdim=True) - low.float()) / LEVELS, up=True)
    divisor = torch.where(scale == 0, 1.0, scale.float())  # a constant group: every code 0
    codes = (x - low.float()).div_(divisor).round_().clamp_(0, LEVELS).to(torch.uint8)
    pairs = codes[..., :GROUP // 2] | (codes[..., GROUP // 2:] << 4)
    record = torch.cat([pairs, scale.view(torch.uint8), low.view(torch.uint8)], -1)  # [..., g, GROUP_BYTES]
    return record.reshape(*record.shape[:-2], g * GROUP_BYTES)


def dequantize(packed: torch.Tensor, n: int, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., packed_width(n)] -> [..., n]: written into `out` (any strides) when given, else a
    new tensor of `dtype`."""
    g = groups(n)
    if packed.shape[-1] != g * GROUP_BYTES:
        raise ValueError(f"a packed row of {packed.shape[-1]} bytes does not hold {n} values "
                         f"({g * GROUP_BYTES} bytes)")
    lib = _native_for(packed)
    if lib is not None and _native_takes(packed, out, dtype):
        return _dequantize_native(lib, packed, n, out, dtype)
    if packed.is_cuda and packed.numel():
        if out is None:
            out = torch.empty(*packed.shape[:-1], n, dtype=dtype, device=packed.device)
        if gpu_dequant.takes(out):  # one fused kernel
            return gpu_dequant.dequantize(packed, "groups", out)
    return dequantize_torch(packed, n, out, dtype)


def dequantize_torch(packed: torch.Tensor, n: int, out: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize() by torch operations, on any device, BLOCK_VALUES values at a time."""
    g = groups(n)
    per_row = packed[0].numel() // GROUP_BYTES * GROUP if packed.dim() > 1 else 0  # values
    if out is not None and _over_a_block(packed, per_row):
        _by_row_blocks(packed, out, per_row, lambda block, dst: dequantize_torch(block, n, dst))
        return out
    record = packed.contiguous().view(*packed.shape[:-1], g, GROUP_BYTES)
    pairs = record[..., :GROUP // 2]
    scale = record[..., GROUP // 2: GROUP // 2 + 2].view(torch.float16).float().unsqueeze(-1)
    low = record[..., GROUP // 2 + 2:].view(torch.float16).float().unsqueeze(-1)
    # Straight into `out` where that is exact: float32 (a narrower out would round twice).
    direct = out is not None and n == g * GROUP and out.stride(-1) == 1 and out.dtype == torch.float32
    target = out if direct else torch.empty(*packed.shape[:-1], g * GROUP, device=packed.device)
    # In place in the target, one pass each: on a CPU the fused or gathering alternatives were slower.
    values = target.view(*target.shape[:-1], g, 2, GROUP // 2)
    values.copy_(torch.stack([pairs & 15, pairs >> 4], -2))
    values.mul_(scale).add_(low)
    if direct:
        return out
    if out is None:
        return target[..., :n].to(dtype)
    out.copy_(target[..., :n])
    return out


# -- the C kernels (native/quant4.c), bit-equal to the torch path above -------------------------


def _native_for(t: torch.Tensor):
    """The C kernels, where they take `t` (on the CPU, not empty) and this machine has them."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    return native.library()


def _rows_of(t: torch.Tensor) -> torch.Tensor | None:
    """t as [rows, n] with each row's values adjacent, without a copy; None where its strides do not
    allow that (or its dtype is not one the kernels write)."""
    if t.dtype not in NATIVE_DTYPES or t.device.type != "cpu":
        return None
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else None


def _native_takes(packed: torch.Tensor, out, dtype) -> bool:
    """Whether the kernel writes this dequantization: into a new tensor of a dtype it writes, or
    into an `out` of one row per packed row whose rows it can address."""
    if out is None:
        return dtype in NATIVE_DTYPES
    rows = _rows_of(out)
    return rows is not None and len(rows) * packed.shape[-1] == packed.numel()


def _as_groups(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Contiguous rows of whole groups are one group a row: the same bytes, split finer over threads."""
    if n % GROUP == 0 and rows.stride(0) == n:
        return rows.view(-1, GROUP), GROUP
    return rows, n


def _quantize_native(lib, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x's groups, and how many of them the kernel found it cannot hold."""
    n = x.shape[-1]
    rows = _rows_of(x) if x.dtype in NATIVE_DTYPES else None
    if rows is None:
        rows = x.to(torch.float32).contiguous().view(-1, n)
    out = groups_buffer(packed_shape(x.shape))
    rows, width = _as_groups(rows, n)
    code, stride, ptr, bad = NATIVE_DTYPES[rows.dtype], rows.stride(0), rows.data_ptr(), []
    native.split_rows(lambda a, b: bad.append(lib.quantize_rows(ptr, code, stride, width, out.data_ptr(), a, b)),
                      len(rows), rows.numel())
    return out, sum(bad)


def _dequantize_native(lib, packed: torch.Tensor, n: int, out, dtype) -> torch.Tensor:
    packed = packed.contiguous()
    if out is None:
        out = torch.empty(*packed.shape[:-1], n, dtype=dtype)
    rows, width = _as_groups(_rows_of(out), n)
    code, stride, ptr = NATIVE_DTYPES[rows.dtype], rows.stride(0), rows.data_ptr()
    native.split_rows(lambda a, b: lib.dequantize_rows(packed.data_ptr(), width, ptr, code, stride, a, b),
                      len(rows), rows.numel())
    return out


def _over_a_block(t: torch.Tensor, values_per_row: int) -> bool:
    return t.dim() > 1 and len(t) * values_per_row > BLOCK_VALUES


def _by_row_blocks(src: torch.Tensor, dst: torch.Tensor, values_per_row: int, fn):
    """fn(src block, dst block) over blocks of leading rows of at most BLOCK_VALUES values; row by
    row where one row alone holds more (fn then blocks that row the same way)."""
    step = BLOCK_VALUES // values_per_row
    if step == 0:
        for row, row_dst in zip(src, dst):
            fn(row, row_dst)
        return
    for start in range(0, len(src), step):
        fn(src[start: start + step], dst[start: start + step])


class Packed:
    """A weight already low-bit: `groups`, uint8 [rows, row bytes], standing for a tensor of `shape`
    [rows, n], in format `fmt`: "groups" (this module's; dummy weights are made as such, weights.py)
    or a GGUF block format a file keeps (gguf_blocks.py). Layers join them with join(), and
    Tiers.place stores them as they are."""

    def __init__(self, groups: torch.Tensor, shape: tuple, fmt: str = "groups"):
        self.groups, self.shape, self.fmt = groups, tuple(shape), fmt


def dequantize_as(packed: torch.Tensor, fmt: str, n: int, out: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize() of rows in format `fmt` (see Packed)."""
    if fmt == "groups":
        return dequantize(packed, n, out, dtype)
    return gguf_blocks.dequantize(packed, fmt, n, out, dtype)


def join(items: list, lossless: bool = False):
    """torch.cat along the first dimension, of tensors or of Packed weights (rows of groups). Packed
    weights of different low-bit formats (a GGUF's q, k and v in two) are joined as this module's
    groups, the others dequantized and quantized again; 16-bit values beside anything else are
    widened (they are only kept where nothing is quantized). lossless (a run that quantizes
    nothing): unless all are Packed in one format, all are widened, exactly."""
    sixteen_bit = [isinstance(i, Packed) and i.fmt in SIXTEEN_BIT for i in items]
    one_format = all(isinstance(i, Packed) for i in items) and len({i.fmt for i in items}) == 1
    if any(sixteen_bit) and not (all(sixteen_bit) and one_format) or lossless and not one_format:
        # 16-bit values beside another width (a GGUF's q in F16, its k in F32): all widened, exactly
        items = [dequantize_as(i.groups, i.fmt, i.shape[-1]) if isinstance(i, Packed) else i for i in items]
    if not isinstance(items[0], Packed):
        return torch.cat(items)
    if len({i.fmt for i in items}) > 1:
        items = [i if i.fmt == "groups" else
                 Packed(quantize(dequantize_as(i.groups, i.fmt, i.shape[-1])), i.shape) for i in items]
    groups = [i.groups for i in items]
    out = groups_buffer((sum(len(g) for g in groups), *groups[0].shape[1:]))
    return Packed(torch.cat(groups, out=out), (sum(i.shape[0] for i in items), *items[0].shape[1:]), items[0].fmt)


def groups_buffer(shape) -> torch.Tensor:
    """An empty uint8 CPU tensor for groups, at a disk block boundary where it is large: placed on
    disk, such a one is written from where it is (disk.py, O_DIRECT), not through a bounce copy."""
    nbytes = math.prod(shape)
    if nbytes < ALIGNED_BYTES:
        return torch.empty(shape, dtype=torch.uint8)
    return aligned_empty(nbytes).view(shape)


def compressible(shape) -> bool:
    """Whether a weight of this shape is stored compressed under compress_weight: matrices, grouped
    along their last (input) dimension; vectors (biases, norms) stay as they are."""
    return len(shape) >= 2


def stored_row_bytes(shape, itemsize: int, compressed: bool, fmt: str = "groups") -> int:
    """Bytes of one row (a slice of the first dimension) of a tensor as it is stored (compressed:
    in format `fmt`, see Packed)."""
    rest = tuple(shape[1:]) or (1,)
    if compressed and fmt != "groups":
        return gguf_blocks.row_bytes(fmt, rest[-1])
    return packed_bytes(rest) if compressed else math.prod(rest) * itemsize


def stored_bytes(shape, itemsize: int, compressed: bool) -> int:
    return shape[0] * stored_row_bytes(shape, itemsize, compressed)
