"""`python -m flexh2o.serve`: its help, bad flags and setups each one line before anything is bound or
loaded, the log line per request, and a state dir that one server at a time uses."""

import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from flexh2o.serve import build_parser
from flexh2o.server.command import serve_parsed
from serving import server, word_llama  # noqa: F401 - fixtures
from test_openai_client import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve(argv: list, capsys) -> tuple[int, str]:
    code = serve_parsed(build_parser().parse_args(argv))
    return code, capsys.readouterr().err.strip()


def test_help_answers_without_loading_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['serve', '--help']; "
                           "runpy.run_module('flexh2o.serve', run_name='__main__')"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--max-model-len" in done.stdout and "--state-dir" in done.stdout


@pytest.mark.parametrize("flags,flag", [
    (["--port", "70000"], "--port"), (["--max-queued", "0"], "--max-queued"), (["--max-model-len", "1"],
                                                                                "--max-model-len"),
    (["--max-model-len", "100000"], "--max-model-len"), (["--host", "0.0.0.0"], "--host"),
    (["--max-body-size", "lots"], "--max-body-size"), (["--prompt-chunk", "4", "--hh-ratio", "0.2"], "--prompt-chunk"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"), (["--api-key", " "], "--api-key")])
def test_a_bad_flag_is_one_line(word_llama, capsys, flags, flag):  # noqa: F811
    code, err = serve(["--model", word_llama, "--gpu-batch-size", "2", *flags], capsys)
    assert code == 2 and err.splitlines() == [err.splitlines()[-1]] and err.startswith(f"error: {flag}:"), err


def test_a_model_without_a_tokenizer_and_a_port_in_use(word_llama, tmp_path, capsys):  # noqa: F811
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(word_llama, name), bare / name)
    code, err = serve(["--model", str(bare), "--gpu-batch-size", "2"], capsys)
    assert code == 2 and err.startswith("error: --model:") and "tokenizer" in err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        code, err = serve(["--model", word_llama, "--gpu-batch-size", "2", "--port", str(taken.getsockname()[1])], capsys)
    finally:
        taken.close()
    assert code == 2 and err.splitlines()[-1].startswith("error: --port: cannot listen on 127.0.0.1:")


def test_a_state_dir_that_is_a_link_or_in_use_is_refused(word_llama, server, tmp_path, capsys):  # noqa: F811
    os.symlink(tmp_path, tmp_path / "link")
    code, err = serve(["--model", word_llama, "--gpu-batch-size", "2", "--state-dir", str(tmp_path / "link")], capsys)
    assert code == 2 and err.startswith("error: --state-dir:") and "symlink" in err
    in_use = server.service.state.files.directory.rsplit("/files", 1)[0]
    code, err = serve(["--model", word_llama, "--gpu-batch-size", "2", "--state-dir", in_use], capsys)
    assert code == 2 and "another server uses" in err


def test_one_log_line_per_request_with_its_prompt_only_when_asked(server, caplog):  # noqa: F811
    """(A line is logged once the answer is out: the test waits for it.)"""
    caplog.set_level(logging.INFO, logger="flexh2o.serve")
    client, model = server.client(), server.service.state.ctx.model

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "flexh2o.serve"]
    client.completions.create(model=model, prompt="the secret river", max_tokens=2, temperature=0)
    wait_for(lambda: lines(), "the request's log line")
    assert len(lines()) == 1 and lines()[0].startswith("POST /v1/completions 200 ") and "prompt_tokens=3" in lines()[0]
    assert "secret" not in lines()[0]
    server.service.state.log_prompts = True  # as --log-prompts sets it
    try:
        client.completions.create(model=model, prompt="the secret river", max_tokens=2, temperature=0)
    finally:
        server.service.state.log_prompts = False
    wait_for(lambda: len(lines()) == 2, "the second request's log line")
    assert "secret" in lines()[1]


def test_health_says_loading_until_the_model_is_loaded(word_llama, tmp_path, monkeypatch):  # noqa: F811
    """The weights held from loading until the test has seen /health answer 503 "loading" and a
    completion refused with 503."""
    import threading
    import urllib.error
    import urllib.request

    import flexh2o.server.command as command
    from serving import Running
    seen, load = threading.Event(), command.load_engine
    monkeypatch.setattr(command, "load_engine", lambda *a, **k: seen.wait(60) and load(*a, **k))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    url = f"http://127.0.0.1:{port}"
    answers = []

    def watch():
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
            except urllib.error.HTTPError as e:
                answers.append((e.code, e.read().decode()))
                try:
                    urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", b'{"prompt": "hi"}'))
                except urllib.error.HTTPError as refused:
                    answers.append((refused.code, refused.read().decode()))
                seen.set()
                return
            except OSError:
                pass
            threading.Event().wait(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    server = Running(["--model", word_llama, "--gpu-batch-size", "2", "--offload-dir", str(tmp_path), "--port",
                      str(port)])
    watcher.join()
    try:
        assert answers[0] == (503, '{"status":"loading"}') and answers[1][0] == 503 and "loading" in answers[1][1]
        assert urllib.request.urlopen(url + "/health").status == 200
    finally:
        assert server.stop() == 0


def test_the_api_key_may_come_from_the_environment(word_llama, tmp_path, monkeypatch):  # noqa: F811
    import openai

    from serving import Running
    monkeypatch.setenv("FLEXH2O_API_KEY", "from-env")
    server = Running(["--model", word_llama, "--gpu-batch-size", "2", "--offload-dir", str(tmp_path)])
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        assert server.client(api_key="from-env").models.list().data
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_lets_the_running_request_finish_then_stops_the_process(word_llama, tmp_path, signum):  # noqa: F811
    """The engine runs on the main thread, where Python handles signals: a signal there must not cut
    the request short but close the intake, let the request finish, and exit 128 + signum with one
    line and no offload files."""
    import openai
    offload = tmp_path / "offload"
    process = subprocess.Popen([sys.executable, "-m", "flexh2o.serve", "--model", word_llama, "--gpu-batch-size", "2",
                                "--max-model-len", "128", "--dtype", "float32", "--port", "0", "--quiet",
                                "--offload-dir", str(offload)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert " serving " in line, (line, process.stderr.read() if process.poll() is not None else "")
        client = openai.OpenAI(base_url=line.split(" at ")[1].split()[0], api_key="none", max_retries=0)
        stream = client.completions.create(model=line.split(" serving ")[1].split()[0], prompt="the sea", max_tokens=120, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = [next(iter(stream))]
        process.send_signal(signum)
        chunks += list(stream)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    usage = [c.usage for c in chunks if c.usage is not None]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert usage and usage[0].completion_tokens == 120 and reasons == ["length"]
    assert process.returncode == 128 + signum
    assert err.strip().splitlines()[-1] == (f"stopped by {signum.name}: the server stopped (1 requests answered) and "
                                            "its offload files removed")
    assert not offload.exists() or not any(offload.iterdir())
