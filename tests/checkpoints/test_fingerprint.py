"""A model's SHA-256, which outputs record: of a file, of a directory's files, computed once per
version of each file (checkpoints/fingerprint.py); and the flexh2o version beside it."""

import hashlib
import json
import os
import re

import pytest

from flexh2o.checkpoints import fingerprint
from flexh2o.common.version import version


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_file_is_its_own_sha256_and_read_once_per_version(cache, monkeypatch):
    path = cache / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    assert fingerprint.model_sha256(str(path)) == sha(path.read_bytes())
    reads = []
    real = fingerprint._file_sha256
    monkeypatch.setattr(fingerprint, "_file_sha256", lambda p: reads.append(p) or real(p))
    assert fingerprint.model_sha256(str(path)) == sha(path.read_bytes()) and reads == []  # from the cache
    path.write_bytes(b"GGUF changed")
    os.utime(path, ns=(1, 1))  # another version, whatever the clock's resolution
    assert fingerprint.model_sha256(str(path)) == sha(b"GGUF changed") and len(reads) == 1
    assert sum(str(path) in key for key in fingerprint._read_cache()) == 1  # the old version's entry is gone


def test_a_directory_is_a_line_per_file_of_its_model(cache):
    model = cache / "model"
    model.mkdir()
    files = {"config.json": b"{}", "model-00001.safetensors": b"a", "model-00002.safetensors": b"b",
             "tokenizer.json": b"{}", "README.md": b"not the model", "model.bin": b"not read beside safetensors"}
    for name, data in files.items():
        (model / name).write_bytes(data)
    lines = "".join(f"{n} {sha(files[n])}\n" for n in sorted(files) if n not in ("README.md", "model.bin"))
    assert fingerprint.model_sha256(str(model)) == sha(lines.encode())
    (model / "README.md").write_bytes(b"edited")
    assert fingerprint.model_sha256(str(model)) == sha(lines.encode())
    (model / "model-00002.safetensors").write_bytes(b"c")
    assert fingerprint.model_sha256(str(model)) != sha(lines.encode())


def test_dummy_weights_have_none_and_a_long_read_is_announced(cache, monkeypatch):
    assert fingerprint.model_sha256(None) is None
    path = cache / "big.gguf"
    path.write_bytes(bytes(4096))
    monkeypatch.setattr(fingerprint, "ANNOUNCE_BYTES", 1024)
    notes = []
    fingerprint.model_sha256(str(path), log=notes.append)
    assert len(notes) == 1 and notes[0].startswith(f"note: reading 0.0 GiB of {path} once for its SHA-256")
    fingerprint.model_sha256(str(path), log=notes.append)
    assert len(notes) == 1  # cached: nothing to announce


def test_a_file_in_the_hubs_cache_is_named_by_its_sha256_and_not_read(cache, monkeypatch):
    data = b"safetensors bytes"
    blobs, snapshot = cache / "models--org--m" / "blobs", cache / "models--org--m" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / sha(data)).write_bytes(data)
    (snapshot / "model.safetensors").symlink_to(blobs / sha(data))
    (snapshot / "config.json").write_bytes(b"{}")  # a small file the hub keeps by its git hash: read
    monkeypatch.setattr(fingerprint, "_file_sha256", lambda p: "read:" + os.path.basename(p))
    assert fingerprint.model_sha256(str(snapshot)) == \
        sha(f"config.json read:config.json\nmodel.safetensors {sha(data)}\n".encode())


def test_a_broken_or_unwritable_cache_costs_a_read_and_nothing_else(cache, monkeypatch):
    path = cache / "m.gguf"
    path.write_bytes(b"weights")
    os.makedirs(os.path.dirname(fingerprint.cache_path()))
    with open(fingerprint.cache_path(), "w") as f:
        f.write("{not json")
    assert fingerprint.model_sha256(str(path)) == sha(b"weights")
    (cache / "a file").write_bytes(b"")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache / "a file"))  # no directory can be made under it
    assert fingerprint.model_sha256(str(path)) == sha(b"weights")


@pytest.mark.parametrize("shape", ["[]", "null", '"x"', "7", "[" * 100000, "not-a-sha256", "a-number", "a-list"],
                         ids=["list", "null", "string", "number", "nested-deeply", "not-a-sha256", "a-number", "a-list"])
def test_a_cache_of_another_shape_is_computed_again_never_taken(cache, shape):
    path = cache / "m.gguf"
    path.write_bytes(b"weights")
    os.makedirs(os.path.dirname(fingerprint.cache_path()))
    key = fingerprint._key(str(path))
    entry = {"not-a-sha256": "f" * 63, "a-number": 5, "a-list": [sha(b"weights")]}
    text = json.dumps({key: entry[shape]}) if shape in entry else shape
    with open(fingerprint.cache_path(), "w") as f:
        f.write(text)
    assert fingerprint.model_sha256(str(path)) == sha(b"weights")
    assert fingerprint._read_cache() == {key: sha(b"weights")}


def test_the_version_names_the_package_and_in_a_checkout_its_commit():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\+g[0-9a-f]{12}(-dirty)?)?", version()), version()
