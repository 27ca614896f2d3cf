"""--json-out: only a regular file or a new path is written, refused before the run otherwise; the
mode follows the umask; a write that fails at the end leaves the report on stdout, one line, exit 1."""

import errno
import json
import os
import re
import stat

import pytest

from flexh2o.common import output_files as output
from flexh2o.common.output_files import write_json_atomic
from flexh2o.run import main

RUN = ["--prompt-len", "8", "--gen-len", "2", "--dtype", "float32", "--gpu-batch-size", "4"]


def fifo(path):
    os.mkfifo(path)


def directory(path):
    os.mkdir(path)


def symlink(path):
    other = path.parent / "other.json"
    other.write_text("keep me")
    os.symlink(other, path)


def device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # what /dev/full is
    except PermissionError:
        pytest.skip("mknod needs root")


def kind(path) -> tuple:
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_rdev, os.readlink(path) if os.path.islink(path) else None


@pytest.mark.parametrize("make", [fifo, directory, symlink, device])
def test_json_out_over_anything_but_a_regular_file_is_refused_before_the_run(tiny_models, tmp_path, capsys, make):
    target = tmp_path / "target"
    make(target)
    before = kind(target)
    model, _ = tiny_models["tiny"]
    assert main(["--model", model, *RUN, "--json-out", str(target)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"error: --json-out: {target} is a"), err
    assert "total throughput" not in out  # refused before the run
    assert kind(target) == before
    if make is symlink:
        assert (tmp_path / "other.json").read_text() == "keep me"


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_json_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(str(tmp_path / "r.json"), {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == mode


def test_json_out_needs_free_space_before_the_run(tiny_models, tmp_path, capsys, monkeypatch):
    class Usage:
        free = 1000
    monkeypatch.setattr(output.shutil, "disk_usage", lambda path: Usage)
    model, _ = tiny_models["tiny"]
    assert main(["--model", model, *RUN, "--json-out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --json-out: cannot write") and "1000 bytes free" in err


def test_a_json_write_that_fails_at_the_end_leaves_the_report_on_stdout(tiny_models, tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(output.os, "fsync", full)
    model, _ = tiny_models["tiny"]
    target = tmp_path / "r.json"
    assert main(["--model", model, *RUN, "--json-out", str(target)]) == 1
    out, err = capsys.readouterr()
    assert re.split(r"[\r\n]", err.rstrip())[-1] == (f"error: --json-out: cannot write {target}: No space left on device; "
                                           "the JSON report went to stdout")
    assert "Traceback" not in err
    assert "total throughput" in out
    assert json.loads(out[out.index("{"):])["prompt_len"] == 8
    assert os.listdir(tmp_path) == []  # neither the target nor a temporary file
