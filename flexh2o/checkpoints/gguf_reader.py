"""Reads GGUF model files (llama.cpp's format) of the Llama family.

read_gguf(path) gives the model's Hugging Face config.json as a dict and its tensors one at a time,
dequantized to float32, under Hugging Face names and shapes (without the leading "model."). The file
is memory-mapped (gguf_file.py): only the tensor asked for is read and dequantized (by the gguf
package). tokenizer(path) builds a transformers tokenizer from the same file.
"""

import copy
import importlib.util
import mmap
import os
import re
import struct

import numpy as np
import torch

from flexh2o.common.errors import UsageError, check_regular_file
from flexh2o.checkpoints.gguf_config import FLAG, ROPE_FREQS, hf_config, string
from flexh2o.checkpoints.gguf_file import Layout, read_layout
from flexh2o.compression.formats import LAYOUTS

SLICE_BYTES = 16 << 20  # rows read at a time by GGUFModel.sixteen_bit

# GGUF architecture -> (Hugging Face model_type, architectures entry, q/k rows permuted by the converter).
# llama.cpp converts Mistral's dense models to "llama"; its "mistral3" is another model and not listed.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

GLOBAL_TENSORS = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFModel:
    """An open GGUF file: `config` (Hugging Face config.json form) and its tensors by Hugging Face name."""

    def __init__(self, path, config, tensors, permute_qk):
        self.path = path
        self.config = config
        self._tensors = tensors  # Hugging Face name -> gguf_file.TensorEntry
        self._permute_qk = permute_qk

    def opened_as(self, path):
        """The same file under the path it was asked by, with a config of its own to change."""
        return GGUFModel(path, copy.deepcopy(self.config), self._tensors, self._permute_qk)

    def names(self):
        """The Hugging Face names of the tensors in the file (no lm_head.weight when it is tied)."""
        return list(self._tensors)

    def shape(self, name):
        """Hugging Face shape ([out, in] for a matrix) of one tensor, without reading it."""
        # GGUF lists dimensions innermost first; PyTorch outermost first.
        return tuple(int(d) for d in reversed(self._gguf_tensor(name).shape))

    def tensor(self, name):
        """One tensor dequantized to float32 in Hugging Face layout (a new, writable tensor)."""
        gguf_tensor = self._gguf_tensor(name)
        weights = _dequantize(gguf_tensor).reshape(self.shape(name))
        if self._permute_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            weights = unpermute_rotary_rows(weights, self.config["num_attention_heads"])
        elif self._permute_qk and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            weights = unpermute_rotary_rows(weights, self.config["num_key_value_heads"])
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights, dtype=np.float32, order="C")
        unmap_pages(gguf_tensor)
        return torch.from_numpy(weights)

    def block_format(self, name) -> str | None:
        """The format (Q4_0, Q4_1, Q8_0, F16, BF16: gguf_blocks.py) a matrix can be kept in as stored, or None."""
        from flexh2o.compression.gguf_blocks import holds
        fmt = self._gguf_tensor(name).tensor_type.name
        return fmt if holds(fmt, self.shape(name)) else None

    def stored_formats(self) -> tuple:
        """(name, format) of every matrix that can be kept as stored (block_format)."""
        return tuple(sorted((n, f) for n in self._tensors if (f := self.block_format(n)) is not None))

    def sixteen_bit(self, name, dtype: torch.dtype) -> torch.Tensor:
        """An F16/BF16 matrix (block_format) in the 16-bit `dtype`, Hugging Face layout: read from the
        file a slice of rows at a time into the result, so that no wider copy of it exists while it
        loads (an untied head of 49152 x 2048 took 0.4 GB in float32 on its way to 0.2 in bfloat16)."""
        from flexh2o.compression.gguf_blocks import SIXTEEN_BIT
        gguf_tensor = self._gguf_tensor(name)
        stored = SIXTEEN_BIT[gguf_tensor.tensor_type.name]
        permuted = self._permute_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
        if dtype == stored or permuted:  # as stored, whole (permuted: rows reordered whole; a small matrix)
            return self.blocks(name).view(stored).to(dtype)
        out = torch.empty(self.shape(name), dtype=dtype)
        step = max(1, SLICE_BYTES // (out.shape[1] * 2))
        rows = torch.empty(min(step, len(out)), out.shape[1], dtype=stored)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(gguf_tensor.offset)
            for start in range(0, len(out), step):
                n = min(step, len(out) - start)
                self._read_into(f, rows[:n].view(torch.uint8), gguf_tensor)
                out[start: start + n].copy_(rows[:n])
        return out

    def _read_into(self, f, target: torch.Tensor, gguf_tensor):
        """Fills the contiguous uint8 tensor `target` from the open file, where it stands."""
        if f.readinto(memoryview(target.numpy()).cast("B")) != target.numel():
            raise UsageError(FLAG, f"{self.path} ended inside tensor {gguf_tensor.name}")

    def blocks(self, name) -> torch.Tensor:
        """A block_format() matrix's bytes as stored, uint8 [rows, row bytes] in Hugging Face row
        order: a new tensor, read from the file (not through its map, whose pages would count in
        the process's memory beside the copy)."""
        from flexh2o.compression.quant import groups_buffer
        gguf_tensor = self._gguf_tensor(name)
        rows = groups_buffer((self.shape(name)[0], gguf_tensor.data.nbytes // self.shape(name)[0]))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(gguf_tensor.offset)
            self._read_into(f, rows, gguf_tensor)
        if self._permute_qk and name.endswith("self_attn.q_proj.weight"):
            rows = torch.from_numpy(unpermute_rotary_rows(rows.numpy(), self.config["num_attention_heads"]).copy())
        elif self._permute_qk and name.endswith("self_attn.k_proj.weight"):
            rows = torch.from_numpy(unpermute_rotary_rows(rows.numpy(), self.config["num_key_value_heads"]).copy())
        return rows

    def _gguf_tensor(self, name):
        if name not in self._tensors:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        return self._tensors[name]


def read_gguf(path, check_config=None) -> GGUFModel:
    """Opens a GGUF file of a supported architecture; a bad file raises a one-line UsageError.
    `check_config(config)` (the models' own check of a config.json's fields) refuses impossible
    shapes before anything is computed from them.

    One run asks for the same file several times (its config, its weights): the last file read is
    kept while it stays the same file on disk.
    """
    global _last_read
    _check_magic(path)
    stat = os.stat(path)
    identity = (os.path.abspath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if _last_read is None or _last_read[0] != identity:
        _last_read = None  # a failed read leaves nothing behind
        _last_read = (identity, _parse(path, check_config))
    elif check_config is not None:
        check_config(_last_read[1].config)
    return _last_read[1].opened_as(path)


_last_read = None  # (the file's identity on disk, its GGUFModel)


def _parse(path, check_config) -> GGUFModel:
    reader = _open_reader(path)
    arch = string(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise UsageError(FLAG, f"{path} is a GGUF {arch!r} model; supported: {', '.join(ARCHITECTURES)}")
    model_type, architecture, permute_qk = ARCHITECTURES[arch]
    tensors = _hf_tensor_map(reader, path)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    freqs = None if freqs is None else _dequantize(freqs).astype(np.float64)
    config = {"model_type": model_type, "architectures": [architecture],
              **hf_config(reader, arch, path, tensors, check_config, freqs)}
    return GGUFModel(path, config, tensors, permute_qk)


def tokenizer(path):
    """The transformers tokenizer (chat template included, when the file has one) built from a GGUF file."""
    try:
        # The class AutoTokenizer gives a GGUF file in transformers 5, built directly: AutoTokenizer
        # first builds the model's config with the gguf package's reader, 3.6 s of SmolLM2's start.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Tokenizer
    except ImportError:
        from transformers import AutoTokenizer as Tokenizer

    _check_magic(path)
    directory, filename = os.path.split(os.path.abspath(path))
    try:
        return Tokenizer.from_pretrained(directory, gguf_file=filename)
    except (ValueError, IndexError, KeyError, OSError, struct.error) as err:
        # transformers' own GGUF reader fails on a cut-off or corrupt file with a multi-line message.
        reason = " ".join(str(err).split()) or type(err).__name__
        raise UsageError(FLAG, f"{path}: transformers cannot build a tokenizer from it ({reason})") from None


def unpermute_rotary_rows(weights, num_heads):
    """Undoes llama.cpp's reordering of q/k rows: Hugging Face's rotary layout back from GGUF's.

    Per head, Hugging Face keeps the rotated pairs half a head apart (row i pairs with row i + d/2);
    llama.cpp's converter interleaves them (rows 2i and 2i+1). GGUF row 2i + j of a head is therefore
    Hugging Face row j * d/2 + i: view the rows as (head, i, j), swap i and j, flatten again.
    """
    rows = weights.shape[0]
    if rows % (2 * num_heads):
        raise UsageError(FLAG, f"q/k projection of {rows} rows does not split into {num_heads} rotary heads")
    half = rows // num_heads // 2
    pairs = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weights.shape)


def _open_reader(path) -> Layout:
    if importlib.util.find_spec("gguf") is None:  # its tensor types and dequantization
        raise UsageError(FLAG, "reading GGUF files needs the gguf package: pip install 'flexh2o[models]'") from None
    try:
        return read_layout(path)
    except (ValueError, IndexError, KeyError, TypeError, ArithmeticError, OSError, struct.error) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise UsageError(FLAG, f"{path} is not a readable GGUF file ({reason})") from None


def _check_magic(path):
    check_regular_file(path, FLAG)
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as err:
        raise UsageError(FLAG, f"cannot read {path}: {err.strerror or err}") from None
    if magic != b"GGUF":
        raise UsageError(FLAG, f"{path} is not a GGUF file (it does not start with 'GGUF')")


def unmap_pages(gguf_tensor):
    """Drops the pages of a tensor read through the file's map from this process's mappings (they
    stay in the page cache): mapped, they counted in its RSS beside the copy made of them (a 2.5 GB
    file read whole showed a peak RSS of 3.8 GB in a 1.5 GB cgroup) and were harder for the kernel
    to reclaim under a memory limit."""
    mapped = getattr(gguf_tensor.data, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise"):
        return
    start = gguf_tensor.offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, gguf_tensor.offset + gguf_tensor.data.nbytes - start)


def _dequantize(gguf_tensor):
    """float32 values of a tensor: the common 4- and 8-bit block types by whole-tensor torch ops
    (the gguf package's numpy loops took 1.2 s of SmolLM2's start), the others by the gguf package."""
    if gguf_tensor.tensor_type.name in DEQUANTIZED_HERE:
        return _dequantize_blocks(gguf_tensor.data, gguf_tensor.tensor_type.name)
    from gguf import dequantize

    try:
        return dequantize(gguf_tensor.data, gguf_tensor.tensor_type)
    except NotImplementedError:
        raise UsageError(FLAG, f"{gguf_tensor.name}: the gguf package cannot dequantize "
                               f"{gguf_tensor.tensor_type.name}") from None


# Dequantized here by whole-tensor torch ops: Q4_0 d * (q - 8); Q4_1 d * q + m; Q8_0 d * q (q signed).
DEQUANTIZED_HERE = ("Q4_0", "Q4_1", "Q8_0")


def _dequantize_blocks(data, kind):
    layout = LAYOUTS[kind]
    blocks = torch.from_numpy(np.array(data)).reshape(-1, layout.record)  # a copy: the file's map is read-only

    def half(at):
        return blocks[:, at: at + 2].contiguous().view(torch.float16).float()
    q = blocks[:, layout.codes_at:]
    if layout.bits == 4:
        q = torch.cat([q & 0x0F, q >> 4], dim=1).float()
    else:
        q = q.contiguous().view(torch.int8).float()
    if layout.zero:
        q = q - layout.zero
    values = q * half(layout.scale_at) + (half(layout.low_at) if layout.low_at >= 0 else 0)
    return values.reshape(*data.shape[:-1], -1).numpy()


def _hf_tensor_map(reader, path):
    """Hugging Face name -> GGUF tensor for every tensor of the model; an unknown tensor is refused."""
    tensors = {}
    for gguf_tensor in reader.tensors:
        if gguf_tensor.name == ROPE_FREQS:
            continue  # read into the config's rope_scaling
        hf_name = _hf_name(gguf_tensor.name)
        if hf_name is None:
            raise UsageError(FLAG, f"{path} holds tensor {gguf_tensor.name!r}, not part of a Llama-family model")
        tensors[hf_name] = gguf_tensor
    return tensors


def _hf_name(gguf_name):
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS and suffix == "weight":
        return f"{GLOBAL_TENSORS[base]}.weight"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in LAYER_TENSORS:
        return f"layers.{match[1]}.{LAYER_TENSORS[match[2]]}.{match[3]}"
    return None
