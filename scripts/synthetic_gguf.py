"""A synthetic Llama bigger than a small memory cgroup, written as an F16 GGUF that llama.cpp and
flexh2o both load: random weights (normal, std 0.02; norms 1), SmolLM2's tokenizer copied from its
GGUF so that both engines have a vocabulary.

    python scripts/synthetic_gguf.py OUT.gguf [--layers 24 --hidden 2048 ...]

The default shape is issue 30's 1.26B model: 24 layers, hidden 2048, 32 heads (4 KV heads), ffn
5632, vocabulary 49152, untied head; 2.52 GB. Tensors are written one at a time (never the whole
model in memory), into OUT.gguf.partial, renamed when complete.
"""

import argparse
import os

import gguf
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_SOURCE = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SHAPE = {"layers": 24, "hidden": 2048, "heads": 32, "kv_heads": 4, "ffn": 5632}


def tensor_shapes(s: dict, vocab: int) -> dict:
    """GGUF tensor name -> numpy shape (rows, columns), in the order written."""
    head_dim = s["hidden"] // s["heads"]
    kv = s["kv_heads"] * head_dim
    shapes = {"token_embd.weight": (vocab, s["hidden"])}
    for i in range(s["layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (s["hidden"],), f"blk.{i}.attn_q.weight": (s["hidden"], s["hidden"]),
                   f"blk.{i}.attn_k.weight": (kv, s["hidden"]), f"blk.{i}.attn_v.weight": (kv, s["hidden"]),
                   f"blk.{i}.attn_output.weight": (s["hidden"], s["hidden"]),
                   f"blk.{i}.ffn_norm.weight": (s["hidden"],), f"blk.{i}.ffn_gate.weight": (s["ffn"], s["hidden"]),
                   f"blk.{i}.ffn_up.weight": (s["ffn"], s["hidden"]),
                   f"blk.{i}.ffn_down.weight": (s["hidden"], s["ffn"])}
    return shapes | {"output_norm.weight": (s["hidden"],), "output.weight": (vocab, s["hidden"])}


def copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> int:
    """Copies the tokenizer.* keys of the source GGUF; gives its vocabulary size."""
    reader = gguf.GGUFReader(source)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def write_model(path: str, shape: dict = SHAPE, seed: int = 0) -> dict:
    """Writes the model unless path exists; gives the tensor shapes."""
    partial = path + ".partial"
    writer = gguf.GGUFWriter(partial, "llama")  # opens no file before write_header_to_file
    vocab = copy_tokenizer(writer, TOKENIZER_SOURCE)
    shapes = tensor_shapes(shape, vocab)
    if os.path.exists(path):
        return shapes
    writer.add_name("flexh2o synthetic llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, dims in shapes.items():
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in shapes.items():
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
    writer.close()
    os.replace(partial, path)
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    for key, value in SHAPE.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    a = ap.parse_args()
    shapes = write_model(a.out, {key: getattr(a, key) for key in SHAPE})
    params = sum(int(np.prod(d)) for d in shapes.values())
    print(f"{a.out}: {params / 1e9:.2f}B parameters, {os.path.getsize(a.out) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
