"""A 16-bit checkpoint kept 16-bit in a float32 run whose weights do not all sit on the compute
tier (gguf_blocks.sixteen_bit_at_rest): placed as stored on every tier, widened exactly at each
load or multiplied as it is (native/blocks.c), the pre-flight counting the bytes placed; a run
gives the tokens of the same checkpoint widened and used in place."""

import math
import os
import sys

import pytest
import torch

from flexh2o import Engine, Policy, gguf_blocks, grouped_weight, native
from flexh2o.memory import layer_bytes

sys.path.insert(0, os.path.dirname(__file__))
from conftest import sixteen_bit_opt  # noqa: E402
from test_gguf import write_tiny  # noqa: E402

WIDTHS = {"F16": torch.float16, "BF16": torch.bfloat16}
PLACEMENTS = {"cpu": (0, 100), "disk": (0, 0), "mixed": (40, 30)}  # the weights' gpu and cpu shares
needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


def values_of(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3).to(WIDTHS[fmt])


@pytest.mark.parametrize("fmt", list(WIDTHS))
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_widening_is_exact(kernel_path, fmt, out):
    values = values_of(fmt, 37, 96, 1)
    stored = values.view(torch.uint8)
    assert stored.shape == (37, gguf_blocks.row_bytes(fmt, 96))
    got = gguf_blocks.dequantize(stored, fmt, 96, dtype=torch.float32)
    assert torch.equal(got, values.float())
    if out == torch.bfloat16 and fmt == "BF16":
        assert torch.equal(gguf_blocks.dequantize(stored, fmt, 96, dtype=out), values)


@needs_kernels
@pytest.mark.parametrize("fmt", list(WIDTHS))
@pytest.mark.parametrize("rows", [1, 7, 9, 33])
def test_the_product_on_16_bit_values_equals_widen_then_multiply(fmt, rows):
    values = values_of(fmt, 45, 160, rows)
    x = torch.randn(rows, 163, generator=torch.Generator().manual_seed(rows))[:, 1:161]  # rows not adjacent
    got = grouped_weight.matmul(x, values.view(torch.uint8), 160, fmt)
    weight = values.double()
    scale = x.abs().double() @ weight.abs().T
    assert got.shape == (rows, 45) and ((got.double() - x.double() @ weight.T).abs() <= 1e-6 * scale).all()


def placed_bytes(engine) -> int:
    return sum((seg.stop - seg.start) * math.prod(p.shape[1:]) * p.dtype.itemsize
               for layer in engine.layers for p in layer.home for seg in p.segments)


def run(model, policy, tmp_path, inspect=lambda engine: None):
    ids = torch.randint(3, 60, (policy.batch_size, 10), generator=torch.Generator().manual_seed(0))
    with Engine.from_pretrained(model, policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path / "offload")) as engine:
        inspect(engine)
        return engine.generate(ids, max_new_tokens=6, output_scores=True)


def kept(engine) -> dict:
    """format -> how many placed weights are kept in it."""
    out = {}
    for layer in engine.layers:
        for p in layer.home:
            if p.decoded_shape is not None:
                out[p.fmt] = out.get(p.fmt, 0) + 1
    return out


def assert_same_run(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):  # the kernel sums in another order than torch's product
        assert (x - y).abs().max() <= 1e-5 * y.abs().max()


