"""The files a dataset job writes: never its input under any spelling, never through a link planted at
a name it writes, never half-written. Each refusal is one line naming the flag, before anything is written."""

import json
import os

import pytest

from flexh2o.common.errors import UsageError
from flexh2o.jobs.output import JobOutput
from flexh2o.run import main
from flexh2o.common.signals import Stopped

JOB = ["--dtype", "float32", "--quiet", "--gpu-batch-size", "2", "--gen-len", "2"]
PROMPTS = "the cat sat\non a mat\nthe dog ran\n"


def run_job(model, *argv) -> int:
    try:
        return main(["--model", str(model), *JOB, *argv])
    except SystemExit as e:
        return e.code


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def files(folder) -> dict:
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, p)) and not os.path.islink(os.path.join(folder, p))}


# How each case spells the input as an output; the input is tmp/in.txt, tmp/sub exists.
SPELLINGS = {
    "output-same-path": lambda t: ["--output", str(t / "in.txt")],
    "output-through-dotdot": lambda t: ["--output", str(t / "sub" / ".." / "in.txt")],
    "output-relative-dotdot": lambda t: ["--output", os.path.relpath(t / "sub" / ".." / "in.txt")],
    "output-hard-link": lambda t: (os.link(t / "in.txt", t / "hard.jsonl"), ["--output", str(t / "hard.jsonl")])[1],
    "settings-beside-output": lambda t: (os.link(t / "in.txt", t / "o.jsonl.job.json"),
                                         ["--output", str(t / "o.jsonl")])[1],
    "lock-beside-output": lambda t: (os.link(t / "in.txt", t / "o.jsonl.lock"), ["--output", str(t / "o.jsonl")])[1],
    "json-out-same-path": lambda t: ["--output", str(t / "o.jsonl"), "--json-out", str(t / "in.txt")],
    "json-out-hard-link": lambda t: (os.link(t / "in.txt", t / "r.json"),
                                     ["--output", str(t / "o.jsonl"), "--json-out", str(t / "r.json")])[1],
}


@pytest.mark.parametrize("case", SPELLINGS)
def test_no_output_may_be_the_input(model_with_tokenizer, tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "in.txt").write_text(PROMPTS)
    argv = SPELLINGS[case](tmp_path)
    before = files(tmp_path)
    assert run_job(model_with_tokenizer, "--input", str(tmp_path / "in.txt"), *argv) == 2
    line = one_line(capsys)
    flag = "--json-out" if "json-out" in case else "--output"
    assert line.startswith(f"error: {flag}: ") and "is the input file" in line, line
    assert files(tmp_path) == before  # nothing written, nothing removed


def test_the_json_out_of_a_prompts_file_run_is_not_the_prompts_file(model_with_tokenizer, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    os.link(prompts, tmp_path / "report.json")
    code = run_job(model_with_tokenizer, "--prompts-file", str(prompts), "--prompt-len", "8",
                   "--json-out", str(tmp_path / "report.json"))
    assert code == 2 and "is the input file" in one_line(capsys)
    assert prompts.read_text() == PROMPTS


def test_json_out_may_not_be_the_jobs_own_output(model_with_tokenizer, tmp_path, capsys):
    (tmp_path / "in.txt").write_text(PROMPTS)
    out = str(tmp_path / "o.jsonl")
    assert run_job(model_with_tokenizer, "--input", str(tmp_path / "in.txt"), "--output", out, "--json-out", out) == 2
    assert one_line(capsys).startswith("error: --json-out: ") and not os.path.exists(out)


def plant(kind: str, path, victim):
    if kind == "symlink":
        os.symlink(victim, path)
    elif kind == "dangling-symlink":
        os.symlink(str(victim) + ".new", path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("suffix", ["", ".job.json", ".lock"])
@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "directory", "fifo"])
def test_something_planted_at_a_name_the_job_writes_is_one_line(model_with_tokenizer, tmp_path, capsys, suffix,
                                                                  kind):
    (tmp_path / "in.txt").write_text(PROMPTS)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "o.jsonl"
    plant(kind, str(out) + suffix, victim)
    assert run_job(model_with_tokenizer, "--input", str(tmp_path / "in.txt"), "--output", str(out)) == 2
    line = one_line(capsys)
    assert line.startswith(f"error: --output: {out}{suffix} is "), line
    assert victim.read_text() == "precious\n" and not os.path.exists(str(victim) + ".new")


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "directory", "fifo"])
def test_the_ordered_rewrite_never_writes_through_what_lies_at_its_old_temporary_name(model_with_tokenizer, tmp_path,
                                                                                      kind):
    (tmp_path / "in.txt").write_text(PROMPTS)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "o.jsonl"
    plant(kind, str(out) + ".ordered.tmp", victim)
    assert run_job(model_with_tokenizer, "--input", str(tmp_path / "in.txt"), "--output", str(out), "--ordered") == 0
    assert [json.loads(r)["id"] for r in out.read_text().splitlines()] == ["1", "2", "3"]
    assert victim.read_text() == "precious\n" and not os.path.exists(str(victim) + ".new")


def test_a_link_swapped_in_for_the_output_after_the_checks_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "o.jsonl"
    JobOutput(str(out), {"a": 1}).close()  # made, then replaced by a link before the resume opens it
    os.remove(out)
    os.symlink(victim, out)
    from flexh2o.jobs.files import open_for_append  # (new: the old resume opened the path as it found it)
    with pytest.raises(UsageError) as e:
        open_for_append(str(out), create=False)
    assert e.value.flag == "--output" and "symlink" in e.value.message
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("at", [0, 1, 3])
def test_a_signal_while_the_output_is_rewritten_leaves_it_whole_and_no_temporary_file(tmp_path, at):
    from flexh2o.jobs.files import write_lines_atomic  # (new: the old rewrite wrote OUT.ordered.tmp in place)
    path = tmp_path / "o.jsonl"
    path.write_text("old\n")

    def lines():
        for n in range(5):
            if n == at:
                raise Stopped(15)
            yield f"{n}\n"
    with pytest.raises(Stopped):
        write_lines_atomic(str(path), lines())
    assert os.listdir(tmp_path) == ["o.jsonl"] and path.read_text() == "old\n"
