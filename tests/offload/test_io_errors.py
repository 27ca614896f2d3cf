"""An error inside any I/O task ends the run within seconds: one line naming what failed, exit
code 1, the offload files removed, no I/O thread left running. Before, a failed cache store kept
its pooled buffers and the next load waited for them forever (issue 23, point 2)."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from flexh2o.offload import buffers, disk, tiers
from flexh2o.offload.buffers import Buffers
from flexh2o.kv.home import CacheHome
from flexh2o.run import main
from conftest import REPO, fail_from, last_line

# 3 gpu-batches with overlap on: loads of one gpu-batch run while another's store is out.
RUN = ["--prompt-len", "8", "--gen-len", "8", "--dtype", "float32", "--gpu-batch-size", "2",
       "--num-gpu-batches", "3", "--overlap"]
EIO = OSError(errno.EIO, os.strerror(errno.EIO))


def packed(tiers_, buf, segments):
    return buf.dtype == torch.uint8


# (what fails, where it is injected, from which call, placement, the line's cause)
CASES = {
    "weight-load-from-disk": (disk, "pread_all", 6, ["--weights", "cpu=50,disk=50"], "loading weights failed: "),
    "compressed-weight-load": (tiers.Tiers, "fill", 6, ["--weights", "cpu=50,disk=50", "--compress-weight"],
                               "loading compressed weights failed: ", packed),
    "host-copy": (tiers, "copy_in_memory", 6, ["--weights", "gpu=50,cpu=50"], "loading weights failed: "),
    "cache-load": (CacheHome, "_read", 10, ["--cache", "disk=100"], "loading the KV cache failed: "),
    "cache-store": (CacheHome, "_write", 10, ["--cache", "cpu=0,disk=100"], "storing the KV cache failed: "),
    "cache-read-from-disk": (disk, "pread_all", 10, ["--cache", "disk=100"], "loading the KV cache failed: "),
    "cache-write-to-disk": (disk, "pwrite_all", 30, ["--cache", "disk=100"],
                            "--offload-dir: cannot write the offload files in "),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_an_io_task_error_ends_the_run_in_one_line(tiny_models, tmp_path, capsys, monkeypatch, case):
    owner, name, call, placement, cause, *when = CASES[case]
    calls = fail_from(monkeypatch, owner, name, call, EIO, *when)
    model, _ = tiny_models["tiny"]
    offload = tmp_path / "off"
    offload.mkdir()
    code = main(["--model", model, *RUN, *placement, "--offload-dir", str(offload)])
    out, err = capsys.readouterr()
    assert len(calls) >= call, "the error was never injected"
    assert code == 1, err
    line = last_line(err)
    assert line.startswith("error: " + cause), line
    assert "Input/output error" in line
    assert line.endswith("; the run stopped and its offload files were removed")
    assert "Traceback" not in err and "total throughput" not in out
    assert os.listdir(offload) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("flexh2o-io")]


@pytest.mark.timeout(60)
def test_an_engine_runs_again_after_a_failed_run(tiny_models, tmp_path, monkeypatch):
    """The failure is the run's, not the engine's: the pool and the I/O threads serve the next run."""
    from flexh2o import Engine
    from flexh2o.engine.policy import Policy
    from flexh2o.offload.io_tasks import IOTaskError
    model, _ = tiny_models["tiny"]
    policy = Policy(2, 3, 100, 0, 0, 0, 100, 0, overlap=True)  # cache on disk
    ids = torch.randint(3, 100, (6, 8), generator=torch.Generator().manual_seed(0))
    with Engine.from_pretrained(model, policy, dtype=torch.float32, offload_dir=str(tmp_path)) as engine:
        expected = engine.generate(ids, max_new_tokens=6)
        with monkeypatch.context() as m:
            fail_from(m, CacheHome, "_write", 8, RuntimeError("injected"))
            with pytest.raises(IOTaskError, match="storing the KV cache failed: injected"):
                engine.generate(ids, max_new_tokens=6)
        assert torch.equal(engine.generate(ids, max_new_tokens=6), expected)


def test_a_buffer_wait_gives_up_after_its_timeout(monkeypatch):
    monkeypatch.setattr(buffers, "BUFFER_WAIT_SECONDS", 0.2)
    pool = Buffers("cpu", torch.float32)
    pool.reserve((4,), count=1)
    pool.buffer((4,))
    with pytest.raises(RuntimeError, match=r"no pooled gpu buffer \[4\] came back in 0 s"):
        pool.buffer((4,))


def test_a_failed_task_wakes_whoever_waits_for_a_buffer():
    pool = Buffers("cpu", torch.float32)
    pool.reserve((4,), count=1)
    pool.buffer((4,))
    got = []

    def wait():
        try:
            pool.buffer((4,))
        except OSError as e:
            got.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    pool.fail(EIO)
    waiter.join(5)
    assert got == [EIO]
    pool.clear_pool()
    assert pool.failure is None


EXITS = """
import sys
import torch
from flexh2o import Engine, Policy
from flexh2o.offload import tiers
real = tiers.copy_in_memory
calls = []
def failing(dst, src):
    calls.append(1)
    if len(calls) == 8:
        raise OSError(5, "Input/output error")
    return real(dst, src)
tiers.copy_in_memory = failing
engine = Engine.from_pretrained(sys.argv[1], policy=Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=50),
                                dtype=torch.float32)
try:
    engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=6)
except Exception as e:
    print("caught:", e)
# no close(): the interpreter shuts down with the engine's I/O threads started
"""


def test_a_process_ends_cleanly_after_an_io_error_without_closing_its_engine(tiny_models):
    model, _ = tiny_models["tiny"]
    r = subprocess.run([sys.executable, "-c", EXITS, model], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "caught: loading weights failed: Input/output error" in r.stdout
    assert "Fatal Python error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compressed", [False, True])
def test_a_failed_write_while_placing_weights_is_one_line_and_leaves_nothing(tiny_models, tmp_path, capsys,
                                                                           monkeypatch, compressed):
    """4-bit groups are written behind the next tensor's quantizing (weight_io.py): a write that
    fails there still stops the load, and no writer is left behind."""
    calls = fail_from(monkeypatch, disk, "pwrite_all", 3, EIO)
    model, _ = tiny_models["tiny"]
    offload = tmp_path / "off"
    offload.mkdir()
    code = main(["--model", model, *RUN, "--weights", "disk=100", "--offload-dir", str(offload)]
                + ["--compress-weight"] * compressed)
    err = capsys.readouterr().err
    assert len(calls) >= 3, "the error was never injected"
    assert code == 1, err
    line = last_line(err)
    assert line.startswith("error: --offload-dir: cannot write the offload files in "), line
    assert "Input/output error" in line and "Traceback" not in err
    assert os.listdir(offload) == []
    assert not [t for t in threading.enumerate() if t.name.startswith(("flexh2o-place", "flexh2o-io"))]
