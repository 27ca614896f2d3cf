"""The hardware profiler: a quick measurement on the CPU, and the CLI's cache, --force and bad input."""

import json
import os
import subprocess
import sys
from dataclasses import fields, replace

import psutil
import pytest
import torch

import flexh2o.host.cpu_load
import flexh2o.profiling.measure
import flexh2o.profile
import flexh2o.profiling.local_profile
from flexh2o.common.names import duration
from flexh2o.host.devices import default_dtype
from flexh2o.host.hardware import COPIES, HardwareProfile, from_dict, load_profile, local_cache_path, save_local
from flexh2o.planning.attention_costs import CALLS, seconds
from flexh2o.profiling.measure import measure
from flexh2o.host.process_memory import DEFAULT_GROWTH
from conftest import REPO

CUDA_COPIES = ("h2d", "d2h", "h2d_pageable", "d2h_pageable")
SPEEDS = ("device_bandwidth", "cpu_attention_bandwidth", "memcpy", "disk_read", "disk_write", "dequant",
          "layer_overhead")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    offload_dir = tmp_path_factory.mktemp("profile") / "offload"
    lines = []
    profile = measure(torch.device("cpu"), str(offload_dir), quick=True, log=lines.append)
    return profile, offload_dir, lines


def test_quick_cpu_profile_has_every_figure(quick_profile):
    profile, _, lines = quick_profile
    assert isinstance(profile, HardwareProfile)
    assert (profile.name, profile.device) == ("local", "cpu")
    assert profile.dtype == str(default_dtype(torch.device("cpu"))).removeprefix("torch.")
    assert profile.source.startswith("measured by python -m flexh2o.profile on ")
    for name in SPEEDS:
        assert getattr(profile, name) > 0, name
    for name in CUDA_COPIES:
        assert getattr(profile, name) == 0.0, name
    assert profile.cpu_attention_bandwidth == profile.device_bandwidth  # the same measurement on a CPU
    assert profile.gpu_mem == profile.cpu_mem == psutil.virtual_memory().total
    assert profile.disk_mem > 0
    assert any("matmul float32" in line for line in lines)


def test_quick_cpu_profile_calibrates_the_process_growth_of_the_default_dtype(quick_profile):
    growth = quick_profile[0].process_growth
    threads = str(torch.get_num_threads())
    assert len(growth) == 1 and all(set(t) == {threads} and 0 <= t[threads] < DEFAULT_GROWTH for t in growth.values())


def test_quick_cpu_profile_has_matmul_and_attention_tables(quick_profile):
    profile = quick_profile[0]
    assert set(profile.matmul_flops) == set(profile.attention_flops) == {"float32", "bfloat16"}
    for dtype, table in profile.matmul_flops.items():
        assert len(table) >= 3 and "1" in table, dtype
        assert all(rate > 0 for rate in table.values()), dtype
        assert profile.matmul_rate(2, dtype) > 0
    assert all(rate > 0 for rate in profile.attention_flops.values())


def test_quick_cpu_profile_times_every_attention_call(quick_profile):
    profile = quick_profile[0]
    assert set(profile.attention_costs) == set(CALLS)
    for name, (fixed, per_unit) in profile.attention_costs.items():
        assert fixed >= 0 and per_unit >= 0, name
        assert fixed + per_unit > 0, name
    # an evicting decode call does what the fused one does, and more
    assert seconds(profile.attention_costs["decode_evicting"], 1e5) > seconds(profile.attention_costs["decode_fused"], 0)


def test_profile_round_trips_through_json(quick_profile):
    profile = quick_profile[0]
    again = from_dict(json.loads(json.dumps(profile.to_dict())), "test")
    assert again == profile
    assert {f.name for f in fields(HardwareProfile)} == set(profile.to_dict())


