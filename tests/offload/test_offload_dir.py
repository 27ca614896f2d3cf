"""The offload dir exists only while something is on disk: it is not created when nothing goes
there, and what a run created for it is removed at the end (a dir that was there stays)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from flexh2o.offload import offload_dir
from flexh2o.offload.disk import DiskStore
from flexh2o.run import main

RUN = ["--prompt-len", "8", "--gen-len", "2", "--dtype", "float32", "--gpu-batch-size", "4"]


def test_nothing_on_disk_creates_no_offload_dir(tiny_models, tmp_path):
    model, _ = tiny_models["tiny"]
    assert main(["--model", model, *RUN, "--offload-dir", str(tmp_path / "a" / "b")]) == 0
    assert not (tmp_path / "a").exists()


def test_the_default_offload_dir_is_not_created_when_the_fitted_placement_keeps_off_disk(tiny_models, tmp_path,
                                                                                         monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, _ = tiny_models["tiny"]
    assert main(["--model", model, *RUN, "--gpu-mem", "100KB"]) == 0
    assert re.search(r"placing --weights gpu=\d+,cpu=\d+,disk=0 ", capsys.readouterr().err)
    assert not (tmp_path / "flexh2o_offload").exists()


def test_dirs_created_for_the_offload_files_are_removed_with_them(tiny_models, tmp_path):
    model, _ = tiny_models["tiny"]
    assert main(["--model", model, *RUN, "--weights", "disk=100", "--offload-dir", str(tmp_path / "a" / "b")]) == 0
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    assert main(["--model", model, *RUN, "--cache", "disk=100", "--offload-dir", str(tmp_path / "kept")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_a_folder_a_parallel_run_makes_meanwhile_is_used_and_left_to_it(tmp_path, monkeypatch):
    mkdir, theirs = os.mkdir, str(tmp_path / "a")

    def raced(path, *args, **kw):
        if path == theirs:  # the other run gets there between our look and our mkdir
            mkdir(path, *args, **kw)
        mkdir(path, *args, **kw)
    monkeypatch.setattr(offload_dir.os, "mkdir", raced)
    store = DiskStore(str(tmp_path / "a" / "b"))
    monkeypatch.undo()
    store.close()
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and list((tmp_path / "a").iterdir()) == []


def test_an_offload_dir_another_run_removes_meanwhile_is_made_again(tmp_path, monkeypatch):
    mkdtemp, shared, calls = tempfile.mkdtemp, tmp_path / "flexh2o_offload", []
    shared.mkdir()

    def raced(**kw):
        calls.append(kw)
        if len(calls) == 1:  # the other run ends between our make_dirs and mkdtemp, taking the empty dir
            shutil.rmtree(shared)
        return mkdtemp(**kw)
    monkeypatch.setattr(offload_dir.tempfile, "mkdtemp", raced)
    store = DiskStore(str(shared))
    assert os.path.isdir(store.dir) and len(calls) == 2
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_runs_sharing_a_new_nested_offload_dir_leave_nothing(tmp_path):
    """Three runs share a nested folder only the first created; whichever order they end in, the
    last leaves no folder behind (each removes what is empty of it)."""
    for order in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        base = tmp_path / "-".join(map(str, order))
        base.mkdir()
        stores = [DiskStore(str(base / "a" / "b" / "c")) for _ in range(3)]
        for i in order:
            stores[i].close()
        assert os.listdir(base) == [], order


def test_a_dead_runs_folder_is_removed_and_a_live_ones_is_not(tmp_path, capsys):
    """A run killed with SIGKILL leaves its folder; the next run on this host removes it, saying so,
    and never touches a live run's folder, another host's, or one it cannot tell the origin of."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    host = offload_dir._host()
    dead = tmp_path / f"flexh2o-run-{host}-{dead_pid}-abcd1234"
    live = tmp_path / f"flexh2o-run-{host}-{os.getpid()}-live0000"
    other = tmp_path / f"flexh2o-run-otherhost-{dead_pid}-abcd1234"
    unknown = tmp_path / "flexh2o-run-old12345"
    for d in (dead, live, other, unknown):
        d.mkdir()
        (d / "t000001.bin").write_bytes(b"x" * 100)
    store = DiskStore(str(tmp_path))
    try:
        assert not dead.exists() and live.exists() and other.exists() and unknown.exists()
        assert f"note: removed {dead}, the offload files of a run on this host whose process is gone" in \
            capsys.readouterr().err
        name = os.path.basename(store.dir)
        assert name.startswith(f"flexh2o-run-{host}-{os.getpid()}-")
    finally:
        store.close()
