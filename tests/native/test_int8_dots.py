"""native/int8_dots.c: rows of x quantized to int8 alone (numpy's rounding of the same float32
arithmetic), their product with GGUF blocks equal to the exact product of the quantized values within
float32 rounding and to float32's within the quantization's bound, the same for a row alone and
among others and on any thread count, and the same bits from every path a CPU may build (VNNI,
AVX2 without it, plain C)."""

import ctypes
import os
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from flexh2o import native
from flexh2o.compression import gguf_blocks, grouped_weight

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def blocks_of(values: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt]).copy())


def weights(fmt: str, n: int, k: int, seed: int = 1):
    """(blocks, their values in float64) of a random [n, k] matrix."""
    blocks = blocks_of(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), fmt)
    return blocks, gguf_blocks.dequantize(blocks, fmt, k).double()


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different sizes, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * 10 ** torch.randint(-2, 3, (m, 1), generator=g).float()


def quantized_by_numpy(x: torch.Tensor):
    """(q, dx, sx) per block of 32, as the header of int8_dots.c defines them."""
    blocks = x.numpy().reshape(len(x), -1, 32)
    amax = np.abs(blocks).max(-1)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int8)
    dx = (amax / np.float32(127)).astype(np.float32)
    return q, dx, (dx * q.sum(-1, dtype=np.int32).astype(np.float32)).astype(np.float32)


def quantized_by_c(lib, x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty(m, lib.int8_row_bytes(k), dtype=torch.uint8)
    lib.quantize_int8(x.data_ptr(), m, x.stride(0), k, out.data_ptr())
    return out


def test_rows_are_quantized_as_the_header_says():
    lib = native.library()
    x = activations(7, 160)
    x[3, 40:72] = 0  # a block of zeros: scale 0, codes 0
    out = quantized_by_c(lib, x)
    q, dx, sx = quantized_by_numpy(x)
    blocks = 160 // 32
    assert np.array_equal(out[:, :160].numpy().view(np.int8).reshape(q.shape), q)
    assert np.array_equal(out[:, 160:160 + 4 * blocks].contiguous().view(torch.float32).numpy(), dx)
    assert np.array_equal(out[:, 160 + 4 * blocks:].contiguous().view(torch.float32).numpy(), sx)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, n, k", [(1, 45, 160), (5, 53, 192), (9, 64, 576), (33, 17, 96)])
def test_the_product_is_the_quantized_rows_product_and_near_float32s(fmt, m, n, k):
    blocks, w = weights(fmt, n, k, seed=m)
    x = activations(m, k + 3, seed=m)[:, 1:k + 1]  # rows not adjacent in memory
    got = grouped_weight.matmul(x, blocks, k, fmt, int8=True).double()
    q, dx, _ = quantized_by_numpy(x.contiguous())
    xq = torch.from_numpy(q.astype(np.float64) * dx[..., None].astype(np.float64)).view(m, k)
    scale = x.abs().double() @ w.abs().T
    assert got.shape == (m, n) and ((got - xq @ w.T).abs() <= 1e-6 * scale).all()
    # Against float32: each value of x moves by at most half its block's step, max|x| / 254.
    step = torch.from_numpy(dx.astype(np.float64) / 2).repeat_interleave(32, dim=1)
    bound = step @ w.abs().T
    exact = x.double() @ w.T
    assert ((got - exact).abs() <= bound + 1e-6 * scale).all()
    assert ((got - exact).abs() <= 0.05 * scale).all() and not torch.equal(got, exact)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_is_the_same_alone_as_among_others(fmt, threads, monkeypatch):
    """Among others, rows go four at a time; weight rows four at a time, the last 53 % 4 one by
    one; 5 or 6 blocks a row. A row's result is the same bits every way."""
    for k in (160, 192):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        blocks, _ = weights(fmt, 53, k)
        x = activations(9, k, seed=4)
        together = grouped_weight.matmul(x, blocks, k, fmt, int8=True)
        for r in range(9):
            assert torch.equal(grouped_weight.matmul(x[r:r + 1], blocks, k, fmt, int8=True), together[r:r + 1]), r
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3 - threads)
        assert torch.equal(grouped_weight.matmul(x, blocks, k, fmt, int8=True), together)


def test_a_row_that_is_not_finite_is_nan_and_leaves_the_others_alone():
    blocks, _ = weights("Q4_1", 20, 96)
    x = activations(3, 96)
    expected = grouped_weight.matmul(x, blocks, 96, "Q4_1", int8=True)
    x[1, 50] = float("inf")
    got = grouped_weight.matmul(x, blocks, 96, "Q4_1", int8=True)
    assert got[1].isnan().all()
    assert torch.equal(got[[0, 2]], expected[[0, 2]])


# Builds of int8_dots.c alone for the paths a CPU without this one's units takes.
PATHS = {"no AVX-512 (AVX-VNNI or AVX2)": ["-march=native", "-mno-avx512f"],
         "AVX2 without VNNI": ["-march=native", "-mno-avx512f", "-mno-avxvnni"],
         "plain C": ["-mno-avx2"]}


def built_alone(tmp_path, flags) -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    source = os.path.join(os.path.dirname(native.__file__), "int8_dots.c")
    target = str(tmp_path / "int8_dots.so")
    common = [f for f in native.FLAGS if f != "-march=native"]
    built = subprocess.run([cc, *common, *flags, native.OPENMP, "-o", target, source, "-lm"], capture_output=True)
    if built.returncode != 0:
        return None
    lib = ctypes.CDLL(target)
    native._declare_int8(lib)
    return lib


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_gives_the_same_bits(tmp_path, path):
    lib = built_alone(tmp_path, PATHS[path])
    if lib is None:
        pytest.skip(f"the compiler cannot build the {path} path here")
    for k in (160, 192, 224, 256):  # 5 to 8 blocks: every count of blocks left over from fours and twos
        x = activations(6, k, seed=2)
        assert torch.equal(quantized_by_c(lib, x), quantized_by_c(native.library(), x))
        for fmt in FORMATS:
            blocks, _ = weights(fmt, 23, k)
            y = torch.empty(6, 23)
            assert lib.matmul_int8(gguf_blocks.NATIVE_FORMATS[fmt], x.data_ptr(), 6, k, k, blocks.data_ptr(),
                                   y.data_ptr(), 23, 23, 2) == 0
            assert torch.equal(y, grouped_weight.matmul(x, blocks, k, fmt, int8=True)), (fmt, k)
