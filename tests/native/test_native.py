"""The C kernels (flexh2o/native): the same bytes and values as quant.py's torch path, whatever the
shape, dtype, strides and thread split; a machine that cannot build them keeps the torch path."""

import ctypes
import hashlib
import json
import os
import sys

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


# -- the kernels' cache: a library that is not what its build made is never loaded ------------------

def fake_compiler(tmp_path, library: str | None) -> str:
    """A compiler that answers --version and builds by copying `library` to its -o path (None: every
    build fails), noting each build (its link, the call without -c) in tmp_path/builds."""
    cc = tmp_path / "cc"
    build = f'cp "{library}" "$2"' if library else "exit 1"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake-cc 1.0 && exit 0\n'
                  f'case " $* " in *" -c "*) ;; *) echo build >> "{tmp_path / "builds"}" ;; esac\n'
                  f'while [ "$#" -gt 0 ]; do [ "$1" = -o ] && {build} && exit 0; shift; done\nexit 1\n')
    cc.chmod(0o755)
    return str(cc)


def put(path, data: bytes):
    """path <- data under a new inode: a library this process has mapped is never written in place."""
    with open(str(path) + ".new", "wb") as f:
        f.write(data)
    os.replace(str(path) + ".new", path)


def builds(tmp_path) -> int:
    return len((tmp_path / "builds").read_text().splitlines()) if (tmp_path / "builds").exists() else 0


def loaded_digests(monkeypatch) -> list:
    """The SHA-256 of every file ctypes.CDLL loads from now on, taken as it is called."""
    seen, real = [], native.ctypes.CDLL

    def cdll(path, *args, **kwargs):
        with open(path, "rb") as f:
            seen.append(hashlib.sha256(f.read()).hexdigest())
        return real(path, *args, **kwargs)
    monkeypatch.setattr(native.ctypes, "CDLL", cdll)
    return seen


def kernels_built_from(monkeypatch, tmp_path):
    """The session's real kernels, copied in by fake_compiler into a fresh cache: (target, their bytes)."""
    real = native.library()._name
    monkeypatch.setenv("CC", fake_compiler(tmp_path, real))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library() is not None and builds(tmp_path) == 1
    target = os.path.join(native.cache_dir(), f"kernels-{native.build()}.so")
    return target, open(real, "rb").read()


DAMAGE = {
    "cut-short": lambda lib: lib[:1000],
    "one-byte-changed": lambda lib: lib[:5000] + bytes([lib[5000] ^ 1]) + lib[5001:],
    "another-program": lambda lib: open(sys.executable, "rb").read(),
    "empty": lambda lib: b"",
}


@needs_kernels
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_library_unlike_its_build_is_built_again_and_never_loaded(monkeypatch, tmp_path, capsys, damage):
    target, good = kernels_built_from(monkeypatch, tmp_path)
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library() is not None and builds(tmp_path) == 1  # as recorded: loaded without a build
    put(target, DAMAGE[damage](good))
    monkeypatch.setattr(native, "_loaded", {})
    capsys.readouterr()
    seen = loaded_digests(monkeypatch)
    assert native.library() is not None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: {target} ") and err[0].endswith(": built again"), err
    assert builds(tmp_path) == 2 and seen == [hashlib.sha256(good).hexdigest()]
    assert open(target, "rb").read() == good


RECORDS = {
    "missing": None,
    "a-list": "[]",
    "null": "null",
    "a-string": '"kernels"',
    "size-as-text": lambda record: json.dumps(dict(record, size=str(record["size"]))),
    "another-library": lambda record: json.dumps(dict(record, library="kernels-0000000000000000.so")),
    "nested-deeply": "[" * 100000,
    "not-json": "{",
}


@needs_kernels
@pytest.mark.parametrize("case", RECORDS)
def test_a_record_of_the_build_that_is_not_one_means_a_new_build(monkeypatch, tmp_path, capsys, case):
    target, good = kernels_built_from(monkeypatch, tmp_path)
    record = native.record_path(target)
    if RECORDS[case] is None:
        os.remove(record)
    else:
        text = RECORDS[case]
        put(record, (text if isinstance(text, str) else text(json.load(open(record)))).encode())
    monkeypatch.setattr(native, "_loaded", {})
    capsys.readouterr()
    assert native.library() is not None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: {target} ") and err[0].endswith(": built again"), err
    assert builds(tmp_path) == 2 and json.load(open(record))["size"] == len(good)


def test_a_library_unlike_its_build_that_cannot_be_built_again_is_refused_in_one_line(monkeypatch, tmp_path,
                                                                                       capsys):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, None))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library() is None  # no build yet, and this compiler fails: the torch path, without a word
    assert capsys.readouterr().err == ""
    target = os.path.join(native.cache_dir(), f"kernels-{native._loaded['build']}.so")
    put(target, b"\x7fELF" + bytes(100))  # someone's file where this build's library would lie
    monkeypatch.setattr(native, "_loaded", {})
    seen = loaded_digests(monkeypatch)
    assert native.library() is None and seen == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: {target} "), err
    assert "building it again failed (the compiler exited with 1)" in err[0]
    assert err[0].endswith("flexh2o's C kernels are off for this run (torch's operations instead)")


def test_a_build_of_other_sources_declares_what_they_have():
    """build_at's library may come from an older checkout (kernel_speed.py --against): a kernel its
    sources lack is left out there, and is an error for the package's own library."""
    libc = ctypes.CDLL(None)
    signatures = {"strlen": ([ctypes.c_char_p], ctypes.c_size_t), "no_such_kernel": ([], None)}
    native._declare(libc, signatures, missing_ok=True)
    assert libc.strlen(b"four") == 4
    with pytest.raises(AttributeError):
        native._declare(libc, signatures)


@needs_kernels
@pytest.mark.parametrize("threads, streams, ahead", [(1, 1, 0), (2, 4, 256), (2, 16, 1024)])
def test_the_bandwidth_probe_reads_every_byte_it_counts(threads, streams, ahead):
    import numpy as np
    data = np.random.default_rng(threads + streams).integers(0, 256, 1 << 20, dtype=np.uint8)
    fold = ctypes.c_uint64()
    read = native.library().read_bytes(data.ctypes.data, data.nbytes, threads, streams, ahead, ctypes.byref(fold))
    assert read == data.nbytes
    assert fold.value == int(np.bitwise_xor.reduce(data.view(np.uint64)))
    assert native.library().read_bytes(data.ctypes.data, data.nbytes, threads, 17, ahead, ctypes.byref(fold)) == -1
