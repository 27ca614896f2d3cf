"""flexh2o's C kernels: built on first use with the machine's C compiler, loaded with ctypes.

Torch's operations make one pass over memory each; quantizing a group of values takes a dozen of
them, so 4-bit quantization ran at 0.9 GB/s of float32 on 2 cores where one fused pass runs at
memory speed. The kernels here are plain C, compiled for this CPU (-march=native) into the user's
cache directory, keyed by the source, the flags, the compiler and the CPU; without a compiler,
or with FLEXH2O_NATIVE=0, `library()` is None and callers keep their torch path. A build is written
under a temporary name and renamed, so an interrupted one leaves nothing half-written; beside it,
`kernels-BUILD.json` records its size and SHA-256. A library in the cache that does not match its
record (cut short, another program's, or none recorded) is never loaded: it is built again, or, where
that fails, the kernels are off for the run, in one line either way. The
matrix products split their weight rows over torch's thread count with OpenMP (where the compiler
has it): a decode step's products are small, and handing them to Python threads (split_rows, which
the element-wise kernels keep) cost more than splitting saved.
"""

import concurrent.futures
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading

from flexh2o.common.cache_dir import cache_dir as flexh2o_cache_dir
from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.common.output_files import write_json_atomic

SOURCES = ("quant4.c", "blocks.c", "sixteen_bit.c", "attention.c", "layer_ops.c", "int8_dots.c", "decode_layers.c",
           "read_rate.c")
HEADERS = ("common.h", "pairs.h", "int8_tiles.h")  # hashed with the sources: a change to them is a new build
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = "-fopenmp"  # the products' threads (a compiler without it builds them single-threaded)

_lock = threading.Lock()
_loaded: dict = {}
MISSING = "is missing"  # (no build yet: built without a word)
MAX_RECORD = 1 << 16  # bytes: a build's record takes about 150


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


def record_path(target: str) -> str:
    return target[:-len(".so")] + ".json"


def _build(cc: str, target: str, flags: tuple = FLAGS, here: str = os.path.dirname(__file__)):
    """Compiles the kernels (the sources in `here`) into `target`, then records its size and SHA-256 beside it."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.part", dir=os.path.dirname(target))
    os.close(fd)
    sources = [os.path.join(here, s) for s in SOURCES]
    try:
        with tempfile.TemporaryDirectory(prefix="flexh2o-build-") as objects:
            try:
                _compile_and_link(cc, (*flags, OPENMP), sources, objects, partial)
            except subprocess.CalledProcessError:
                _compile_and_link(cc, flags, sources, objects, partial)
        with open(partial, "rb") as f:
            data = f.read()
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    write_json_atomic(record_path(target), {"library": os.path.basename(target), "size": len(data),
                                            "sha256": hashlib.sha256(data).hexdigest()})


def _compile_and_link(cc: str, flags: tuple, sources: list, objects: str, target: str):
    """Each source compiled on its own, as many at once as there are CPUs (a first build takes the
    time of the longest, blocks.c, not of them all), then linked into `target`."""
    made = [os.path.join(objects, os.path.basename(s)[:-len(".c")] + ".o") for s in sources]
    compile_flags = [f for f in flags if f != "-shared"]

    def run(argv):
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        for done in [pool.submit(run, [cc, *compile_flags, "-c", source, "-o", obj]) for source, obj in zip(sources, made)]:
            done.result()
    run([cc, *flags, "-o", target, *made, "-lm"])


def _recorded(target: str) -> dict | str:
    """The record of the build at `target` ({"library", "size", "sha256"}), or what is wrong with it."""
    where = record_path(target)
    try:
        with open(where, "rb") as f:
            text = f.read(MAX_RECORD + 1)
    except FileNotFoundError:
        return f"has no record of its build beside it ({where})"
    except OSError as e:
        return f"has a record that cannot be read ({where}: {e.strerror})"
    try:
        record = parse_json(text) if len(text) <= MAX_RECORD else None
    except BadJson:
        record = None
    if not isinstance(record, dict) or record.get("library") != os.path.basename(target) or \
            not isinstance(record.get("size"), int) or isinstance(record["size"], bool) or \
            not isinstance(record.get("sha256"), str):
        return f"has a record that is not its build's ({where})"
    return record


def _unlike_its_build(target: str) -> str | None:
    """None where the library at `target` is what its build made (its size and SHA-256); else why not."""
    try:
        with open(target, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    record = _recorded(target)
    if isinstance(record, str):
        return record
    if len(data) != record["size"]:
        return f"holds {len(data)} bytes where its build made {record['size']} (cut short, or another file)"
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return "is not the library its build made (another SHA-256)"
    return None


def _note(line: str):
    print(f"note: {line}", file=sys.stderr, flush=True)


def _turned_off() -> bool:
    """FLEXH2O_NATIVE=0, read at every call (tests turn it on and off): from os.environ's own dict,
    one lookup, where os.environ.get takes four Python calls and a decode step asks about 400 times."""
    if _ENVIRON is None:
        return os.environ.get("FLEXH2O_NATIVE", "1") == "0"
    return _ENVIRON.get(_OFF_KEY) == _OFF_VALUE


# os.environ's dict of encoded names and values (CPython's, on every platform); None elsewhere.
_ENVIRON = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_OFF_KEY, _OFF_VALUE = (os.environ.encodekey("FLEXH2O_NATIVE"), os.environ.encodevalue("0")) if _ENVIRON is not None \
    else (None, None)


def library() -> ctypes.CDLL | None:
    """The kernels, built if this machine has no build of this source yet; None where they cannot
    be (no compiler, a failed build) or are turned off (FLEXH2O_NATIVE=0)."""
    if _turned_off():
        return None
    lib = _loaded.get("lib", _loaded)  # (without the lock once loaded: a decode step asks often)
    if lib is not _loaded:
        return lib
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        _loaded["lib"] = lib = _load()
        return lib


def build() -> str | None:
    """Which build of the kernels library() loaded (a hash of the sources, flags, compiler and
    CPU), or None where there is none: a profile that timed them records it (profile.py)."""
    return _loaded.get("build") if library() is not None else None


def build_at(directory: str, flags: tuple = FLAGS, sources: str = os.path.dirname(__file__)) -> ctypes.CDLL | None:
    """The kernels in `sources` built with `flags` into `directory`, outside the cache: a build to
    compare with library()'s (tests, scripts/kernel_speed.py). None where there is no compiler."""
    compiler = _compiler()
    if compiler is None:
        return None
    target = os.path.join(directory, "kernels.so")
    _build(compiler[0], target, flags, sources)
    lib = ctypes.CDLL(target)
    _declare(lib, missing_ok=True)
    return lib


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
    off = "flexh2o's C kernels are off for this run (torch's operations instead)"
    why = _unlike_its_build(target)
    if why is not None:
        try:
            _build(cc, target)
        except (OSError, subprocess.SubprocessError) as e:
            if why != MISSING:
                _note(f"{target} {why}, and building it again failed ({_failure(e)}): {off}")
            return None
        found = _unlike_its_build(target)
        if found is not None:
            _note(f"{target} {found} right after its build (another process may be building it): {off}")
            return None
        if why != MISSING:
            _note(f"{target} {why}: built again")
    try:
        lib = ctypes.CDLL(target)
        _declare(lib)
    except (OSError, AttributeError) as e:  # AttributeError: a kernel missing from the library
        _note(f"{target} cannot be loaded as flexh2o's kernels ({e}): {off}")
        return None
    return lib


