"""The command line: a real run writing its JSON, prompts from a file, and every bad input."""

import json
import os
import re
import subprocess
import sys

import pytest


from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.common.version import version
from flexh2o.host.devices import default_dtype
from flexh2o.run import main
from conftest import REPO

FIGURES = ["model_size_bytes", "cache_size_bytes", "hidden_size_bytes", "peak_gpu_mem_bytes",
           "peak_cpu_mem_bytes", "peak_rss_bytes", "peak_disk_bytes", "prefill_latency_s", "prefill_throughput", "decode_latency_s",
           "decode_throughput", "total_latency_s", "total_throughput"]


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flexh2o.run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_run_writes_every_figure(tmp_path):
    out = tmp_path / "report.json"
    r = cli("--model", "opt-125m", "--dummy", "--prompt-len", "32", "--gen-len", "4", "--gpu-batch-size", "2",
            "--num-gpu-batches", "2", "--json-out", str(out), "--weights", "gpu=40,cpu=30,disk=30",
            "--cache", "gpu=50,cpu=0,disk=50", "--no-page-cache", "--offload-dir", str(tmp_path / "off"))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    for key in FIGURES:
        assert report[key] > 0, key
    assert report["policy"]["num_gpu_batches"] == 2 and report["batch_size"] == 4
    assert report["policy"]["w_gpu_percent"] == 40 and report["policy"]["cache_cpu_percent"] == 0
    assert report["disk_io"]["page_cache"] != "used" and report["disk_io"]["bytes_read"] > 0
    assert not (tmp_path / "off").exists()  # created for the run, removed with its files
    assert report["machine"]["logical_cores"] >= 1 and report["machine"]["torch"]
    assert (report["model"], report["model_sha256"], report["dtype"]) == ("opt-125m", None, "float32")  # dummy weights
    assert report["flexh2o_version"] == version()
    assert "total throughput" in r.stdout and "decode latency" in r.stdout
    assert f"model sha256: none (dummy weights)\tflexh2o: {version()}" in r.stdout
    # The CPU computes here: the gpu tier is named as what it is (the JSON keys keep their names).
    assert "peak compute device (CPU) mem:" in r.stdout and "gpu mem" not in r.stdout
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []


def test_h2o_run_without_placement_flags_fits_a_small_cap(tmp_path, capsys):
    """No placement given and everything on the compute device does not fit: a placement that fits is
    chosen and said; the report carries the KV policy and its budgeted cache size."""
    out = tmp_path / "report.json"
    code = main(["--model", "opt-125m", "--prompt-len", "40", "--gen-len", "3", "--gpu-batch-size", "2",
                 "--hh-ratio", "0.1", "--gpu-mem", "0.2GB", "--offload-dir", str(tmp_path / "off"),
                 "--json-out", str(out)])
    assert code == 0
    assert "note: everything on the compute device does not fit; placing --weights gpu=" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["policy"]["w_gpu_percent"] < 100 and report["policy"]["kv_policy"] == "h2o"
    assert report["kv_policy"].startswith("h2o (hh_ratio 0.1, recent_ratio 0.1: 8 slots")
    # 12 layers x 2 sequences x 12 heads x 8 slots x (2 x 64 K/V elements + 4 bytes position + 4 score)
    element = default_dtype("cpu").itemsize
    assert report["cache_size_bytes"] == 12 * 2 * 12 * 8 * (2 * 64 * element + 8)


def test_prompts_file_with_real_weights_prints_a_sample(model_with_tokenizer, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on a mat\nthe dog ran\n")
    out = tmp_path / "r.json"
    r = cli("--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "3", "--gpu-batch-size", "2",
            "--prompts-file", str(prompts), "--json-out", str(out), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "[1] '" in r.stdout and "[2] '" in r.stdout  # the text each prompt got
    report = json.loads(out.read_text())
    assert isinstance(report["sample"], str) and len(report["generated"]) == 2
    assert (report["dtype"], report["model_sha256"]) == ("float32", model_sha256(str(model_with_tokenizer)))


def test_bad_input_from_a_subprocess_is_one_line_without_traceback():
    r = cli("--model", "opt-9b")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --model: unknown model 'opt-9b'")


def test_unwritable_offload_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "4", "--offload-dir", str(blocker / "sub")])
    assert code == 2
    assert "--offload-dir: cannot write to" in capsys.readouterr().err


def test_prompts_file_count_must_match_the_batch(model_with_tokenizer, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\n")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2",
                 "--gpu-batch-size", "2", "--prompts-file", str(prompts)]) == 2
    assert "--prompts-file" in capsys.readouterr().err


