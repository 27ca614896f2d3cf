"""`make gpu-check`'s machinery, on the CPU: a failing section does not stop the next, results are
on disk after every section, a section that does not fit the time left is skipped and says so, a
hang ends the check with every thread's stack and leaves the hung section's name in the results."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
from check_sections import Check  # noqa: E402


def describe(result, header):
    return "# check" if header else "rows: " + str(sum(len(s["rows"]) for s in result["sections"].values()))


def test_sections_fail_alone_and_every_result_is_written_as_it_comes(tmp_path):
    outs = [str(tmp_path / "a" / "gpu"), str(tmp_path / "gpu")]
    os.makedirs(tmp_path / "a")
    check = Check(outs, total_s=60, header={"device": "test"}, describe=describe)
    seen = {}

    def first(section):
        section.add({"x": 1})
        section.target("x is 1", "1", "== 1", True)

    def second(section):
        seen["on disk"] = json.load(open(outs[1] + ".json"))  # what a watchdog's exit would leave
        raise RuntimeError("a CUDA test broke")

    check.run("first", 5, first)
    check.run("second", 5, second)
    check.run("third", 1000, lambda section: section.add({"never": True}))
    assert seen["on disk"]["sections"]["first"]["status"] == "ok"
    assert seen["on disk"]["sections"]["second"]["status"] == "running"
    for out in outs:
        result = json.load(open(out + ".json"))
        assert result["device"] == "test"
        s = result["sections"]
        assert s["first"]["status"] == "ok" and s["first"]["rows"] == [{"x": 1}]
        assert s["second"]["status"] == "failed" and s["second"]["error"] == "RuntimeError: a CUDA test broke"
        assert s["third"]["status"] == "skipped" and "the section needs 1000 s" in s["third"]["why"]
        assert result["targets"] == [{"section": "first", "name": "x is 1", "value": "1", "goal": "== 1", "ok": True}]
        text = open(out + ".md").read()
        assert "| second | **failed**: RuntimeError: a CUDA test broke |" in text
        assert "| x is 1 | first | 1 | == 1 | pass |" in text
    assert not check.passed()


def test_a_failed_target_fails_the_check(tmp_path):
    check = Check([str(tmp_path / "gpu")], total_s=60, header={}, describe=describe)
    check.run("one", 5, lambda section: section.target("bound", "0.5", ">= 0.7", False))
    assert not check.passed()
    assert "| bound | one | 0.5 | >= 0.7 | **fail** |" in open(tmp_path / "gpu.md").read()


def test_rows_past_the_sections_budget_are_named(tmp_path):
    check = Check([str(tmp_path / "gpu")], total_s=60, header={}, describe=describe)

    def rows(section):
        for name in ("a", "b", "c"):
            if section.over():
                section.skipped.append(name)
                continue
            section.add({"name": name})
            time.sleep(0.3)
    check.run("matrix", 0.5, rows)
    section = json.load(open(tmp_path / "gpu.json"))["sections"]["matrix"]
    assert [r["name"] for r in section["rows"]] == ["a", "b"] and section["skipped_rows"] == ["c"]
    assert "over its budget, not run: c" in open(tmp_path / "gpu.md").read()


def test_a_hung_section_ends_the_check_with_its_stack(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {os.path.join(REPO, 'scripts')!r})
import check_sections
check_sections.WATCHDOG_GRACE_S = 1
check = check_sections.Check([{str(tmp_path / 'gpu')!r}], 60, {{}}, lambda r, header: "")
check.run("fine", 5, lambda s: s.add({{"ok": 1}}))
check.run("hangs", 1, lambda s: time.sleep(3600))
"""
    # Ended well before the hung call would return: by the watchdog, however busy the machine.
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "Timeout" in r.stderr and "in <lambda>" in r.stderr  # every thread's stack, the hung call's included
    sections = json.load(open(tmp_path / "gpu.json"))["sections"]
    assert sections["fine"]["status"] == "ok" and sections["hangs"]["status"] == "running"


def test_gpu_check_without_cuda_says_so_in_one_line():
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py")], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    if "no CUDA device" not in r.stderr:
        pytest.skip("a CUDA machine: the check itself is `make gpu-check`")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("gpu-check: no CUDA device (torch ")


@pytest.mark.skipif(not shutil.which("make"), reason="no make here")
def test_make_gpu_check_takes_the_virtual_environments_python(tmp_path):
    """On a machine set up with `make`, the check runs with .venv's torch (which says there is no
    CUDA device on a CPU), not the machine's python3, which may have no torch at all."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    dry = subprocess.run(["make", "-s", "-n", "gpu-check", f"VENV={venv}"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert dry.stdout.split()[1:3] == [str(venv / "bin" / "python"), "scripts/gpu_check.py"], dry.stdout
    without = subprocess.run(["make", "-s", "-n", "gpu-check", f"VENV={tmp_path / 'none'}"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert without.stdout.split()[1] == "python3", without.stdout
    r = subprocess.run(["make", "-s", "gpu-check", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    if "no CUDA device" not in r.stderr:
        pytest.skip("a CUDA machine: the check itself is `make gpu-check`")
    assert r.returncode != 0
    assert r.stderr.splitlines()[0].startswith("gpu-check: no CUDA device (torch ")


def test_the_allocator_rows_batch_is_the_largest_that_fits(tiny_models, monkeypatch):
    import torch
    import gpu_check
    from flexh2o import Engine, Policy
    from flexh2o.engine.preflight import outside_allocator
    directory, _ = tiny_models["tiny"]
    cuda_own = outside_allocator(False)  # what a T4 holds outside torch's allocator
    with Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=1), dtype=torch.float32) as engine:
        one, ten = (gpu_check.projection(engine, b, 64, 4)["gpu"] for b in (1, 10))
        monkeypatch.setattr(gpu_check, "T4_BYTES", cuda_own + ten + (ten - one) // 18)  # room for 10 and a half
        assert gpu_check.largest_batch(engine, 64, 4) == (10, "gpu")
        monkeypatch.setattr(gpu_check, "T4_BYTES", cuda_own + one - 1)
        assert gpu_check.largest_batch(engine, 64, 4) == (0, "gpu")


def test_the_gpu_checks_tests_section_names_a_file_that_exists():
    import gpu_check
    assert os.path.isfile(os.path.join(REPO, gpu_check.CUDA_TESTS))