@needs_kernels
@pytest.mark.parametrize("fmt", list(WIDTHS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kv", ["full", "h2o"])
def test_a_16_bit_checkpoint_is_placed_as_stored_and_runs_as_widened(tmp_path, fmt, placement, kv):
    model = sixteen_bit_opt(tmp_path, WIDTHS[fmt])
    h2o = dict(kv_policy="h2o", hh_ratio=0.3, recent_ratio=0.3) if kv == "h2o" else {}
    policy = Policy(2, 2, *PLACEMENTS[placement], **h2o)

    def inspect(engine):
        matrices = sum(1 for layer in engine.layers[:-1] for p in layer.home if len(p.decoded_shape or p.shape) == 2
                       and (p.decoded_shape or p.shape)[-1] % 32 == 0)
        assert kept(engine) == {fmt: matrices}
        assert all(p.decoded_shape is None for p in engine.layers[-1].home)  # the LM head: float32, in place
        assert sum(layer_bytes(engine.layers, 4, policy)) == placed_bytes(engine)
    sixteen = run(model, policy, tmp_path, inspect)
    widened = run(model, Policy(2, 2, 100, 0, **h2o), tmp_path,
                  lambda engine: kept(engine) == {} or pytest.fail("in place: float32"))
    assert_same_run(sixteen, widened)


def test_weights_all_on_the_compute_tier_or_compressed_are_not_kept_16_bit(tmp_path):
    model = sixteen_bit_opt(tmp_path, torch.float16)
    run(model, Policy(2, 1, 100, 0), tmp_path, lambda engine: assert_kept(engine, set()))
    run(model, Policy(2, 1, 0, 0, compress_weight=True), tmp_path, lambda engine: assert_kept(engine, {"groups"}))
    with Engine.from_pretrained(model, Policy(2, 1, 0, 100), device="cpu", dtype=torch.bfloat16) as engine:
        assert kept(engine) == {}  # a 16-bit run reads them in its own width


def assert_kept(engine, formats: set):
    assert set(kept(engine)) == formats


def test_matrices_whose_rows_are_not_whole_blocks_are_widened(tmp_path):
    model = sixteen_bit_opt(tmp_path, torch.float16, "wide")  # hidden 48: only rows of 96 (fc2) are whole blocks
    policy = Policy(2, 1, 0, 0)

    def inspect(engine):
        shapes = {p.decoded_shape for layer in engine.layers for p in layer.home if p.decoded_shape is not None}
        assert shapes and all(shape[-1] % 32 == 0 for shape in shapes)
        assert sum(layer_bytes(engine.layers, 4, policy)) == placed_bytes(engine)
    assert_same_run(run(model, policy, tmp_path, inspect), run(model, Policy(2, 1, 100, 0), tmp_path))


@needs_kernels
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_gguf_files_f16_matrices_are_kept_and_run_as_widened(tmp_path, placement):
    """q and k are stored permuted (llama.cpp's rotary order): rows of 16-bit values move as rows."""
    model = str(tmp_path / "f16.gguf")
    write_tiny(model, untied=True, matrix_type=lambda name: "F16")
    policy = Policy(2, 1, *PLACEMENTS[placement])

    def inspect(engine):
        assert set(kept(engine)) == {"F16"}
        assert sum(layer_bytes(engine.layers, 4, policy)) == placed_bytes(engine)
    assert_same_run(run(model, policy, tmp_path, inspect), run(model, Policy(2, 1, 100, 0), tmp_path))


def test_q_k_v_in_16_bit_beside_float32_are_joined_widened(tmp_path):
    model = str(tmp_path / "mixed.gguf")
    write_tiny(model, matrix_type=lambda name: "F32" if ".k_proj." in name else "F16")
    policy = Policy(2, 1, 0, 0)

    def inspect(engine):
        attention = [layer for layer in engine.layers if "SelfAttention" in type(layer).__name__]
        assert attention and all(layer.home[1].decoded_shape is None and layer.home[2].fmt == "F16"
                                 for layer in attention)  # q/k/v widened, o kept
        assert sum(layer_bytes(engine.layers, 4, policy)) == placed_bytes(engine)
    assert_same_run(run(model, policy, tmp_path, inspect), run(model, Policy(2, 1, 100, 0), tmp_path))


@pytest.mark.parametrize("name", ["weights-cpu", "weights-disk-cache-cpu", "mixed-act-cpu", "mixed-h2o"])
def test_on_a_simulated_cuda_device_the_16_bit_weights_are_widened_there(tmp_path, monkeypatch, name):
    """On CUDA 16-bit weights move as they are and are widened on the device (gguf_blocks' torch
    path); the run equals the CPU's, in the stream order, and makes no buffer after its first steps."""
    from test_simulated_cuda import MATRIX, NEW_TOKENS, assert_same, cpu_reference, simulated_run
    model = sixteen_bit_opt(tmp_path, torch.float16)
    reference = cpu_reference(model, MATRIX[name], tmp_path)
    out, stats, simulated = simulated_run(model, MATRIX[name], tmp_path, monkeypatch, seed=len(name))
    assert_same(reference, out)
    assert stats.step_allocations[2:] == [0] * (NEW_TOKENS - 2) and simulated.copies > 0
