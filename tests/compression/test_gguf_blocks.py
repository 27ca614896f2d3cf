"""A GGUF file's Q4_0/Q4_1/Q8_0 matrices kept in their own blocks in a float32 run (gguf_blocks.py,
native/blocks.c): dequantized bit-equal to gguf_reader.py's widening, multiplied within float32
summation error of it, and a whole run equal to the widened one (no kernels built) on every tier,
full and H2O, with nothing widened while loading and the pre-flight counting the blocks' bytes."""

import math

import gguf
import numpy as np
import pytest
import torch

from flexh2o import Engine, Policy, native
from flexh2o.compression import gguf_blocks, grouped_weight
from flexh2o.checkpoints.gguf_reader import _dequantize_blocks
from flexh2o.engine.preflight import layer_bytes
from flexh2o.compression.formats import NATIVE_DTYPES

from test_gguf import write_tiny  # noqa: E402

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def blocks_of(values: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt]).copy())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
def test_dequantized_blocks_are_gguf_readers_values_bit_for_bit(kernel_path, fmt, dtype):
    values = np.random.default_rng(1).standard_normal((37, 96)).astype(np.float32) * 3
    blocks = blocks_of(values, fmt)
    assert blocks.shape == (37, gguf_blocks.row_bytes(fmt, 96))
    expected = torch.from_numpy(np.ascontiguousarray(_dequantize_blocks(blocks.numpy(), fmt))).view(37, 96)
    assert torch.equal(gguf_blocks.dequantize(blocks, fmt, 96, dtype=dtype), expected.to(dtype))


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 7, 9, 33])
def test_the_product_equals_dequantize_then_multiply(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    blocks = blocks_of(np.random.default_rng(rows).standard_normal((45, 160)).astype(np.float32), fmt)
    weight = gguf_blocks.dequantize(blocks, fmt, 160).double()
    x = torch.randn(rows, 163, generator=g)[:, 1:161]  # rows not adjacent in memory
    got = grouped_weight.matmul(x, blocks, 160, fmt)
    scale = x.abs().double() @ weight.abs().T
    assert got.shape == (rows, 45) and ((got.double() - x.double() @ weight.T).abs() <= 1e-6 * scale).all()


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")
@pytest.mark.parametrize("fmt", FORMATS + ["F16", "BF16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_is_the_same_alone_as_among_others(fmt, threads, monkeypatch):
    """A row alone is multiplied four weight rows at a time (blocks.c's wide_block), among others a
    weight row at a time: bit-equal, whatever the weight rows' count (here not a multiple of four)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    values = np.random.default_rng(3).standard_normal((53, 192)).astype(np.float32)
    if fmt in FORMATS:
        blocks = blocks_of(values, fmt)
    else:
        blocks = torch.from_numpy(values).to({"F16": torch.float16, "BF16": torch.bfloat16}[fmt]).view(torch.uint8)
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(4))
    together = grouped_weight.matmul(x, blocks, 192, fmt)
    for r in range(9):
        assert torch.equal(grouped_weight.matmul(x[r:r + 1], blocks, 192, fmt), together[r:r + 1]), (fmt, r)


def tiny_blocks_model(tmp_path, mixed_qkv=False) -> str:
    """A tiny Llama GGUF with matrices in every kept format (q/k/v in one, or, mixed, in two)."""
    def matrix_type(name):
        if ".k_proj." in name and mixed_qkv:
            return "Q4_1"
        for part, fmt in ((".self_attn.", "Q4_0"), ("gate", "Q4_1"), ("up", "Q4_1"), ("down", "Q8_0"),
                          ("embed", "Q8_0")):
            if part in name:
                return fmt
        return None
    path = str(tmp_path / "blocks.gguf")
    write_tiny(path, matrix_type=matrix_type)
    return path


def placed_bytes(engine) -> int:
    """Bytes of every weight as placed, on all tiers."""
    return sum((seg.stop - seg.start) * math.prod(p.shape[1:]) * p.dtype.itemsize
               for layer in engine.layers for p in layer.home for seg in p.segments)


PLACEMENTS = {"memory": (100, 0), "cpu": (0, 100), "disk": (0, 0), "mixed": (40, 30)}


@pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kv", ["full", "h2o"])
def test_a_run_on_kept_blocks_agrees_with_the_widened_run(tmp_path, monkeypatch, placement, kv):
    model = tiny_blocks_model(tmp_path)
    ids = torch.randint(5, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    h2o = dict(kv_policy="h2o", hh_ratio=0.3, recent_ratio=0.3) if kv == "h2o" else {}
    runs = {}
    for kept, compress in ((False, False), (True, False), (True, True)):
        monkeypatch.setenv("FLEXH2O_NATIVE", "1" if kept else "0")  # without kernels: widened while loading
        policy = Policy(3, 1, *PLACEMENTS[placement], compress_weight=compress, **h2o)
        with Engine.from_pretrained(model, policy, device="cpu", dtype=torch.float32,
                                    offload_dir=str(tmp_path / "off")) as engine:
            placed = [p for layer in engine.layers for p in layer.home if p.decoded_shape is not None]
            assert {p.fmt for p in placed} == ({"Q4_0", "Q4_1", "Q8_0"} if kept else set())
            assert sum(layer_bytes(engine.layers, 4, policy)) == placed_bytes(engine)
            out = engine.generate(ids, max_new_tokens=6, output_scores=True)
            runs[kept, compress] = out
    assert torch.equal(runs[True, False].sequences, runs[False, False].sequences)
    assert torch.equal(runs[True, True].sequences, runs[True, False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[True, True].scores, runs[True, False].scores))
    # float32 sums in another order, through layers of unit-variance weights (logits near 35): the
    # widened product itself differs by 1e-5, the kernel's by up to 6e-4 (a wrong block: by whole units)
    for a, b in zip(runs[True, False].scores, runs[False, False].scores):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_q_k_v_in_two_formats_are_joined_as_flexh2os_groups(tmp_path):
    model = tiny_blocks_model(tmp_path, mixed_qkv=True)
    with Engine.from_pretrained(model, Policy(2, compress_weight=True), device="cpu", dtype=torch.float32) as engine:
        attention = [layer for layer in engine.layers if "SelfAttention" in type(layer).__name__]
        assert attention and all(layer.home[1].fmt == "groups" and layer.home[2].fmt == "Q4_0" for layer in attention)
        engine.generate(torch.randint(5, 64, (2, 6)), max_new_tokens=3)


def test_without_kernels_or_in_a_16_bit_run_the_file_is_widened_while_loading(tmp_path, monkeypatch):
    model = tiny_blocks_model(tmp_path)
    monkeypatch.setenv("FLEXH2O_NATIVE", "0")
    with Engine.from_pretrained(model, Policy(2), device="cpu", dtype=torch.float32) as engine:
        assert all(p.decoded_shape is None for layer in engine.layers for p in layer.home)
    monkeypatch.delenv("FLEXH2O_NATIVE")
    with Engine.from_pretrained(model, Policy(2), device="cpu", dtype=torch.bfloat16) as engine:
        assert all(p.decoded_shape is None for layer in engine.layers for p in layer.home)


def test_q_k_v_in_two_formats_are_widened_where_nothing_is_quantized(tmp_path):
    """Without --compress-weight nothing may be quantized: the fused matrix is widened, exactly."""
    model = tiny_blocks_model(tmp_path, mixed_qkv=True)
    with Engine.from_pretrained(model, Policy(2), device="cpu", dtype=torch.float32) as engine:
        attention = [layer for layer in engine.layers if "SelfAttention" in type(layer).__name__]
        assert attention and all(layer.home[1].decoded_shape is None and layer.home[2].fmt == "Q4_0"
                                 for layer in attention)
        engine.generate(torch.randint(5, 64, (2, 6)), max_new_tokens=3)


def test_in_bfloat16_the_blocks_are_quantized_into_groups_for_the_int4_kernel(tmp_path):
    """The bfloat16 kernel (int4_tiles.py) takes quant.py's groups only; the pre-flight counts those."""
    model = tiny_blocks_model(tmp_path)
    policy = Policy(2, compress_weight=True)
    with Engine.from_pretrained(model, policy, device="cpu", dtype=torch.bfloat16) as engine:
        assert {p.fmt for layer in engine.layers for p in layer.home if p.decoded_shape is not None} == {"groups"}
        assert sum(layer_bytes(engine.layers, 2, policy)) == placed_bytes(engine)


@pytest.mark.parametrize("compress", [False, True])
def test_a_tied_head_and_its_embedding_in_memory_are_placed_once(tmp_path, compress):
    model = tiny_blocks_model(tmp_path)
    with Engine.from_pretrained(model, Policy(2, compress_weight=compress), device="cpu", dtype=torch.float32) as engine:
        table, head = engine.layers[0].home[0], engine.layers[-1].home[-1]
        assert table is head and table.shape[0] == 64  # the vocabulary's rows
    policy = Policy(2, 1, 0, 0, compress_weight=compress)  # the table on disk, the head in memory: two
    with Engine.from_pretrained(model, policy, device="cpu", dtype=torch.float32, offload_dir=str(tmp_path)) as engine:
        assert engine.layers[0].home[0] is not engine.layers[-1].home[-1]
