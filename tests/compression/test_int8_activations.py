"""--int8-activations (compression/int8_activations.py): off by default, and then the int8 kernel is
never called; on, a float32 CPU run multiplies its GGUF blocks with int8 activations, as float32
would multiply the rows quantized and widened again; refused in one line where it cannot apply, noted where nothing would take it."""

import numpy as np
import pytest
import torch

from flexh2o import Engine, Policy, UsageError, native
from flexh2o.compression import grouped_weight, int8_activations
from flexh2o.compression.grouped_weight import GroupedWeight

from test_gguf_blocks import tiny_blocks_model  # noqa: E402
from test_int8_dots import quantized_by_numpy  # noqa: E402

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")
IDS = torch.randint(5, 64, (3, 8), generator=torch.Generator().manual_seed(0))


def counted_int8_calls(monkeypatch) -> list:
    """Counts the calls of the int8 kernel from now on."""
    lib, calls = native.library(), []
    kernel = lib.matmul_int8

    def counting(*args):
        calls.append(args[2])  # the rows of x
        return kernel(*args)
    monkeypatch.setattr(lib, "matmul_int8", counting)
    return calls


def run(model, int8: bool, **kwargs):
    """The run's output, and (format, int8) of every GGUF-block product it made."""
    products, matmul = [], GroupedWeight.matmul

    def noted(weight, x):
        products.append((weight.fmt, weight.int8))
        return matmul(weight, x)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(GroupedWeight, "matmul", noted)
        with Engine.from_pretrained(model, Policy(3, int8_activations=int8), device="cpu", dtype=torch.float32,
                                    **kwargs) as engine:
            return engine.generate(IDS, max_new_tokens=5, output_scores=True), set(products)


@needs_kernels
def test_off_by_default_the_int8_kernel_is_never_called(tmp_path, monkeypatch):
    model = tiny_blocks_model(tmp_path)
    calls = counted_int8_calls(monkeypatch)
    out, products = run(model, False)
    assert Policy().int8_activations is False
    assert products == {("Q4_0", False), ("Q4_1", False), ("Q8_0", False)} and calls == []
    again, _ = run(model, False)
    assert torch.equal(out.sequences, again.sequences) and all(map(torch.equal, out.scores, again.scores))


def quantized_first(x, data, k, fmt="groups", int8=False, matmul=grouped_weight.matmul):
    """The float32 product of x's rows quantized and widened again as int8_dots.c quantizes them."""
    if not int8:
        return matmul(x, data, k, fmt)
    rows = x.reshape(-1, k).contiguous()
    q, dx, _ = quantized_by_numpy(rows)
    widened = torch.from_numpy(q.astype(np.float32) * dx[..., None]).view(rows.shape)
    return matmul(widened, data, k, fmt).view(*x.shape[:-1], -1)


@needs_kernels
def test_on_the_blocks_take_int8_activations_as_the_quantized_float32_product(tmp_path, monkeypatch):
    model = tiny_blocks_model(tmp_path)
    plain, _ = run(model, False)
    calls = counted_int8_calls(monkeypatch)
    out, products = run(model, True)
    assert products == {("Q4_0", True), ("Q4_1", True), ("Q8_0", True)}
    assert calls and max(calls) <= 24 and 3 in calls  # the prompt's 24 tokens, then a row per sequence
    monkeypatch.setattr(grouped_weight, "matmul", quantized_first)
    emulated, _ = run(model, True)
    # The prompt step's logits (near 35 in this model) agree within float32 summation; later a value
    # may round to the next int8 code the other way, moving a logit by up to 0.3 here.
    assert torch.equal(out.sequences, emulated.sequences)
    assert (out.scores[0] - emulated.scores[0]).abs().max() <= 1e-4 * emulated.scores[0].abs().max()
    assert not torch.equal(out.scores[0], plain.scores[0])


def test_refused_where_it_cannot_apply():
    with pytest.raises(UsageError, match="--int8-activations: applies where the CPU computes"):
        int8_activations.check("cuda", torch.float32, ())
    with pytest.raises(UsageError, match="--int8-activations: applies to float32 runs.*bfloat16"):
        int8_activations.check("cpu", torch.bfloat16, (("w", "Q4_1"),))


def test_refused_before_loading_in_another_dtype(tmp_path):
    model = tiny_blocks_model(tmp_path)
    with pytest.raises(UsageError) as e:
        Engine.from_pretrained(model, Policy(3, int8_activations=True), device="cpu", dtype=torch.bfloat16)
    assert e.value.flag == "--int8-activations"


def test_noted_where_no_matrix_would_take_it(tiny_models, capsys, monkeypatch):
    directory, _ = tiny_models["tiny"]  # float32 safetensors: nothing kept in blocks
    calls = counted_int8_calls(monkeypatch) if native.library() is not None else []
    out, _ = run(directory, True)
    err = capsys.readouterr().err
    assert "note: --int8-activations does not apply" in err and calls == []
    plain, _ = run(directory, False)
    assert torch.equal(out.sequences, plain.sequences) and all(map(torch.equal, out.scores, plain.scores))


def test_noted_without_the_kernels(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLEXH2O_NATIVE", "0")
    run(tiny_blocks_model(tmp_path), True)
    assert "note: --int8-activations does not apply here: flexh2o's C kernels are not built" in capsys.readouterr().err
