"""flexh2o's C kernels: built on first use with the machine's C compiler, loaded with ctypes.

Torch's operations make one pass over memory each; quantizing a group of values takes a dozen of
them, so 4-bit quantization ran at 0.9 GB/s of float32 on 2 cores where one fused pass runs at
memory speed. The kernels here are plain C, compiled for this CPU (-march=native) into the user's
cache directory, keyed by the source, the flags, the compiler and the CPU; without a compiler,
or with FLEXH2O_NATIVE=0, `library()` is None and callers keep their torch path. A build is written
under a temporary name and renamed, so an interrupted one leaves nothing half-written. The
matrix products split their weight rows over torch's thread count with OpenMP (where the compiler
has it): a decode step's products are small, and handing them to Python threads (split_rows, which
the element-wise kernels keep) cost more than splitting saved.
"""

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading

from flexh2o.common.cache_dir import cache_dir as flexh2o_cache_dir

SOURCES = ("quant4.c", "blocks.c", "attention.c")
HEADERS = ("common.h",)  # hashed with the sources: a change to them is a new build
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = "-fopenmp"  # the products' threads (a compiler without it builds them single-threaded)

_lock = threading.Lock()
_loaded: dict = {}


def cache_dir() -> str:
    return flexh2o_cache_dir("native")


def _cpu_id() -> str:
    """The CPU's model and flags: -march=native builds for them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _compiler() -> tuple[str, str] | None:
    """The C compiler ($CC, else cc) and its --version text; None where there is none."""
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (cc, version.stdout) if version.returncode == 0 else None


def _build(cc: str, target: str):
    here = os.path.dirname(__file__)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.part", dir=os.path.dirname(target))
    os.close(fd)
    sources = [os.path.join(here, s) for s in SOURCES]
    try:
        try:
            subprocess.run([cc, *FLAGS, OPENMP, "-o", partial, *sources, "-lm"], check=True, capture_output=True,
                           timeout=300)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *FLAGS, "-o", partial, *sources, "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def library() -> ctypes.CDLL | None:
    """The kernels, built if this machine has no build of this source yet; None where they cannot
    be (no compiler, a failed build) or are turned off (FLEXH2O_NATIVE=0)."""
    if os.environ.get("FLEXH2O_NATIVE", "1") == "0":
        return None
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        _loaded["lib"] = lib = _load()
        return lib


def build() -> str | None:
    """Which build of the kernels library() loaded (a hash of the sources, flags, compiler and
    CPU), or None where there is none: a profile that timed them records it (profile.py)."""
    return _loaded.get("build") if library() is not None else None


def _load() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        return None
    cc, version = compiler
    key = hashlib.sha256(repr((FLAGS, OPENMP, cc, version, _cpu_id())).encode())
    here = os.path.dirname(__file__)
    for s in SOURCES + HEADERS:
        with open(os.path.join(here, s), "rb") as f:
            key.update(f.read())
    _loaded["build"] = key.hexdigest()[:16]
    target = os.path.join(cache_dir(), f"kernels-{_loaded['build']}.so")
    try:
        if not os.path.exists(target):
            _build(cc, target)
        lib = ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quantize_rows.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, i64, i64]
    lib.dequantize_rows.argtypes = [ptr, i64, ptr, ctypes.c_int, i64, i64, i64]
    lib.dequantize_blocks.argtypes = [ctypes.c_int, ptr, i64, ptr, ctypes.c_int, i64, i64, i64]
    lib.matmul_all.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64, ctypes.c_int]
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int
    lib.quantize_rows.restype = i64
    lib.dequantize_rows.restype = lib.dequantize_blocks.restype = lib.matmul_all.restype = None
    return lib


PARALLEL_VALUES = 1 << 18  # below this many values a kernel runs on the calling thread alone
_pool = None  # threads - 1 workers: the calling thread does a part too
_pool_size = 0


def split_rows(fn, rows: int, values: int):
    """fn(first, last) over [0, rows), in as many parts as torch has threads when `values` (the
    whole work) is large enough to pay for the hand-over; ctypes lets go of the GIL meanwhile."""
    import torch

    threads = min(torch.get_num_threads(), rows)
    if threads <= 1 or values < PARALLEL_VALUES:
        fn(0, rows)
        return
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < threads - 1:
            from concurrent.futures import ThreadPoolExecutor
            _pool, _pool_size = ThreadPoolExecutor(threads - 1, thread_name_prefix="flexh2o-native"), threads - 1
    bounds = [rows * i // threads for i in range(threads + 1)]
    parts = [_pool.submit(fn, a, b) for a, b in zip(bounds[:-2], bounds[1:-1])]
    fn(bounds[-2], bounds[-1])
    for p in parts:
        p.result()