def _failure(error: Exception) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        lines = (error.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"the compiler said: {lines[-1][:200]}" if lines else f"the compiler exited with {error.returncode}"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error)


_i64, _ptr, _f32, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# Each kernel's (argument types, result type), as ctypes takes them.
SIGNATURES = {
    "quantize_rows": ([_ptr, _i32, _i64, _i64, _ptr, _i64, _i64], _i64),
    "dequantize_rows": ([_ptr, _i64, _ptr, _i32, _i64, _i64, _i64], None),
    "dequantize_blocks": ([_i32, _ptr, _i64, _ptr, _i32, _i64, _i64, _i64], None),
    "matmul_all": ([_i32, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32], None),
    "decode_attention": ([_ptr, _i64, _f32, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i32], _i32),
    "rms_norm_rows": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr, _i64, _i32], None),
    "rotate_rows": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32], None),
    "silu_mul_rows": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _i32], None),
    "append_token": ([_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64],
                     None),
    "llama_attention_decode": ([_ptr, _i64, _i64, _ptr, _f32, _i32, _i32, _ptr, _i32, _i32, _ptr, _i64, _i64, _i64,
                                _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i32], _i32),
    "llama_mlp_decode": ([_ptr, _i64, _i64, _ptr, _f32, _i32, _i32, _ptr, _i32, _i32, _ptr, _i64, _ptr, _i32], _i32),
    "llama_layers_decode": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                             _f32, _ptr, _i32], _i32),
    "llama_layer_fields": ([], _i64),
    "read_bytes": ([_ptr, _i64, _i32, _i32, _i32, _ptr], _i64),
    "sixteen_bit_width": ([], _i32),
}
# int8_dots.c's (a build of that file alone takes them too).
INT8_SIGNATURES = {
    "int8_row_bytes": ([_i64], _i64),
    "quantize_int8": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "matmul_int8_rows": ([_i32, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64], None),
    "matmul_int8": ([_i32, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i32], _i32),
}


def _declare(lib, signatures: dict = SIGNATURES | INT8_SIGNATURES, missing_ok: bool = False):
    """Sets each kernel's types; missing_ok: one these sources do not have (an older checkout's
    build, build_at) is left out instead of failing."""
    for name, (args, result) in signatures.items():
        if missing_ok and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result


def _declare_int8(lib):
    _declare(lib, INT8_SIGNATURES)


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
