"""A hardware profile is a file anyone can break: every field is checked on load, and a broken one
ends in one line naming the field (a --hardware file) or naming the fix (the cached local one)."""

import json
import math
import os
import subprocess
import sys

import pytest

from flexh2o.common.errors import UsageError
from flexh2o.host.hardware import CONFIG_DIR, load_profile
from conftest import REPO, last_line

T4 = json.load(open(os.path.join(CONFIG_DIR, "t4.json")))


def broken(change):
    data = json.loads(json.dumps(T4))
    change(data)
    return data


def setter(field, value):
    return lambda d: d.__setitem__(field, value)


# (what is broken, the profile, the field the line names)
CASES = {
    "zero-memory": (setter("gpu_mem", 0), "gpu_mem"),
    "negative-speed": (setter("disk_read", -5.0), "disk_read"),
    "nan-speed": (setter("h2d", math.nan), "h2d"),
    "string-speed": (setter("memcpy", "fast"), "memcpy"),
    "float-memory": (setter("cpu_mem", 1.5e9), "cpu_mem"),
    "zero-dequant": (setter("dequant", 0), "dequant"),
    "unknown-device": (setter("device", "tpu"), "device"),
    "unknown-dtype": (setter("dtype", "int8"), "dtype"),
    "empty-matmul-table": (setter("matmul_flops", {}), "matmul_flops"),
    "empty-matmul-rows": (lambda d: d["matmul_flops"].__setitem__("float16", {}), "matmul_flops['float16']"),
    "bad-matmul-row": (lambda d: d["matmul_flops"]["float16"].__setitem__("many", 1e12), "matmul_flops['float16']"),
    "zero-matmul-rate": (lambda d: d["matmul_flops"]["float16"].__setitem__("1", 0), "matmul_flops['float16']['1']"),
    "dtype-without-figures": (lambda d: d["attention_flops"].pop("float16"), "attention_flops"),
    "list-table": (setter("attention_flops", [1e13]), "attention_flops"),
    "negative-overhead": (setter("layer_overhead", -1e-4), "layer_overhead"),
    "attention-costs-incomplete": (setter("attention_costs", {"prompt_fused": [0.0, 1e-9]}), "attention_costs"),
    "attention-costs-not-a-line": (setter("attention_costs", {c: [1.0] for c in
                                                             ("prompt_fused", "prompt_observed", "decode_fused",
                                                              "decode_evicting")}), "attention_costs['prompt_fused']"),
    "name-not-a-string": (setter("name", 7), "name"),
    "memory-beyond-a-float": (setter("gpu_mem", 10 ** 400), "gpu_mem"),
    "growth-beyond-a-float": (setter("process_growth", {"float32": {"2": 10 ** 400}}), "process_growth['float32']['2']"),
    "attention-cost-beyond-a-float": (setter("attention_costs", {c: [10 ** 400, 1e-9] for c in
                                                                ("prompt_fused", "prompt_observed", "decode_fused",
                                                                 "decode_evicting")}), "attention_costs['prompt_fused']"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_profile_file_names_its_field(tmp_path, case):
    change, field = CASES[case]
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(broken(change)))
    with pytest.raises(UsageError) as e:
        load_profile(str(path))
    assert e.value.flag == "--hardware" and f"{path}: {field} " in e.value.message
    assert len(e.value.message) < 300  # a value is quoted short


@pytest.mark.parametrize("text", ["[]", "null", '"t4"', "3", "[" * 100000])
def test_a_profile_file_of_another_shape_is_one_line(tmp_path, text):
    path = tmp_path / "machine.json"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        load_profile(str(path))
    assert e.value.flag == "--hardware" and str(path) in e.value.message and len(e.value.message) < 300


@pytest.mark.parametrize("text, says", [
    ('{"name": "x", "gpu_mem": ' + "1" * 5000 + "}", "holds an integer of more than"),
    ("[" * 100000 + "]" * 100000, "is JSON nested too deeply"),
    ('{"name": ', "is not JSON ("),
], ids=["5000-digit-integer", "nested-deeply", "cut-short"])
def test_a_profile_file_that_is_no_json_we_read_is_one_line(tmp_path, text, says):
    path = tmp_path / "machine.json"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        load_profile(str(path))
    assert e.value.flag == "--hardware" and e.value.message.startswith(f"{path} {says}"), e.value.message


def test_the_shipped_profiles_pass(tmp_path):
    for name in ("t4", "a100-40g", "h100-80g"):
        assert load_profile(name).name == name


def run(module, args, env):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_plan_with_a_broken_hardware_file_is_one_line(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(broken(setter("disk_read", 0))))
    r = run("flexh2o.plan", ["--model", "opt-1.3b", "--hardware", str(path)], {})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert last_line(r.stderr) == f"error: --hardware: {path}: disk_read must be above 0 and finite, not 0"


def test_a_broken_cached_profile_is_named_with_its_fix(tmp_path):
    cache = tmp_path / "cache"
    (cache / "flexh2o" / "hardware").mkdir(parents=True)
    data = broken(setter("matmul_flops", {"float32": {}}))
    data.update(device="cpu", dtype="float32", attention_flops={"float32": 1e11})
    (cache / "flexh2o" / "hardware" / "local.json").write_text(json.dumps(data))
    r = run("flexh2o.plan", ["--model", "opt-1.3b"], {"XDG_CACHE_HOME": str(cache)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = last_line(r.stderr)
    assert line.startswith("error: --hardware: the cached local profile is broken (") and "matmul_flops" in line
    assert line.endswith("measure it again: python -m flexh2o.profile --force")


def test_the_load_meter_counts_its_own_children_as_its_own_work():
    """A profile's probes run as child processes: their CPU time is this process's own, not other
    processes' load. The child spends a fixed amount of CPU time (not of wall time), so how busy the
    machine is changes nothing."""
    from flexh2o.host.cpu_load import cpu_seconds
    own_before = cpu_seconds()[1]
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"], check=True)
    assert cpu_seconds()[1] - own_before >= 0.45  # (the kernel accounts it in ticks)


@pytest.mark.parametrize("others", [0.0, 0.3, 0.75])
def test_the_load_meter_gives_other_processes_share_of_every_core(monkeypatch, others):
    """The meter's arithmetic on given counters: 4 cores for 2 s, this process (children included)
    busy 1.5 CPU-seconds, other processes `others` of all cores."""
    from flexh2o.host import cpu_load
    clock, counters = iter([100.0, 102.0]), iter([(50.0, 10.0), (50.0 + 1.5 + others * 8, 11.5)])
    monkeypatch.setattr(cpu_load.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cpu_load, "cpu_seconds", lambda: next(counters))
    monkeypatch.setattr(cpu_load.os, "cpu_count", lambda: 4)
    assert cpu_load.LoadMeter().result()["others_cpu_share"] == others
