"""The process's memory limit: its cgroup's (v2 memory.max, v1 memory.limit_in_bytes, the tightest
on its path up) or --max-memory, whichever leaves less room, caps what the CPU tier may use; the
report says which applied; a policy over it is refused naming it."""

import json
import subprocess
import sys

import pytest

from flexh2o.host.memory_limit import cgroup_limit, process_limit
from flexh2o.run import main
from conftest import REPO, last_line, write

GB = 1 << 30


def test_a_cgroup_v2_limit_is_the_tightest_on_the_path_up(tmp_path):
    write(tmp_path / "proc", "0::/jobs/job7/task\n")
    root = tmp_path / "cg"
    write(root / "jobs" / "memory.max", f"{8 * GB}\n")
    write(root / "jobs" / "memory.current", f"{1 * GB}\n")
    write(root / "jobs" / "job7" / "memory.max", f"{3 * GB}\n")
    write(root / "jobs" / "job7" / "memory.current", f"{GB // 2}\n")
    write(root / "jobs" / "job7" / "task" / "memory.max", "max\n")
    write(root / "jobs" / "job7" / "task" / "memory.current", f"{GB // 2}\n")
    limit = cgroup_limit(str(tmp_path / "proc"), str(root))
    assert (limit.limit, limit.room) == (3 * GB, 3 * GB - GB // 2)
    assert limit.source == f"cgroup v2 {root}/jobs/job7/memory.max"


def test_a_cgroup_v1_memory_controller_limit(tmp_path):
    write(tmp_path / "proc", "4:memory:/process_api/abc\n3:cpuset:/\n0::/\n")
    root = tmp_path / "cg"
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit at the root
    write(root / "memory" / "memory.usage_in_bytes", f"{5 * GB}\n")
    write(root / "memory" / "process_api" / "abc" / "memory.limit_in_bytes", f"{2 * GB}\n")
    write(root / "memory" / "process_api" / "abc" / "memory.usage_in_bytes", f"{GB}\n")
    limit = cgroup_limit(str(tmp_path / "proc"), str(root))
    assert (limit.limit, limit.room) == (2 * GB, GB)
    assert limit.source.startswith("cgroup v1 ") and limit.source.endswith("abc/memory.limit_in_bytes")


def test_no_limit_anywhere_is_none(tmp_path):
    write(tmp_path / "proc", "0::/a\n")
    write(tmp_path / "cg" / "a" / "memory.max", "max\n")
    write(tmp_path / "cg" / "a" / "memory.current", "100\n")
    assert cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg")) is None
    assert process_limit(None, str(tmp_path / "proc"), str(tmp_path / "cg")) is None


def test_the_smaller_room_wins(tmp_path):
    write(tmp_path / "proc", "0::/a\n")
    write(tmp_path / "cg" / "a" / "memory.max", f"{64 * GB}\n")
    write(tmp_path / "cg" / "a" / "memory.current", f"{GB}\n")
    assert process_limit(2 * GB, str(tmp_path / "proc"), str(tmp_path / "cg")).source == "--max-memory"
    assert process_limit(256 * GB, str(tmp_path / "proc"), str(tmp_path / "cg")).source.startswith("cgroup v2")


def test_max_memory_caps_the_run_and_the_report_says_so(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--prompt-len", "16", "--gen-len", "2", "--gpu-batch-size", "2", "--dtype", "float32",
                 "--max-memory", "40GB", "--json-out", str(out)]) == 0
    assert "memory limit: " in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["memory_limit"]["source"] in ("--max-memory",) or report["memory_limit"]["source"].startswith("cgroup")


def test_a_policy_over_the_limit_is_refused_naming_it(capsys):
    code = main(["--prompt-len", "16", "--gen-len", "2", "--gpu-batch-size", "2", "--dtype", "float32",
                 "--max-memory", "700MB", "--weights", "gpu=100"])
    assert code == 2
    line = last_line(capsys.readouterr().err)
    assert line.startswith("error: --weights: the policy needs ") and "within the memory limit of " in line
    assert line.endswith("(--max-memory))")  # the gpu tier is RAM here


@pytest.mark.parametrize("value", ["lots", "0x10", ""])
def test_a_bad_max_memory_is_one_line(value, capsys):
    assert main(["--max-memory", value]) == 2
    assert last_line(capsys.readouterr().err).startswith("error: --max-memory: ")


@pytest.mark.parametrize("flags", [
    ["--weights", "gpu=100", "--cache", "gpu=100", "--gpu-batch-size", "4"],
    pytest.param(["--weights", "gpu=50,disk=50", "--cache", "gpu=50,disk=50", "--gpu-batch-size", "4",
                  "--num-gpu-batches", "2"], marks=pytest.mark.slow),  # make test-all
    ["--weights", "disk=100", "--cache", "disk=100", "--gpu-batch-size", "8", "--hh-ratio", "0.2"],
], ids=["in-memory", "split", "on-disk-h2o"])
def test_a_run_stays_under_its_max_memory(tmp_path, flags):
    """Where no cgroup can be made, --max-memory stands in for one: a run admitted by the pre-flight
    peaks under it (scripts/bench_memory_limit.py checks the same inside real cgroups)."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "flexh2o.run", "--dtype", "float32", "--prompt-len", "64",
                        "--gen-len", "4", "--max-memory", "1800MB", "--offload-dir", str(tmp_path), "--json-out",
                        str(out), *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["memory_limit"]["source"] in ("--max-memory",) or report["memory_limit"]["source"].startswith("cgroup")
    assert report["peak_rss_bytes"] <= 1800 << 20


def test_the_reported_peak_rss_is_the_runs_own_not_its_launchers():
    """A run started from a process holding 1 GiB reports its own peak: getrusage's ru_maxrss keeps
    the launcher's across fork and exec (the suite's own memory once failed the test above)."""
    child = "from flexh2o.runs.report import peak_rss; print(peak_rss())"
    launcher = (f"import subprocess, sys; held = b'x' * (1 << 30); "
                f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout)")
    r = subprocess.run([sys.executable, "-c", launcher], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[0]) < 1 << 30
