"""A FIFO (or a device, or a directory) where a file is expected is refused in one line naming the
flag: opening a FIFO for reading would block until a writer came, forever."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, last_line

RUN = ["--prompt-len", "8", "--gen-len", "2", "--dtype", "float32", "--gpu-batch-size", "1"]


def fifo(path):
    os.mkfifo(path)
    return str(path)


def cli(module, args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def assert_refused(r, flag, path):
    assert r.returncode == 2, r.stderr
    assert last_line(r.stderr) == (f"error: {flag}: {path} is a FIFO, not a regular file (reading it could block "
                                   "the run forever)")


def test_prompts_file(model_with_tokenizer, tmp_path):
    path = fifo(tmp_path / "prompts.txt")
    assert_refused(cli("flexh2o.run", ["--model", model_with_tokenizer, *RUN, "--prompts-file", path]),
                   "--prompts-file", path)


def test_job_input(model_with_tokenizer, tmp_path):
    path = fifo(tmp_path / "in.jsonl")
    r = cli("flexh2o.run", ["--model", model_with_tokenizer, *RUN, "--input", path, "--output", str(tmp_path / "o")])
    assert_refused(r, "--input", path)


def test_eval_text(model_with_tokenizer, tmp_path):
    path = fifo(tmp_path / "text.txt")
    r = cli("flexh2o.eval", ["--model", model_with_tokenizer, "--dtype", "float32", "--text", path,
                             "--prompt-len", "16", "--eval-len", "8"])
    assert_refused(r, "--text", path)


def test_gguf_model_file(tmp_path):
    pytest.importorskip("gguf")
    path = fifo(tmp_path / "model.gguf")
    assert_refused(cli("flexh2o.run", ["--model", path, *RUN]), "--model", path)


def test_config_json_of_a_model_directory(tiny_models, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_models["tiny"][0], model)
    os.remove(model / "config.json")
    path = fifo(model / "config.json")
    assert_refused(cli("flexh2o.run", ["--model", str(model), *RUN]), "--model", path)


def test_a_weights_file(tiny_models, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_models["tiny"][0], model)
    weights = next(f for f in os.listdir(model) if f.endswith(".safetensors"))
    os.remove(model / weights)
    path = fifo(model / weights)
    assert_refused(cli("flexh2o.run", ["--model", str(model), *RUN]), "--model", path)