def test_prompts_longer_than_prompt_len_are_named_in_one_line(model_with_tokenizer, tmp_path, capsys):
    """Every offender counted, the longest named by its line, and the --prompt-len that takes them all."""
    from transformers import AutoTokenizer
    lines = ["the cat", "the cat sat on a mat the dog ran", "a dog", "the dog sat on the mat and the cat ran far"]
    longest = len(AutoTokenizer.from_pretrained(model_with_tokenizer)(lines[3])["input_ids"])
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(lines) + "\n")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "4", "--gen-len", "2",
                 "--gpu-batch-size", "4", "--prompts-file", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: --prompt-len: 2 prompts are longer than 4 tokens in {prompts}, the longest on line 4 "
                       f"({longest} tokens): --prompt-len {longest} takes them all")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", str(longest), "--gen-len", "2",
                 "--gpu-batch-size", "4", "--prompts-file", str(prompts)]) == 0


def test_a_blank_line_between_prompts_is_refused_and_trailing_ones_are_not(model_with_tokenizer, tmp_path, capsys):
    """Output n answers line n: a blank line in between would shift them, so it is refused."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\n\nthe dog\n  \na mat\n\n\n")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2",
                 "--gpu-batch-size", "3", "--prompts-file", str(prompts)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --prompts-file: line 2 of {prompts} is blank (and 1 more): the file holds one prompt per line, "
        "and output n answers line n; remove the blank lines")
    prompts.write_text("the cat\nthe dog\na mat\n\n\n")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2",
                 "--gpu-batch-size", "3", "--prompts-file", str(prompts)]) == 0


def test_chat_needs_a_prompts_file_and_a_template(model_with_tokenizer, tmp_path, capsys):
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2", "--chat"]) == 2
    assert "error: --chat: applies to the prompts of --prompts-file" in capsys.readouterr().err
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat\n")
    assert main(["--model", str(model_with_tokenizer), "--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "1",
                 "--prompts-file", str(prompts), "--chat"]) == 2
    assert "error: --chat: the model's tokenizer has no chat template" in capsys.readouterr().err


def test_chat_applies_the_template(model_with_tokenizer, tmp_path):
    from transformers import AutoTokenizer
    from flexh2o.runs.prompts import read_prompts
    tok = AutoTokenizer.from_pretrained(model_with_tokenizer)
    tok.chat_template = "{% for m in messages %}the {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a{% endif %}"
    prompts = tmp_path / "p.txt"
    prompts.write_text("cat sat\n")
    assert read_prompts(str(prompts), tok, 1, 8, chat=True) == [tok("the cat sat a", add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("module", ["flexh2o.run", "flexh2o.plan", "flexh2o.eval", "flexh2o.profile"])
def test_help_answers_without_loading_torch(module):
    """--help is printed from the parser alone: torch (a second or more to import) is not loaded."""
    code = (f"import runpy, sys; sys.argv = ['{module}', '--help']\n"
            f"try:\n    runpy.run_module('{module}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--help" in r.stdout and r.stdout.strip().endswith("torch not loaded")


def test_the_parsers_kv_policy_names_are_the_engines():
    from flexh2o.kv import POLICIES
    from flexh2o.common.names import KV_POLICY_NAMES
    assert tuple(POLICIES) == KV_POLICY_NAMES


def test_run_help_names_every_preset_and_the_model_forms():
    from flexh2o.models import PRESETS
    from flexh2o.run import build_parser
    text = " ".join(build_parser().format_help().split())
    assert all(name in text for name in PRESETS), [n for n in PRESETS if n not in text]
    assert "HF config.json" in text and ".gguf file" in text and "(default: 512)" in text


def test_a_placement_off_the_compute_device_is_announced_with_its_bytes(tmp_path, capsys):
    assert main(["--model", "opt-125m", "--dummy", "--prompt-len", "16", "--gen-len", "2", "--gpu-batch-size", "2",
                 "--weights", "gpu=50,cpu=20,disk=30", "--offload-dir", str(tmp_path), "--dtype", "float32"]) == 0
    note = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("note: placing"))
    assert "on the compute device (CPU)" in note and "in CPU memory" in note and f"on disk ({tmp_path})" in note
    assert "the weights' share:" in note


def test_an_error_mid_run_starts_below_the_generate_bar_which_counts_token_steps(tiny_models, tmp_path, capsys,
                                                                                   monkeypatch):
    """The one-block run draws its bar over the token steps (steps/s: a step is a token for every
    sequence of the batch); an error in the third step is said on a line of its own."""
    import errno

    from flexh2o.engine.schedule import Schedule
    from flexh2o.offload.disk import OffloadError
    real = Schedule.end_token

    def end_token(schedule, i):
        if i == 2:
            raise OffloadError(str(tmp_path), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return real(schedule, i)
    monkeypatch.setattr(Schedule, "end_token", end_token)
    code = main(["--model", tiny_models["tiny"][0], "--dummy", "--dtype", "float32", "--prompt-len", "8", "--gen-len",
                 "6", "--gpu-batch-size", "2", "--no-stop-at-eos"])
    err = capsys.readouterr().err
    assert code == 1 and "generate:" in err and "step/s" in err and "tok/s" not in err, err
    assert re.split(r"[\r\n]", err.rstrip("\n"))[-1].startswith("error: --offload-dir: cannot write the offload files")
    assert not re.search(r"[^\r\n]error:", err), err
