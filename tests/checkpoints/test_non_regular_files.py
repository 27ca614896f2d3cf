"""A FIFO (or a device, or a directory) where a file is expected is refused in one line naming the
flag: opening a FIFO for reading would block until a writer came, forever."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, last_line, with_word_tokenizer

RUN = ["--prompt-len", "8", "--gen-len", "2", "--dtype", "float32", "--gpu-batch-size", "1"]

# Every case's command, one after another in one child process (each would otherwise pay for its
# own torch import): [(module, argv)] in, [(exit code, stderr)] out. A case that blocked on its FIFO
# would hold up the rest, and the timeout fails them all.
CHILD = """
import contextlib, io, json, runpy, sys
results = []
for module, argv in json.loads(sys.argv[1]):
    sys.argv, err, code = [module, *argv], io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    results.append((code, err.getvalue()))
print(json.dumps(results))
"""


def fifo(path):
    os.mkfifo(path)
    return str(path)


def model_with_a_fifo(tiny_models, directory, pick) -> tuple[str, str]:
    """The tiny model copied to `directory`, its file pick(names) replaced by a FIFO: (model, FIFO)."""
    shutil.copytree(tiny_models["tiny"][0], directory)
    victim = pick(os.listdir(directory))
    os.remove(directory / victim)
    return str(directory), fifo(directory / victim)


@pytest.fixture(scope="module")
def refusals(tiny_models, tmp_path_factory):
    """case -> (its flag, its FIFO's path, exit code, stderr)."""
    tmp = tmp_path_factory.mktemp("fifos")
    words = str(with_word_tokenizer(tiny_models["tiny"][0], tmp_path_factory.mktemp("words")))
    cases = {}  # case -> (module, flag, FIFO, argv)
    path = fifo(tmp / "prompts.txt")
    cases["prompts file"] = ("flexh2o.run", "--prompts-file", path,
                             ["--model", words, *RUN, "--prompts-file", path])
    path = fifo(tmp / "in.jsonl")
    cases["job input"] = ("flexh2o.run", "--input", path,
                          ["--model", words, *RUN, "--input", path, "--output", str(tmp / "out.jsonl")])
    path = fifo(tmp / "text.txt")
    cases["eval text"] = ("flexh2o.eval", "--text", path,
                          ["--model", words, "--dtype", "float32", "--text", path, "--prompt-len", "16",
                           "--eval-len", "8"])
    model, path = model_with_a_fifo(tiny_models, tmp / "no_config", lambda names: "config.json")
    cases["config.json of a model directory"] = ("flexh2o.run", "--model", path, ["--model", model, *RUN])
    model, path = model_with_a_fifo(tiny_models, tmp / "no_weights",
                                    lambda names: next(f for f in names if f.endswith(".safetensors")))
    cases["a weights file"] = ("flexh2o.run", "--model", path, ["--model", model, *RUN])
    if importlib.util.find_spec("gguf") is not None:
        path = fifo(tmp / "model.gguf")
        cases["gguf model file"] = ("flexh2o.run", "--model", path, ["--model", path, *RUN])
    runs = [(module, argv) for module, _, _, argv in cases.values()]
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(runs)], cwd=REPO, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    return {name: (flag, path, *result) for (name, (_, flag, path, _)), result in zip(cases.items(), results)}


@pytest.mark.parametrize("case", ["prompts file", "job input", "eval text", "gguf model file",
                                  "config.json of a model directory", "a weights file"])
def test_a_fifo_is_refused_in_one_line_naming_the_flag(refusals, case):
    if case not in refusals:
        pytest.skip("the gguf package is not installed")
    flag, path, code, err = refusals[case]
    assert code == 2, err
    assert last_line(err) == (f"error: {flag}: {path} is a FIFO, not a regular file (reading it could block "
                              "the run forever)")
