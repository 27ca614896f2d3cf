"""What a decode step copies to the compute device, counted where the copies happen (the figure
`make gpu-check` divides by the host-to-device bandwidth for its bounds): with every weight on
disk and the cache on the device, each step reads each weight exactly once, but an input
embedding, which reads only the rows it looks up, and the last layer (the LM head) and every
vector (a bias, a norm), which stay on the compute device whatever the placement."""

import math

import torch
from transformers import LlamaConfig

from flexh2o import Engine, Policy
from conftest import CONFIGS, VOCAB, sixteen_bit_opt
from test_llama import make_tiny_llama


def decode_step_bytes(directory, tmp_path) -> tuple[list, int, int]:
    """Bytes copied to the compute device in each decode step but the last (which prefetches
    nothing); the bytes of the weights loaded whole (each once), and of one row of every table
    looked up by rows (an input embedding). The LM head's layer and the vectors (biases, norms) are
    checked to be on the device."""
    # Weights on disk, cache on the device; overlap off, so that each copy counts in the step that queued
    # it (an I/O thread may run a prefetch for the next token on either side of a step's end).
    policy = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0, overlap=False)
    with Engine.from_pretrained(directory, policy=policy, dtype=torch.float32, offload_dir=str(tmp_path)) as engine:
        engine.generate(torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0)),
                        max_new_tokens=6, eos_token_id=None)
        head = engine.layers[-1]
        assert head.one_of_a_kind and all(s.tier == "gpu" for p in head.home for s in p.segments)
        vectors = [p for layer in engine.layers for p in layer.home if len(p.shape) == 1]
        assert vectors and all(s.tier == "gpu" for p in vectors for s in p.segments)
        whole = sum(math.prod(p.shape) * p.dtype.itemsize for layer in engine.layers[:-1]
                    for p in layer.home[layer.gathered:] if len(p.shape) > 1)
        row = sum(p.shape[1] * p.dtype.itemsize for layer in engine.layers for p in layer.home[:layer.gathered])
        return engine.last_stats.step_h2d_bytes[1:-1], whole, row


def test_each_weight_is_read_once_per_token(tmp_path):
    """Every weight moves whole once per token but the input embedding, which moves one row per
    sequence (two sequences: one or two distinct tokens)."""
    directory = tmp_path / "llama"
    make_tiny_llama(str(directory), LlamaConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64)
    steps, whole, row = decode_step_bytes(str(directory), tmp_path)
    assert all(whole + row <= step <= whole + 2 * row for step in steps), (steps, whole, row)


def test_a_tied_embedding_is_read_once_per_token(tiny_models, tmp_path):
    """OPT ties its LM head to the token table: the head holds it on the compute device; the input
    embedding reads only the rows (of tokens and of positions) it looks up from its copy on disk."""
    directory, _ = tiny_models["tiny"]
    steps, whole, row = decode_step_bytes(directory, tmp_path)
    table = VOCAB * CONFIGS["tiny"]["hidden_size"] * 4
    assert whole == sum(p.numel() * 4 for n, p in tiny_models["tiny"][1].named_parameters()
                        if "layers." in n and p.dim() > 1)  # the decoder layers' matrices only
    assert all(whole + row <= step <= whole + 2 * row for step in steps), (steps, whole, row)
    assert all(step < whole + table for step in steps)


def test_a_16_bit_checkpoint_moves_half_the_bytes(tiny_models, tmp_path):
    """The same OPT saved in float16: its matrices stay 16-bit on disk (gguf_blocks.keeps_16_bit),
    and a decode step reads half the bytes of the float32 checkpoint's."""
    steps32, whole32, row32 = decode_step_bytes(tiny_models["tiny"][0], tmp_path / "32")
    steps16, whole16, row16 = decode_step_bytes(sixteen_bit_opt(tmp_path, torch.float16), tmp_path / "16")
    assert whole16 * 2 == whole32 and row16 * 2 == row32
    assert all(whole16 + row16 <= step <= whole16 + 2 * row16 for step in steps16), (steps16, whole16, row16)
