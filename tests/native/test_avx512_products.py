"""The float32 products on a CPU with AVX-512 (native/pairs.h: two weight rows a register) bit-equal
to the 256-bit path's: the kernels built a second time with AVX-512 turned off, every format's
product compared bit for bit at 1, 2, 9 and 33 rows of x."""

import gguf
import numpy as np
import pytest
import torch

from flexh2o import native
from flexh2o.compression import quant
from flexh2o.compression.formats import NATIVE_FORMATS, SIXTEEN_BIT

pytestmark = [
    pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here"),
    pytest.mark.skipif(" avx512f " not in native._cpu_id().replace("\n", " ") + " ",
                       reason="this CPU has no AVX-512 (avx512f): its kernels are the 256-bit ones"),
]


def weight(fmt: str, n: int, k: int) -> torch.Tensor:
    """n rows of k values in `fmt`, each row of its own magnitude; one row all zeros, one so small that
    its float16 scales are subnormal."""
    g = np.random.default_rng(n)
    values = (g.standard_normal((n, k)) * 10.0 ** g.integers(-3, 3, (n, 1)) + g.standard_normal((n, 1)))
    values[n // 2] = 0
    values[1] = g.standard_normal(k) * 1e-5
    values = values.astype(np.float32)
    if fmt == "groups":
        return quant.quantize(torch.from_numpy(values))
    if fmt in SIXTEEN_BIT:
        return torch.from_numpy(values).to(SIXTEEN_BIT[fmt]).view(torch.uint8)
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt]).copy())


def product(lib, fmt: str, x: torch.Tensor, data: torch.Tensor, k: int) -> torch.Tensor:
    n = data.shape[0]
    out = torch.full((len(x), n), float("nan"))
    lib.matmul_all(NATIVE_FORMATS[fmt], x.data_ptr(), len(x), x.stride(0), k, data.data_ptr(), out.data_ptr(), n, n,
                   2)
    return out


def test_the_products_equal_the_256_bit_builds_bit_for_bit(tmp_path):
    without = native.build_at(str(tmp_path), native.FLAGS + ("-mno-avx512f",))
    k = 192
    x = torch.randn(33, k + 5, generator=torch.Generator().manual_seed(0))[:, 2: k + 2]  # rows not adjacent
    for fmt in NATIVE_FORMATS:
        data = weight(fmt, 53, k)  # 53 weight rows: some left over by every grouping of 2, 4 and 8
        for rows in (1, 2, 9, 33):
            got, expected = product(native.library(), fmt, x[:rows], data, k), product(without, fmt, x[:rows], data, k)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (fmt, rows)
