"""python -m flexh2o.plan, and flexh2o.run planning a job it is given no batch size or placement for."""

import json
import re
import shlex

import pytest

import flexh2o.host.hardware
import flexh2o.profiling.measure
import flexh2o.plan
import flexh2o.profile
import flexh2o.run
from flexh2o.engine.policy import Policy, policy_percents
from conftest import TEST_CPU_PROFILE


def policy_from_flags(command: str) -> Policy:
    """The Policy flexh2o.run builds from a printed command line."""
    args = flexh2o.run.build_parser().parse_args(shlex.split(command)[3:])
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = policy_percents(args)
    return Policy(args.gpu_batch_size, args.num_gpu_batches, w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu,
                  overlap=args.overlap, cpu_cache_compute=args.cpu_cache_compute, kv_policy=args.kv_policy,
                  hh_ratio=args.hh_ratio, recent_ratio=args.recent_ratio, compress_weight=args.compress_weight,
                  compress_cache=args.compress_cache)


@pytest.fixture
def no_measuring(monkeypatch):
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda *a, **k: pytest.fail("measured the machine"))


@pytest.mark.parametrize("kv", [[], ["--hh-ratio", "0.1", "--recent-ratio", "0.1"]])
def test_plan_prints_the_run_flags_of_its_policy_and_the_json(tmp_path, capsys, kv):
    out = tmp_path / "plan.json"
    assert flexh2o.plan.main(["--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "128", "--gen-len", "8",
                              "--max-batch", "32", "--json-out", str(out), *kv]) == 0
    stdout = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert set(plan["predicted"]) >= {"prefill_throughput", "decode_throughput", "total_throughput", "bottleneck"}
    command = next(line for line in stdout.splitlines() if line.startswith("python -m flexh2o.run"))
    assert command == plan["command"]
    assert policy_from_flags(command).to_dict() == plan["policy"]
    assert plan["policy"]["gpu_batch_size"] * plan["policy"]["num_gpu_batches"] <= 32
    assert "bottleneck: prefill" in stdout and "searched" in stdout


def test_plan_with_the_local_profile_reads_the_cache(capsys, no_measuring):
    assert flexh2o.plan.main(["--model", "opt-125m", "--prompt-len", "64", "--gen-len", "4", "--max-batch", "8"]) == 0
    assert "on local" in capsys.readouterr().out


def test_plan_caps_and_exact_batch(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert flexh2o.plan.main(["--model", "opt-6.7b", "--hardware", "t4", "--prompt-len", "512", "--gen-len", "32",
                              "--batch", "6", "--gpu-mem", "8GB", "--json-out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["policy"]["gpu_batch_size"] * plan["policy"]["num_gpu_batches"] == 6
    assert plan["policy"]["w_gpu_percent"] < 100  # 12.5 GB of weights do not fit 8 GB
    assert "--gpu-mem 8GB" in plan["command"]


def test_run_without_a_batch_or_placement_plans_and_predicts(tiny_models, tmp_path, capsys, no_measuring):
    out = tmp_path / "r.json"
    assert flexh2o.run.main(["--model", tiny_models["tiny"][0], "--prompt-len", "8", "--gen-len", "3",
                             "--max-batch", "4", "--dtype", "float32", "--json-out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "note: planned with the local hardware profile" in captured.err
    assert re.search(r"predicted total [0-9.]+ token/s: [0-9.]+ (s|min|h) to generate", captured.err)
    report = json.loads(out.read_text())
    assert report["batch_size"] <= 4
    assert report["predicted"]["total_throughput"] > 0
    assert "predicted (cost model, local profile)" in captured.out


def test_run_planned_for_an_exact_batch(tiny_models, tmp_path, capsys, no_measuring):
    out = tmp_path / "r.json"
    assert flexh2o.run.main(["--model", tiny_models["tiny"][0], "--prompt-len", "8", "--gen-len", "2",
                             "--batch", "6", "--dtype", "float32", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["batch_size"] == 6


def test_run_told_its_policy_predicts_without_planning(tiny_models, tmp_path, capsys, no_measuring):
    out = tmp_path / "r.json"
    assert flexh2o.run.main(["--model", tiny_models["tiny"][0], "--prompt-len", "8", "--gen-len", "3",
                             "--gpu-batch-size", "2", "--dtype", "float32", "--json-out", str(out)]) == 0
    assert "planned" not in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and report["predicted"]["total_throughput"] > 0


def test_run_told_its_policy_does_not_measure_to_predict(tiny_models, tmp_path, monkeypatch, no_measuring):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    out = tmp_path / "r.json"
    assert flexh2o.run.main(["--model", tiny_models["tiny"][0], "--prompt-len", "8", "--gen-len", "3",
                             "--gpu-batch-size", "2", "--dtype", "float32", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["predicted"] is None


def test_a_planned_run_takes_as_many_sequences_as_the_prompts_file(model_with_tokenizer, tmp_path, no_measuring):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\nthe dog\na mat\n")
    out = tmp_path / "r.json"
    assert flexh2o.run.main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2",
                             "--prompts-file", str(prompts), "--dtype", "float32", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["batch_size"] == 3


def test_plan_measures_the_machine_when_no_profile_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    measured = []
    test_profile = flexh2o.host.hardware.from_dict(TEST_CPU_PROFILE, "test")
    monkeypatch.setattr(flexh2o.profiling.measure, "measure", lambda device, *a, **k: measured.append(device) or test_profile)
    assert flexh2o.plan.main(["--model", "opt-125m", "--prompt-len", "32", "--gen-len", "4", "--max-batch", "4",
                              "--offload-dir", str(tmp_path / "off")]) == 0
    assert [d.type for d in measured] == ["cpu"]
    assert (tmp_path / "empty" / "flexh2o" / "hardware" / "local.json").exists()


@pytest.mark.parametrize("argv,flag", [
    (["--hardware", "t4", "--dtype", "float32"], "--dtype"),    # the t4 profile has no float32 figures
    (["--hardware", "t5"], "--hardware"),
    (["--batch", "0"], "--batch"),
    (["--gpu-mem", "lots"], "--gpu-mem"),
])
def test_plan_bad_input_is_one_line(argv, flag, capsys, no_measuring):
    assert flexh2o.plan.main(["--model", "opt-125m", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}: ") and "\n" not in err


def test_a_planned_run_in_a_dtype_the_profile_lacks_is_refused(capsys, no_measuring):
    assert flexh2o.run.main(["--prompt-len", "8", "--gen-len", "2", "--dtype", "float16"]) == 2
    assert capsys.readouterr().err.startswith("error: --dtype: the local profile has no figures for float16")


def test_a_planned_run_keeps_the_gpu_batch_count_it_is_given(model_with_tokenizer, tmp_path, capsys, no_measuring):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\nthe dog\na mat\nsat on\n")
    out = tmp_path / "r.json"
    args = ["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2", "--prompts-file",
            str(prompts), "--dtype", "float32"]
    assert flexh2o.run.main(args + ["--num-gpu-batches", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["policy"]["gpu_batch_size"], report["policy"]["num_gpu_batches"]) == (2, 2)
    assert flexh2o.run.main(args + ["--num-gpu-batches", "3"]) == 2
    assert "--num-gpu-batches: 3 does not divide the 4 prompts" in capsys.readouterr().err


def test_predicted_durations_read_as_people_say_them():
    from flexh2o.common.names import duration
    assert [duration(s) for s in (0.14, 42.4, 210, 7500)] == ["0.1 s", "42 s", "3.5 min", "2.1 h"]
