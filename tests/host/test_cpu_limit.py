"""The CPUs the process may use: its affinity mask within its cgroup's CPU quota (v2 cpu.max, v1
cpu.cfs_quota_us over cpu.cfs_period_us, the tightest on its path up), and torch's threads lowered
to them when an engine loads."""

import os
import subprocess
import sys

import pytest
import torch

from flexh2o.host.cpu_limit import cgroup_cpu_quota, fit_threads, usable_cpus
from conftest import REPO, write


def test_a_v2_quota_is_the_tightest_on_the_path_up(tmp_path):
    write(tmp_path / "proc", "0::/jobs/job7/task\n")
    root = tmp_path / "cg"
    write(root / "jobs" / "cpu.max", "400000 100000\n")
    write(root / "jobs" / "job7" / "cpu.max", "150000 100000\n")
    write(root / "jobs" / "job7" / "task" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "proc"), str(root)) == 1.5


def test_a_v1_quota_under_the_cpu_controller(tmp_path):
    write(tmp_path / "proc", "4:memory:/a\n1:cpu,cpuacct:/batch/b\n0::/\n")
    root = tmp_path / "cg"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "batch" / "b" / "cpu.cfs_quota_us", "200000\n")
    write(root / "cpu,cpuacct" / "batch" / "b" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "proc"), str(root)) == 2.0


def test_no_quota_and_unreadable_files_mean_none(tmp_path):
    write(tmp_path / "proc", "1:cpu:/\n0::/x\n")
    root = tmp_path / "cg"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    write(root / "x" / "cpu.max", "max 100000\n")
    write(root / "cpu.max", "garbage\n")
    assert cgroup_cpu_quota(str(tmp_path / "proc"), str(root)) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing"), str(root)) is None


def test_the_usable_cpus_are_the_mask_within_the_quota_rounded_up(tmp_path):
    mask = len(os.sched_getaffinity(0))
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg" / "cpu.max", "50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(str(tmp_path / "proc"), str(tmp_path / "cg")) == 1
    write(tmp_path / "cg" / "cpu.max", f"{(mask + 3) * 100000} 100000\n")  # more than the mask: the mask
    assert usable_cpus(str(tmp_path / "proc"), str(tmp_path / "cg")) == mask


def test_fit_threads_lowers_and_never_raises(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("flexh2o.host.cpu_limit.usable_cpus", lambda: 1)
        torch.set_num_threads(2)
        assert fit_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr("flexh2o.host.cpu_limit.usable_cpus", lambda: 8)
        assert fit_threads() == 1  # a count lower than the CPUs is someone's choice: kept
    finally:
        torch.set_num_threads(before)


def test_an_engine_loaded_under_a_taskset_of_one_cpu_computes_with_one_thread(tiny_models):
    """torch sizes its pool to the affinity mask itself; an engine's load keeps it there, and the
    C kernels, which take torch's count, follow."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to narrow")
    directory = tiny_models["tiny"][0]
    code = ("import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); torch.set_num_threads(2); "
            "from flexh2o import Engine, Policy; "
            f"Engine.from_pretrained({directory!r}, Policy(gpu_batch_size=1), device='cpu', dtype='float32'); "
            "print(torch.get_num_threads())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"
