"""The disk filling up mid-run, after the pre-flight passed: one line naming the offload dir,
the offload files removed, exit code 1, no traceback. Injected (ENOSPC after some writes), and for
real on a small tmpfs where this machine lets the test mount one."""

import errno
import os
import subprocess
import sys
import threading

import pytest

from flexh2o.offload import disk
from flexh2o.run import main
from conftest import REPO, fail_from, last_line

RUN = ["--prompt-len", "8", "--gen-len", "4", "--dtype", "float32", "--gpu-batch-size", "2"]


# The run below writes 8 times while placing the weights (its vectors stay in memory), then the cache:
# the prompt's (writes 9-12), then each token's (13-24).
@pytest.mark.parametrize("writes,overlap", [(3, "--overlap"), (10, "--overlap"), (20, "--overlap"),
                                            (20, "--no-overlap")],
                         ids=["placing-weights", "prompt-cache", "decode-cache", "decode-cache-no-overlap"])
def test_a_full_disk_mid_run_is_one_line_and_leaves_nothing(tiny_models, tmp_path, capsys, monkeypatch,
                                                            writes, overlap):
    calls = fail_from(monkeypatch, disk, "pwrite_all", writes, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    model, _ = tiny_models["tiny"]
    offload = tmp_path / "off"
    offload.mkdir()
    code = main(["--model", model, *RUN, "--weights", "cpu=50,disk=50", "--cache", "disk=100", overlap,
                 "--offload-dir", str(offload)])
    out, err = capsys.readouterr()
    assert len(calls) >= writes
    assert code == 1
    line = last_line(err)
    assert line == (f"error: --offload-dir: cannot write the offload files in {offload}: the disk is full; "
                    "the run stopped and its offload files were removed")
    assert "Traceback" not in err and "total throughput" not in out
    assert os.listdir(offload) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("flexh2o-io")], "I/O threads left running"


# The process itself, with the fault injected by a wrapper: exits 1 within seconds of it, no fatal-error
# dump from the interpreter's shutdown while a thread still ran.
INJECTED = """
import errno, os, sys, time
from flexh2o.offload import disk
real, calls = disk.pwrite_all, []
def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) >= {writes}:
        with open({stamp!r}, "w") as f:
            f.write(repr(time.time()))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(*args, **kwargs)
disk.pwrite_all = failing
from flexh2o.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_a_process_whose_disk_fills_during_decode_exits_at_once(tiny_models, tmp_path, overlap):
    model, _ = tiny_models["tiny"]
    offload, stamp = tmp_path / "off", str(tmp_path / "fault")
    offload.mkdir()
    r = subprocess.run([sys.executable, "-c", INJECTED.format(writes=30, stamp=stamp), "--model", model, *RUN,
                        "--gen-len", "12", "--weights", "cpu=50,disk=50", "--cache", "disk=100", overlap,
                        "--offload-dir", str(offload)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Fatal Python error" not in r.stderr
    assert last_line(r.stderr).endswith("the disk is full; the run stopped and its offload files were removed")
    assert os.listdir(offload) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_real_disk_filling_up_mid_run(tiny_models, small_tmpfs):
    model, _ = tiny_models["tiny"]
    # --disk-mem claims more room than the tmpfs has, so the pre-flight passes and the run fills it.
    r = subprocess.run([sys.executable, "-m", "flexh2o.run", "--model", model, "--prompt-len", "16", "--gen-len", "40",
                        "--gpu-batch-size", "64", "--dtype", "float32", "--cache", "disk=100", "--disk-mem", "1GB",
                        "--offload-dir", str(small_tmpfs)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert last_line(r.stderr).endswith("the disk is full; the run stopped and its offload files were "
                                                      "removed")
    assert os.listdir(small_tmpfs) == []
