"""The C kernels (flexh2o/native): the same bytes and values as quant.py's torch path, whatever the
shape, dtype, strides and thread split; a machine that cannot build them keeps the torch path."""

import pytest
import torch

from flexh2o import native
from flexh2o.compression import quant
from flexh2o.compression.formats import NATIVE_DTYPES

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


def by_torch(fn, *args, **kwargs):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("FLEXH2O_NATIVE", "0")
        return fn(*args, **kwargs)


def values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(*shape[:-1], 1, generator=g) * 10 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=g)
    x = torch.randn(*shape, generator=g) * spread + torch.randn(*shape[:-1], 1, generator=g)
    return x.to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (7, 1), (2, 3, 130), (33, 256), (4, 4097)])
def test_bytes_and_values_equal_the_torch_path(shape, dtype):
    x = values(shape, dtype)
    packed = quant.quantize(x)
    assert torch.equal(packed, by_torch(quant.quantize, x))
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(quant.dequantize(packed, shape[-1], dtype=out_dtype),
                           by_torch(quant.dequantize, packed, shape[-1], dtype=out_dtype))


@needs_kernels
def test_strided_inputs_and_outputs():
    x = values((6, 4, 200), torch.float32)
    view = x.transpose(0, 1)[..., 10:150]  # rows not adjacent, a row's values adjacent
    assert torch.equal(quant.quantize(view), by_torch(quant.quantize, view))
    columns = x[..., :64].transpose(-1, -2)  # a row's values not adjacent: copied first
    assert torch.equal(quant.quantize(columns), by_torch(quant.quantize, columns))
    packed = quant.quantize(x[..., :130])
    for out in (torch.empty(4, 6, 140).transpose(0, 1)[..., :130], torch.empty(6, 4, 130, 2)[..., 0]):
        expected = by_torch(quant.dequantize, packed, 130, out.clone())
        assert torch.equal(quant.dequantize(packed, 130, out), expected)


@needs_kernels
@pytest.mark.parametrize("width", [64 * 40, 1000])
def test_split_over_threads_to_the_same_bytes(monkeypatch, width):
    x = values((50, width), torch.float32)
    one_thread = quant.quantize(x)
    monkeypatch.setattr(native, "PARALLEL_VALUES", 1)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert torch.equal(quant.quantize(x), one_thread)
        out = torch.full((50, width), float("nan"))
        quant.dequantize(one_thread, width, out)
        assert torch.equal(out, by_torch(quant.dequantize, one_thread, width))
    finally:
        torch.set_num_threads(with_threads)


def test_without_a_compiler_the_torch_path_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library() is None
    x = values((3, 128), torch.float32)
    assert torch.equal(quant.dequantize(quant.quantize(x), 128), by_torch(quant.dequantize, by_torch(quant.quantize, x), 128))


def test_a_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake && exit 0\nexit 1\n')  # a build fails
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library() is None
    assert list((tmp_path / "cache" / "flexh2o" / "native").iterdir()) == []


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FLEXH2O_NATIVE", "0")
    assert native.library() is None


def test_the_portable_build_equals_the_torch_path_too(monkeypatch, tmp_path):
    """Built without -march=native (no AVX2 here): the plain C loops a CPU without AVX2 runs."""
    monkeypatch.setattr(native, "FLAGS", tuple(f for f in native.FLAGS if f != "-march=native") + ("-mno-avx2",))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    for shape, dtype in [((5, 100), torch.float32), ((3, 128), torch.bfloat16), ((2, 64), torch.float16)]:
        x = values(shape, dtype)
        packed = quant.quantize(x)
        assert torch.equal(packed, by_torch(quant.quantize, x))
        assert torch.equal(quant.dequantize(packed, shape[-1]), by_torch(quant.dequantize, packed, shape[-1]))


@needs_kernels
@pytest.mark.parametrize("out_dtype", list(NATIVE_DTYPES))
def test_a_bad_group_comes_back_non_finite_in_every_width(out_dtype):
    x = values((3, 200), torch.float32)
    x[1, 70], x[2, 3] = float("nan"), float("inf")
    back = quant.dequantize(quant.quantize(x, check=False), 200, dtype=out_dtype)
    assert not torch.isfinite(back[1, 64:128]).any() and not torch.isfinite(back[2, :64]).any()
    assert torch.isfinite(back[0]).all() and torch.equal(back[0], by_torch(quant.dequantize, quant.quantize(x[:1]), 200,
                                                                             dtype=out_dtype)[0])
