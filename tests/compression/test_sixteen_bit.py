"""A 16-bit checkpoint kept 16-bit in a float32 run whose weights do not all sit on the compute
tier (gguf_blocks.keeps_16_bit): placed as stored on every tier, widened exactly at each
load or multiplied as it is (native/blocks.c), the pre-flight counting the bytes placed; a run
gives the tokens of the same checkpoint widened and used in place."""

import dataclasses
import math

import pytest
import torch

from flexh2o import Engine, Policy, native
from flexh2o.compression import gguf_blocks, grouped_weight
from flexh2o.engine.preflight import layer_bytes
from flexh2o.models import with_stored_formats
from flexh2o.models.llama import LlamaSpec
from flexh2o.models.opt import PRESETS
from flexh2o.host.hardware import from_dict
from flexh2o.host.process_memory import DEFAULT_GROWTH
from flexh2o.planning.search import search
from flexh2o.planning.placement import fits

from conftest import TEST_CPU_PROFILE, sixteen_bit_opt  # noqa: E402
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
        matrices = sum(1 for layer in engine.layers for p in layer.home if len(p.decoded_shape or p.shape) == 2
                       and (p.decoded_shape or p.shape)[-1] % 32 == 0)
        assert kept(engine) == {fmt: matrices}
        head = engine.layers[-1].home[-1]  # the LM head: 16-bit too, never widened
        assert head.fmt == fmt and head.any_rows and engine.tiers.multiplied_as_stored(head)
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


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_every_plan_for_a_16_bit_checkpoint_passes_the_pre_flight():
    """Under a cap, the search may only choose what the engine's pre-flight then admits: a placement
    that keeps the checkpoint 16-bit holds each layer's 16-bit copies while loading, one with the
    weights all on the compute tier does not, so loading's transient is counted per placement."""
    # A small vocabulary: loading's peak is a layer's, not the embedding table's.
    spec = dataclasses.replace(PRESETS["opt-125m"], num_layers=4, vocab_size=512)
    matrices = [(name, "F16") for layer in spec.build_layers() for name, shape in layer.weight_specs()
                if len(shape) == 2]
    spec = with_stored_formats(spec, tuple(matrices))
    profile = from_dict(TEST_CPU_PROFILE, "test")
    cpu, planned = torch.device("cpu"), set()
    for cap in range(40 << 20, 400 << 20, 5 << 20):
        ram = cap + DEFAULT_GROWTH  # what the process may grow by is left out of the cap
        caps = {"gpu": ram, "cpu": ram, "ram": ram, "disk": 1 << 40, "given": ()}
        plan = search(spec, 64, 8, profile, caps, Policy(), dtype="float32", max_batch=16)
        if plan is not None:
            planned.add((plan.policy.w_gpu_percent, plan.policy.batch_size))
            assert fits(spec, plan.policy, 4, 64, 8, caps, cpu), (cap, plan.policy)
    assert any(w_gpu < 100 for w_gpu, _ in planned) and any(w_gpu == 100 for w_gpu, _ in planned)


@needs_kernels
def test_the_lm_head_is_multiplied_as_stored_past_the_kernels_rows_and_never_widened(tmp_path):
    """The head multiplies a row per sequence: a gpu-batch of 40 with prompts of 16 tokens makes a
    prompt step of 640 rows, past the 512 at which the other matrices are widened, and still no
    float32 copy of the head is made."""
    model = sixteen_bit_opt(tmp_path, torch.float16)
    policy = Policy(40, 1, 0, 100)
    ids = torch.randint(3, 60, (40, 16), generator=torch.Generator().manual_seed(0))
    with Engine.from_pretrained(model, policy, device="cpu", dtype=torch.float32) as engine:
        head, made, new_buffer = engine.layers[-1].home[-1], [], engine.tiers._new_buffer
        assert head.fmt == "F16" and head.decoded_shape[0] > 32
        engine.tiers._new_buffer = lambda key: made.append(key[0]) or new_buffer(key)
        sixteen = engine.generate(ids, max_new_tokens=4, output_scores=True)
        assert made and head.decoded_shape not in made
    with Engine.from_pretrained(model, Policy(40, 1, 100, 0), device="cpu", dtype=torch.float32) as engine:
        assert_same_run(sixteen, engine.generate(ids, max_new_tokens=4, output_scores=True))


def test_a_16_bit_model_twice_the_cap_is_planned_with_several_sequences_per_gpu_batch():
    """Issue 30's synthetic Llama (1.26B, F16, untied head: 2.35 GB) under a 1.5 GB cgroup, 1.2 GB
    of it free after the process's own 0.3 GB: kept 16-bit (the head and the embedding too, 0.4 GB
    each in float32), a float32 run is planned gpu-batches of many sequences, which the pre-flight
    admits."""
    spec = LlamaSpec(name="synthetic-1.26b", num_layers=24, hidden_size=2048, num_heads=32, num_kv_heads=4,
                     ffn_dim=5632, vocab_size=49152, max_positions=4096)
    spec = with_stored_formats(spec, tuple((name, "F16") for layer in spec.build_layers()
                                           for name, shape in layer.weight_specs() if len(shape) == 2))
    ram = (1200 << 20) + DEFAULT_GROWTH
    caps = {"gpu": ram, "cpu": ram, "ram": ram, "disk": 1 << 40, "given": ()}
    plan = search(spec, 128, 16, from_dict(TEST_CPU_PROFILE, "test"), caps, Policy(), dtype="float32",
                  total_batch=32)
    assert plan.policy.gpu_batch_size >= 8 and plan.policy.w_gpu_percent < 100
    assert fits(spec, plan.policy, 4, 128, 16, caps, torch.device("cpu"))