def test_measuring_leaves_no_files_in_the_offload_dir(quick_profile):
    offload_dir = quick_profile[1]
    assert not offload_dir.exists() or not any(offload_dir.iterdir())


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_cli_measures_then_reuses_the_cache_until_forced(cache_home, quick_profile, monkeypatch, capsys):
    offload = ["--device", "cpu", "--offload-dir", str(cache_home / "offload")]
    assert flexh2o.profile.main([*offload, "--quick"]) == 0
    path = local_cache_path()
    assert path.startswith(str(cache_home)) and os.path.isfile(path)
    measured = load_profile("local")
    assert measured.device == "cpu" and "--quick" in measured.source
    assert f"saved to {path}" in capsys.readouterr().out

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured although a profile is cached")
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", must_not_measure)
    json_out = cache_home / "profile.json"
    assert flexh2o.profile.main([*offload, "--json-out", str(json_out)]) == 0
    out = capsys.readouterr().out
    assert f"cached at {path} (use --force to measure again)" in out and "GFLOP/s" in out
    assert json.loads(json_out.read_text()) == measured.to_dict()

    forced = replace(quick_profile[0], source="measured again")
    calls = []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *args, **kwargs: calls.append(args) or forced)
    assert flexh2o.profile.main([*offload, "--force"]) == 0
    assert len(calls) == 1 and load_profile("local") == forced


def test_ensure_local_profile_measures_only_without_a_cache(cache_home, quick_profile, monkeypatch):
    calls = []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *args, **kwargs: calls.append(args) or quick_profile[0])
    offload_dir = str(cache_home / "offload")
    assert flexh2o.profiling.local_profile.ensure_local_profile("cpu", offload_dir, log=lambda line: None) == quick_profile[0]
    assert flexh2o.profiling.local_profile.ensure_local_profile("cpu", offload_dir, log=lambda line: None) == quick_profile[0]
    assert len(calls) == 1 and os.path.isfile(local_cache_path())


def test_each_measurement_is_announced_in_one_line_with_why_and_how_long(cache_home, quick_profile, monkeypatch):
    """The first with the figure a first one took on a 2-core CPU (FIRST_CPU_SECONDS); a later one with
    what the last one took; never one without a note saying why."""
    local = flexh2o.profiling.local_profile
    from flexh2o import native
    took = replace(quick_profile[0], measure_seconds=42.4, source="measured", dequant_kernel="native",
                   kernels_build=native.build())
    monkeypatch.setattr(flexh2o.profiling.measure, "dequant_kernel", lambda device: "native")
    calls, notes = [], []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure",
                        lambda *a, **k: calls.append(a) or notes.append("-") or took)
    offload = str(cache_home / "offload")
    assert local.ensure_local_profile("cpu", offload, log=notes.append) == took
    assert notes == [f"note: measuring this machine with cpu computing (no profile of this machine is cached yet "
                     f"({local_cache_path()})): about {duration(local.FIRST_CPU_SECONDS)}, as a first one on a "
                     "2-core CPU took; cached for later runs", "-"]
    notes.clear()
    assert local.ensure_local_profile("cpu", offload, log=notes.append) == took and notes == []  # cached: silent
    monkeypatch.setattr(flexh2o.profiling.measure, "dequant_kernel", lambda device: "torch")
    local.ensure_local_profile("cpu", offload, log=notes.append)
    assert len(notes) == 2 and notes[0].startswith("note: measuring this machine with cpu computing (the cached "
                                                   "profile timed the dequantization of ")
    assert notes[0].endswith("): about 42 s, as the last one here took; cached for later runs")
    assert len(calls) == 2 and all("\n" not in n for n in notes)


def test_a_measurement_records_how_long_it_took(quick_profile):
    assert quick_profile[0].measure_seconds > 0 and from_dict(quick_profile[0].to_dict(), "t").measure_seconds > 0


@pytest.mark.parametrize("args, flag", [(["--device", "tpu"], "--device"), (["--device", ""], "--device"),
                                         (["--offload-dir", "{file}/below"], "--offload-dir"),
                                         (["--json-out", "{tmp}"], "--json-out")])
def test_bad_input_is_one_line_and_exit_code_2(cache_home, monkeypatch, capsys, args, flag):
    (cache_home / "file").write_text("")
    args = [a.format(file=cache_home / "file", tmp=cache_home) for a in args]
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *a, **k: pytest.fail("measured despite bad input"))
    assert flexh2o.profile.main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and err.count("\n") == 1, err


