"""flexh2o.checkpoints.gguf_reader: SmolLM2-135M's GGUF (Q4_1) against transformers' own GGUF loading, and tiny
GGUF files written here for what that file lacks (untied head, RoPE scaling, qwen2, F16/Q8_0)."""

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[models]')")

import flexh2o.checkpoints.gguf_reader  # noqa: E402
from flexh2o.common.errors import UsageError  # noqa: E402
from flexh2o.checkpoints.gguf_reader import read_gguf, tokenizer  # noqa: E402
from flexh2o.models import resolve_model  # noqa: E402
from flexh2o.compression.formats import BLOCK_BYTES, SIXTEEN_BIT  # noqa: E402

from conftest import SMOL_GGUF as SMOL  # noqa: E402
needs_smol = pytest.mark.skipif(not os.path.isfile(SMOL), reason=f"{SMOL} is missing: `make setup` downloads it")
SENTENCE = "Hello world, the quick brown fox jumps over 13 lazy dogs."


@pytest.fixture(scope="module")
def smol():
    return read_gguf(SMOL)


def as_float32(value):
    """A config value with its floats rounded to float32, as GGUF stores them (1e-05 == 9.999999747e-06)."""
    if isinstance(value, dict):
        return {key: as_float32(item) for key, item in value.items()}
    return float(np.float32(value)) if isinstance(value, float) else value


@needs_smol
def test_config_matches_transformers(smol, transformers_smol):
    from transformers import AutoConfig

    theirs = AutoConfig.for_model(**transformers_smol["config"]).to_dict()
    ours = AutoConfig.for_model(**smol.config).to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "unk_token_id", "architectures"):  # not model fields
        theirs.pop(key, None)
        ours.pop(key, None)
    assert as_float32(ours) == as_float32(theirs)
    assert smol.config["model_type"] == "llama" and smol.config["tie_word_embeddings"] is True
    assert smol.config["rope_theta"] == 100000.0 and "rope_scaling" not in smol.config


@needs_smol
def test_every_tensor_matches_transformers(smol, transformers_smol):
    theirs = transformers_smol["tensors"]
    assert {f"model.{name}" for name in smol.names()} == set(theirs)
    for name in smol.names():
        tensor = smol.tensor(name)
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == smol.shape(name)
        assert torch.equal(tensor, theirs[f"model.{name}"]), name  # q/k rows un-permuted as transformers does


@needs_smol
def test_tokenizer_and_chat_template(transformers_smol):
    tok = tokenizer(SMOL)
    ids = tok(SENTENCE)["input_ids"]
    assert ids[:6] == [19556, 905, 28, 260, 2365, 6354]  # SmolLM2's ids for "Hello world, the quick brown"
    assert tok.decode(ids) == SENTENCE
    vocabulary = transformers_smol["tokenizer"]["tokens"]  # the file's own token strings
    assert "".join(vocabulary[i] for i in ids).replace("\u0120", " ") == SENTENCE  # byte-level BPE: "Ġ" is a space
    template = transformers_smol["tokenizer_config"]["chat_template"]
    assert tok.chat_template == template
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


