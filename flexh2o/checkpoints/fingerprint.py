"""A model's identity in the outputs: the SHA-256 of its files.

A GGUF file is one file. A model directory is its config, the weight files the engine reads and
its tokenizer's files: their digest is the SHA-256 of one line per file, its name and its own
SHA-256. A file's SHA-256 is computed once per version of the file (its path, size, modification
time and inode) and kept in $XDG_CACHE_HOME/flexh2o/file_hashes.json, so that only the first run
on a file of many gigabytes reads it whole. A file in the Hugging Face hub's cache is not read at
all: the hub names a large file's blob after its SHA-256.
"""

import glob
import hashlib
import os

from flexh2o.common.cache_dir import cache_dir
from flexh2o.common.json_data import parse_json
from flexh2o.common.messages import say
from flexh2o.common.output_files import write_json_atomic

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model")
ANNOUNCE_BYTES = 1 << 30  # reading more than this is announced first
CHUNK = 8 << 20


def cache_path() -> str:
    return cache_dir("file_hashes.json")


def model_files(path: str) -> list[str]:
    """The files whose bytes make the model at `path` (a GGUF file or a model directory)."""
    if os.path.isfile(path):
        return [path]
    weights = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(glob.glob(os.path.join(path, "*.bin")))
    named = [os.path.join(path, n) for n in ("config.json", *TOKENIZER_FILES)]
    return sorted([p for p in named if os.path.isfile(p)] + weights)


def model_sha256(path: str | None, log=None) -> str | None:
    """The SHA-256 of the model at `path` (see above); None for dummy weights (no path). log: where
    a long first read is announced (default: stderr)."""
    if path is None:
        return None
    files = model_files(path)
    cache = _read_cache()
    keys = {f: _key(f) for f in files}
    for f in files:
        if cache.get(keys[f]) is None and (named := hub_blob_sha256(f)) is not None:
            cache[keys[f]] = named
    todo = [f for f in files if cache.get(keys[f]) is None]
    size = sum(os.path.getsize(f) for f in todo)
    if size > ANNOUNCE_BYTES:
        (log or say)(f"note: reading {size / 2**30:.1f} GiB of {path} once for its SHA-256, which the outputs "
                         f"record (kept in {cache_path()} for later runs)")
    for f in todo:
        real = keys[f].split("|", 1)[0] + "|"
        for stale in [k for k in cache if k.startswith(real)]:  # the same file's earlier versions
            del cache[stale]
        cache[keys[f]] = _file_sha256(f)
    if todo:
        _write_cache(cache)
    if os.path.isfile(path):
        return cache[keys[path]]
    lines = "".join(f"{os.path.basename(f)} {cache[keys[f]]}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def hub_blob_sha256(path: str) -> str | None:
    """The SHA-256 the hub's cache names a file by (snapshots/REV/NAME links to blobs/SHA256), or None."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and len(name) == 64 and \
            all(c in "0123456789abcdef" for c in name):
        return name
    return None


def _key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _read_cache() -> dict:
    """The cached SHA-256 by file version; whatever in the file is not one (the file broken, edited,
    of another shape) is left out, and computed again where it is needed."""
    try:
        with open(cache_path(), "rb") as f:
            cache = parse_json(f.read())
    except (OSError, ValueError):  # none yet, or not JSON (BadJson is a ValueError)
        return {}
    if not isinstance(cache, dict):
        return {}
    return {k: v for k, v in cache.items() if is_sha256(v)}


def _write_cache(cache: dict):
    """Best effort: a cache that cannot be written costs the next run a read, nothing else."""
    try:
        os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
        write_json_atomic(cache_path(), {k: v for k, v in cache.items() if isinstance(v, str)})
    except OSError:
        pass