def test_bad_device_from_a_subprocess_has_no_traceback(cache_home):
    r = subprocess.run([sys.executable, "-m", "flexh2o.profile", "--device", "tpu"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    assert r.returncode == 2
    assert r.stderr.startswith("error: --device: ") and r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(local_cache_path())


@pytest.mark.parametrize("now,measures", [(0.01, True), (0.6, False)])
def test_a_profile_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(cache_home, quick_profile,
                                                                                 monkeypatch, now, measures):
    busy = replace(quick_profile[0], others_cpu_share=0.74)
    save_local(busy)
    assert load_profile("local").others_cpu_share == 0.74  # kept in the cache
    fresh = replace(quick_profile[0], others_cpu_share=0.02, source="measured again")
    calls, notes = [], []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *a, **k: calls.append(a) or fresh)
    monkeypatch.setattr(flexh2o.host.cpu_load, "others_cpu_share", lambda: now)
    got = flexh2o.profiling.local_profile.ensure_local_profile("cpu", str(cache_home / "offload"), log=notes.append)
    assert (got, len(calls)) == ((fresh, 1) if measures else (busy, 0))
    assert any("measured while other processes kept 74% of the CPU busy" in n for n in notes)
    if not measures:  # one short line, said once: what the predictions are worth and how to measure again
        (note,) = notes
        assert "python -m flexh2o.profile --force" in note and "predictions may be low" in note and len(note) < 200
        again = []
        assert flexh2o.profiling.local_profile.ensure_local_profile("cpu", str(cache_home / "offload"),
                                                                    log=again.append) == busy
        assert again == []
        save_local(replace(busy, others_cpu_share=0.5))  # another busy profile: flagged again
        flexh2o.profiling.local_profile.ensure_local_profile("cpu", str(cache_home / "offload"), log=again.append)
        assert len(again) == 1 and "50%" in again[0]
    else:
        assert load_profile("local") == fresh


@pytest.mark.parametrize("device,then,now", [("cpu", "torch", "native"), ("cpu", None, "native"),
                                             ("cpu", "native", "torch"), ("cuda", "torch", "triton")])
def test_a_profile_is_measured_again_when_the_dequantizing_kernel_changed(cache_home, quick_profile,
                                                                          monkeypatch, device, then, now):
    copies = {field: 1e10 for field in COPIES} if device == "cuda" else {}  # none measured on a CPU; a GPU has them
    save_local(replace(quick_profile[0], device=device, dequant_kernel=then, **copies))
    fresh = replace(quick_profile[0], device=device, dequant_kernel=now, source="measured again", **copies)
    calls, notes = [], []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *a, **k: calls.append(a) or fresh)
    monkeypatch.setattr(flexh2o.profiling.measure, "dequant_kernel", lambda device: now)
    assert flexh2o.profiling.local_profile.ensure_local_profile(device, str(cache_home / "offload"), log=notes.append) == fresh
    assert len(calls) == 1 and any("dequantizes with" in n for n in notes)
    assert flexh2o.profiling.local_profile.ensure_local_profile(device, str(cache_home / "offload"), log=notes.append) == fresh
    assert len(calls) == 1  # the same kernel now: the cache serves


def test_a_cpu_profile_is_measured_again_when_the_kernels_were_rebuilt(cache_home, quick_profile, monkeypatch):
    """A new build of flexh2o's C kernels (new sources, flags, compiler or CPU) runs at other speeds."""
    from flexh2o import native
    if native.build() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    save_local(replace(quick_profile[0], dequant_kernel="native", kernels_build="an older build"))
    fresh = replace(quick_profile[0], dequant_kernel="native", kernels_build=native.build(), source="measured again")
    calls, notes = [], []
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *a, **k: calls.append(a) or fresh)
    assert flexh2o.profiling.local_profile.ensure_local_profile("cpu", str(cache_home / "offload"), log=notes.append) == fresh
    assert len(calls) == 1 and any("another build" in n for n in notes)
    assert flexh2o.profiling.local_profile.ensure_local_profile("cpu", str(cache_home / "offload"), log=notes.append) == fresh
    assert len(calls) == 1  # this build now: the cache serves