@pytest.mark.parametrize("content", [b"hello, not a model\n", b"", b"GGUF\x03\x00\x00\x00 cut short"])
def test_bad_file_is_a_one_line_usage_error(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    for read in (read_gguf, tokenizer):
        with pytest.raises(UsageError) as err:
            read(str(path))
        assert err.value.flag == "--model" and "\n" not in str(err.value) and str(path) in str(err.value)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        read_gguf(str(tmp_path / "absent.gguf"))


# Tiny files written here. Their tensors are made in Hugging Face layout and stored as llama.cpp's
# converter stores them: q/k rows interleaved per head (for "llama"), dimensions innermost first.
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 128, 2, 1, 96, 64, 2
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weights, heads):
    """llama.cpp's convert_hf_to_gguf reordering of q/k rows (per head, pair rows i and i + d/2)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def hf_tensors(rng, untied, biases):
    shapes = {"embed_tokens.weight": (VOCAB, HIDDEN), "norm.weight": (HIDDEN,)}
    if untied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        layer = f"layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": (HIDDEN,), f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
            f"{layer}.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            f"{layer}.mlp.gate_proj.weight": (FFN, HIDDEN), f"{layer}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FFN),
        })
        if biases:
            for proj, rows in (("q", HIDDEN), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
                shapes[f"{layer}.self_attn.{proj}_proj.bias"] = (rows,)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
    parts = hf_name.split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_NAMES['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[-1]}"


def stored(name, weights, arch, matrix_type=None):
    """A tensor as the converter stores it: q/k permuted for llama, matrices as Q8_0 or F16 (or
    matrix_type(name)'s type name, where it gives one)."""
    if arch == "llama" and ".q_proj." in name:
        weights = llama_cpp_permute(weights, HEADS)
    elif arch == "llama" and ".k_proj." in name:
        weights = llama_cpp_permute(weights, KV_HEADS)
    qtype = gguf.GGMLQuantizationType.F32
    if weights.ndim == 2:
        qtype = gguf.GGMLQuantizationType.Q8_0 if "mlp" in name else gguf.GGMLQuantizationType.F16
        if matrix_type is not None and matrix_type(name):
            qtype = gguf.GGMLQuantizationType[matrix_type(name)]
    return gguf.quants.quantize(weights, qtype), qtype


def write_tiny(path, arch="llama", untied=False, biases=False, rope_freqs=None, scaling=None, header=None,
               matrix_type=None):
    """Writes a tiny model; gives the float32 tensors, in Hugging Face layout, that reading should return.
    header: metadata in place of the tensors' own shapes (layers, hidden, heads, kv_heads);
    matrix_type: name -> the GGUF type name a matrix is stored in (None: stored()'s choice)."""
    header = {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS} | (header or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(header["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(header["hidden"])
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(header["heads"])
    writer.add_head_count_kv(header["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(4)
    if scaling:
        writer.add_rope_scaling_type(scaling[0])
        writer.add_rope_scaling_factor(scaling[1])
    expected = {}
    for name, weights in hf_tensors(np.random.default_rng(0), untied, biases).items():
        data, qtype = stored(name, weights, arch, matrix_type)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        expected[name] = gguf.dequantize(gguf.quants.quantize(weights, qtype), qtype).reshape(weights.shape)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch, biases", [("llama", False), ("llama", True), ("qwen2", True)])
def test_tiny_file_tensors_and_config(tmp_path, arch, biases):
    expected = write_tiny(tmp_path / "tiny.gguf", arch=arch, untied=True, biases=biases)
    model = read_gguf(str(tmp_path / "tiny.gguf"))
    assert sorted(model.names()) == sorted(expected)
    for name, weights in expected.items():
        assert model.shape(name) == weights.shape
        assert torch.equal(model.tensor(name), torch.from_numpy(weights)), name
    assert model.config == {
        "model_type": arch, "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "hidden_act": "silu",
        "attention_bias": biases, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 3, "eos_token_id": 4,
    }


def llama3_divisors(factor, low, high, old_context):
    """rope_freqs as llama.cpp's converter computes it from Hugging Face's llama3 rope_scaling."""
    inv_freq = 500000.0 ** -(np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    wavelength = 2 * np.pi / inv_freq
    smooth = (old_context / wavelength - low) / (high - low)
    divisors = np.where(wavelength > old_context / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelength < old_context / high, 1.0, divisors)


@pytest.mark.parametrize("factor, high, old_context", [(8.0, 4.0, 8192), (32.0, 4.0, 8192), (16.0, 3.0, 4096)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor, high, old_context):
    write_tiny(tmp_path / "tiny.gguf", rope_freqs=llama3_divisors(factor, 1.0, high, old_context))
    model = read_gguf(str(tmp_path / "tiny.gguf"))
    assert model.config["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                            "high_freq_factor": high, "original_max_position_embeddings": old_context}
    assert "rope_freqs.weight" not in model.names() and model.config["tie_word_embeddings"] is True


def test_linear_rope_scaling_and_refusals(tmp_path):
    write_tiny(tmp_path / "linear.gguf", scaling=(gguf.RopeScalingType.LINEAR, 2.0))
    assert read_gguf(str(tmp_path / "linear.gguf")).config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    write_tiny(tmp_path / "yarn.gguf", scaling=(gguf.RopeScalingType.YARN, 4.0))
    with pytest.raises(UsageError, match="'yarn' RoPE scaling"):
        read_gguf(str(tmp_path / "yarn.gguf"))
    write_tiny(tmp_path / "odd.gguf", rope_freqs=np.linspace(1, 3, HEAD_DIM // 2) ** 2)
    with pytest.raises(UsageError, match="not llama3-style"):
        read_gguf(str(tmp_path / "odd.gguf"))


def test_other_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError, match="'gpt2' model; supported: llama, qwen2"):
        read_gguf(str(tmp_path / "gpt2.gguf"))


def test_a_file_is_parsed_once_while_it_stays_the_same(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path)
    opened, parse = [], flexh2o.checkpoints.gguf_reader.read_layout
    monkeypatch.setattr(flexh2o.checkpoints.gguf_reader, "read_layout", lambda *args: opened.append(args) or parse(*args))
    first = read_gguf(path)
    first.config["hidden_size"] = -1  # a caller's config is its own
    second = read_gguf(path)
    assert len(opened) == 1 and second.config["hidden_size"] == HIDDEN
    assert torch.equal(first.tensor("layers.0.mlp.up_proj.weight"), second.tensor("layers.0.mlp.up_proj.weight"))
    write_tiny(path, arch="qwen2", biases=True)  # the same path, another file
    assert read_gguf(path).config["model_type"] == "qwen2" and len(opened) == 2


@pytest.mark.parametrize("header,says", [
    ({"heads": 0}, "num_attention_heads must be a positive integer"),
    ({"layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"kv_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"heads": 3}, "hidden_size is not a multiple of num_attention_heads"),
    ({"heads": 4, "kv_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"hidden": 0}, "hidden_size must be a positive integer"),
])
def test_an_impossible_gguf_header_is_one_line(tmp_path, header, says):
    write_tiny(tmp_path / "bad.gguf", header=header)
    with pytest.raises(UsageError) as e:
        resolve_model(str(tmp_path / "bad.gguf"))
    assert e.value.flag == "--model" and says in e.value.message


@pytest.mark.parametrize("kind", [f for f in BLOCK_BYTES if f not in SIXTEEN_BIT])
def test_block_types_dequantize_as_the_gguf_package_does(kind):
    """The whole-tensor torch dequantization of the common block types gives the gguf package's values, bit for bit."""
    from flexh2o.checkpoints.gguf_reader import _dequantize_blocks
    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).normal(size=(6, 128)).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    assert np.array_equal(_dequantize_blocks(packed, kind), gguf.quants.dequantize(packed, qtype))


def mapped_rss(path: str) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@needs_smol
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
def test_tensors_read_through_the_map_leave_no_pages_mapped(tmp_path):
    """A tensor read through the file's map is copied; its pages are then dropped from the map, so
    reading a whole model does not hold the file in the process's RSS beside the copies."""
    path = str(tmp_path / "smol.gguf")
    with open(SMOL, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    model = read_gguf(path)
    for name in model.names():
        model.tensor(name)
    assert mapped_rss(path) < os.path.getsize(path) // 10


@pytest.mark.parametrize("stored", list(SIXTEEN_BIT))
def test_16_bit_matrices_read_for_a_16_bit_run_equal_the_float32_path(tmp_path, monkeypatch, stored):
    """Read a slice of rows at a time straight into the run's 16-bit width (no float32 copy while a
    matrix loads): the same values as dequantizing to float32 and narrowing, q/k rows unpermuted."""
    from flexh2o.checkpoints.weights import GGUFWeights
    write_tiny(tmp_path / "m.gguf", untied=True, matrix_type=lambda name: stored)
    monkeypatch.setattr(flexh2o.checkpoints.gguf_reader, "SLICE_BYTES", 200)  # several slices per matrix
    weights = GGUFWeights(str(tmp_path / "m.gguf"))
    read_as_stored = 0
    for name in weights.model.names():
        read_as_stored += weights.model.block_format(name) == stored
        for dtype in (torch.bfloat16, torch.float16):
            got = weights.get(name, weights.model.shape(name), dtype)
            assert got.dtype == dtype and torch.equal(got, weights.model.tensor(name).to(dtype)), name
    assert read_as_stored >= 7


@needs_smol
def test_loading_a_low_bit_file_in_16_bits_counts_the_float32_copy_of_a_matrix():
    """SmolLM2's Q4_1 embedding is dequantized to float32 before it is narrowed to a 16-bit run's
    width: the pre-flight's loading transient holds that copy (113 MB), not just the result."""
    from flexh2o.engine.preflight import load_transient
    from flexh2o.models import resolve_model
    from flexh2o.engine.policy import Policy
    spec, _ = resolve_model(SMOL, None)
    layers = spec.build_layers()
    embedding = spec.vocab_size * spec.hidden_size
    assert load_transient(layers, 2, Policy()) >= embedding * (4 + 2)
    assert load_transient(layers, 4, Policy()) < embedding * (4 + 2)  # float32: read in its own width
