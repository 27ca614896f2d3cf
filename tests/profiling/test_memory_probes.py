"""The profile's measurements sized to the memory the process may use: its memory probes take the
largest size that leaves room for the growth they measure, a probe that cannot run leaves the
default growth with one line, and a first run (nothing cached) in a small memory limit measures,
plans and finishes inside it: in a real memory cgroup where one can be made, else under
--max-memory, which stands in for one."""

import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

from flexh2o.host.process_memory import DEFAULT_GROWTH
from flexh2o.profiling.measure import LINK_ROOM, link_within, process_growth
from flexh2o.profiling.memory_growth import (PROBE_BATCH, PROBE_CONFIG, PROBE_PROMPT, PROBE_SHARE, probe_result,
                                             probe_size)
from flexh2o.profiling.timing import CPU_SIZES, ROOM_SHARE, within
from conftest import REPO, with_the_kernels

sys.path.insert(0, os.path.join(REPO, "scripts"))
from memory_budget import CgroupUnavailable, check_available, run_in_budget  # noqa: E402

MB, GB = 1 << 20, 1 << 30
FULL = (PROBE_BATCH, PROBE_PROMPT, PROBE_CONFIG)
LIMIT = GB
# flexh2o.run with the profile measured quickly (small timing sizes, the first memory probe only):
# the same path as a full measurement, in seconds.
QUICK_RUN = ("import sys, flexh2o.profiling.measure as m; full = m.measure; "
             "m.measure = lambda device, offload_dir, quick=False, log=m.say, max_memory=None: "
             "full(device, offload_dir, True, log, max_memory); "
             "from flexh2o.run import main; sys.exit(main(sys.argv[1:]))")


def test_a_probe_takes_its_largest_size_that_leaves_room_for_its_growth():
    size, need = probe_size("in memory", 4, 64 * GB, FULL)
    assert size == FULL
    room = 600 * MB  # the full probe projects 656 MB
    size, need = probe_size("in memory", 4, room, FULL)
    assert size is not None and size != FULL and need <= room * PROBE_SHARE
    batch, prompt, config = size
    assert batch * prompt * config["num_hidden_layers"] * config["vocab_size"] < \
        PROBE_BATCH * PROBE_PROMPT * PROBE_CONFIG["num_hidden_layers"] * PROBE_CONFIG["vocab_size"]
    size, need = probe_size("in memory", 4, 100 * MB, FULL)
    assert size is None and need > 100 * MB * PROBE_SHARE  # not even the smallest fits: its projection, to say so


def test_the_timings_buffers_are_held_to_the_room_under_a_limit():
    held = within(CPU_SIZES, 400 * MB)
    for name in ("kv_bytes", "copy_bytes", "disk_bytes", "stream_bytes", "attention_bytes"):
        assert getattr(held, name) <= 400 * MB * ROOM_SHARE < getattr(CPU_SIZES, name), name
    assert within(CPU_SIZES, None) == CPU_SIZES
    assert held.matmul_k == CPU_SIZES.matmul_k and held.repeats == CPU_SIZES.repeats  # only the sizes in bytes


def test_a_probe_that_cannot_run_leaves_the_default_growth_with_one_line(tmp_path):
    lines = []
    budget = psutil.Process().memory_info().rss + 64 * MB  # the probe's share: less than its interpreter
    assert process_growth(torch.device("cpu"), str(tmp_path), True, lines.append, budget) is None
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("note: process growth, float32: the memory probe 'in memory' could not be measured "
                               "(its smallest size needs ")
    assert lines[0].endswith(f"allow the default growth, {DEFAULT_GROWTH >> 20} MB")


def test_the_link_is_left_out_where_its_two_interpreters_do_not_fit():
    lines = []
    assert link_within(True, lines.append, psutil.Process().memory_info().rss + 100 * MB) is None
    assert len(lines) == 1 and lines[0].startswith("note: the link between processes is not measured: its two "
                                                   f"interpreters take about {LINK_ROOM >> 20} MB, and "), lines


@pytest.mark.parametrize("done,why", [
    (subprocess.CompletedProcess([], -9, "", ""), "killed by signal 9, as a memory limit's out-of-memory killer does"),
    (subprocess.CompletedProcess([], 1, "", "Traceback...\nRuntimeError: no\n"), "RuntimeError: no"),
    (subprocess.CompletedProcess([], 0, '{"growth_bytes": null, "why": "too big"}\n', ""), "too big"),
])
def test_a_probe_that_measured_nothing_says_why(done, why):
    assert probe_result(done) == (None, why)


def first_run_argv(model: str, tmp_path) -> list[str]:
    return ["--model", model, "--prompt-len", "8", "--gen-len", "4", "--max-batch", "8", "--dtype", "float32",
            "--device", "cpu", "--offload-dir", str(tmp_path / "offload"), "--json-out", str(tmp_path / "r.json")]


def check_first_run(tmp_path, output: str, cache: str):
    """Measured (the probe sized down to the limit, its growth calibrated, no default), planned and finished."""
    assert "note: measuring this machine" in output and "(a smaller probe, " in output, output
    assert "could not be measured" not in output and "Traceback" not in output, output
    with open(os.path.join(cache, "flexh2o", "hardware", "local.json")) as f:
        assert set(json.load(f)["process_growth"]) == {"float32"}
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["process_growth_source"].startswith("calibrated for float32")
    assert report["peak_rss_bytes"] <= LIMIT


def test_a_first_run_under_max_memory_measures_plans_and_finishes_inside_it(tiny_models, tmp_path):
    cache = str(with_the_kernels(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", QUICK_RUN, *first_run_argv(tiny_models["tiny"][0], tmp_path),
                        "--max-memory", str(LIMIT)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "XDG_CACHE_HOME": cache})
    assert r.returncode == 0, r.stderr
    check_first_run(tmp_path, r.stderr, cache)
    assert json.loads((tmp_path / "r.json").read_text())["memory_limit"]["source"] == "--max-memory"


@pytest.mark.slow  # the path of the test above, in a real cgroup: a second measurement (make test-all runs it)
def test_a_first_run_in_a_memory_cgroup_measures_plans_and_finishes_inside_it(tiny_models, tmp_path, monkeypatch):
    try:
        check_available()
    except CgroupUnavailable as e:
        pytest.skip(str(e))
    cache = str(with_the_kernels(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    argv = ["sh", "-c", 'exec "$@" 2>&1', "sh", sys.executable, "-c", QUICK_RUN,
            *first_run_argv(tiny_models["tiny"][0], tmp_path)]
    monkeypatch.chdir(REPO)
    run = run_in_budget(argv, LIMIT, "flexh2o-test-first-run", timeout=600)
    output = "".join(line for _, line in run.lines)
    assert (run.returncode, run.oom_killed, run.timed_out) == (0, False, False), output
    check_first_run(tmp_path, output, cache)
    assert json.loads((tmp_path / "r.json").read_text())["memory_limit"]["source"].startswith("cgroup")
