"""native/sixteen_bit.c: F16 and BF16 weight rows times float32 rows of x, the same bits from every
path a CPU may build (AVX-512, AVX2, plain C), a row's result the same alone as among others, and
near the exact product."""

import pytest
import torch

from flexh2o import native
from flexh2o.compression.formats import NATIVE_FORMATS, SIXTEEN_BIT

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")

PATHS = {"no AVX-512": ("-mno-avx512f",), "plain C": ("-mno-avx2",)}
K, N = 160, 53  # 53 weight rows: some left over from every tile and chunk


def product(lib, fmt: str, x: torch.Tensor, w: torch.Tensor, threads: int = 2) -> torch.Tensor:
    out = torch.full((len(x), N), float("nan"))
    lib.matmul_all(NATIVE_FORMATS[fmt], x.data_ptr(), len(x), x.stride(0), K, w.view(torch.uint8).data_ptr(),
                   out.data_ptr(), N, N, threads)
    return out


def inputs(fmt: str):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(N, K, generator=g) * 10.0 ** torch.randint(-2, 3, (N, 1), generator=g)).to(SIXTEEN_BIT[fmt])
    x = torch.randn(9, K + 3, generator=g)[:, 1:K + 1]  # rows not adjacent in memory
    return x, w


@pytest.mark.parametrize("fmt", list(SIXTEEN_BIT))
def test_a_rows_product_is_the_same_alone_as_among_others_and_near_the_exact_one(fmt):
    x, w = inputs(fmt)
    together = product(native.library(), fmt, x, w)
    for r in range(len(x)):
        assert torch.equal(product(native.library(), fmt, x[r:r + 1], w, threads=1), together[r:r + 1]), r
    exact = x.double() @ w.double().T
    assert ((together.double() - exact).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T)).all()


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_gives_the_same_bits(tmp_path, path):
    flags = tuple(f for f in native.FLAGS if f != "-march=native" or path != "plain C") + PATHS[path]
    lib = native.build_at(str(tmp_path), flags)
    if lib is None:
        pytest.skip(f"the compiler cannot build the {path} path here")
    for fmt in SIXTEEN_BIT:
        x, w = inputs(fmt)
        for rows in (1, 2, 3, 5, 9):
            got, expected = product(lib, fmt, x[:rows], w), product(native.library(), fmt, x[:rows], w)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (fmt, rows)
