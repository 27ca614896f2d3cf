"""What a dataset job reads back and leaves behind: its settings beside the output are data (any other
shape is one line naming the file), a refused run writes nothing, and a resume loses nothing: a
finished job in a folder now read-only has nothing to do, a stop during --ordered's rewrite leaves no
temporary file for good, the input named another way resumes, and the input is known by what is read
from it, not by its size and modified time."""

import builtins
import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from flexh2o.jobs.output import JobOutput, complete_records
from conftest import REPO
from test_job_files import JOB, files, one_line
from test_job_files import run_job as run_with
from test_job_resume import RECORDS, write_jsonl


def run_job(model, path, out, *flags) -> int:
    return run_with(model, "--input", str(path), "--output", str(out), *flags)


def ids(out) -> list:
    return [json.loads(line)["id"] for line in open(out, encoding="utf-8")]


@pytest.fixture
def job(tmp_path):
    """A folder of its own with the input (the model's files lie in tmp_path itself)."""
    folder = tmp_path / "job"
    folder.mkdir()
    write_jsonl(folder / "in.jsonl", RECORDS)
    return folder


# -- the settings beside the output ---------------------------------------------------------------

SETTINGS = {
    "a-list": "[]",
    "null": "null",
    "a-string": '"settings"',
    "a-number": "3",
    "an-empty-object": "{}",
    "input-records-a-list": '{"model": "m", "input_records": []}',
    "size-as-text": '{"model": "m", "input_records": {"size": "10", "sha256": "' + "0" * 64 + '"}}',
    "no-model": '{"input_records": {"size": 10, "sha256": "' + "0" * 64 + '"}}',
    "not-json": '{"model": ',
    "nested-deeply": "[" * 100000,
    "larger-than-any": '{"model": "' + "m" * (2 << 20) + '"}',
}


@pytest.mark.parametrize("finished", [0, 2])
@pytest.mark.parametrize("case", SETTINGS)
def test_settings_of_another_shape_are_one_line_naming_the_file(model_with_tokenizer, job, capsys, case, finished):
    out = job / "out.jsonl"
    out.write_text("".join(json.dumps({"id": f"r{n}", "text": "a"}) + "\n" for n in range(finished)))
    (job / "out.jsonl.job.json").write_text(SETTINGS[case])
    before = files(job)
    assert run_job(model_with_tokenizer, job / "in.jsonl", out) == 2
    line = one_line(capsys)
    assert line.startswith("error: --output: ") and f"{out}.job.json " in line and len(line) < 400, line
    if finished:
        assert "2 finished records" in line and "another --output" in line and "--overwrite" not in line
    else:
        assert "--overwrite" in line
    assert files(job) == before  # nothing written, nothing removed, no lock made


# -- a refused run writes nothing -----------------------------------------------------------------

TOO_SMALL = {
    "placement-given": ["--gpu-mem", "1KB", "--weights", "gpu=100"],
    "placement-fitted": ["--gpu-mem", "1KB", "--cpu-mem", "1KB", "--disk-mem", "1KB"],
}


@pytest.mark.parametrize("before", ["new", "half-done", "half-done-overwrite"])
@pytest.mark.parametrize("case", TOO_SMALL)
def test_a_run_the_preflight_refuses_writes_nothing(model_with_tokenizer, job, capsys, case, before):
    out = job / "out.jsonl"
    flags = TOO_SMALL[case] + ["--offload-dir", str(job.parent / "off")]
    if before != "new":
        assert run_job(model_with_tokenizer, job / "in.jsonl", out) == 0
        os.remove(str(out) + ".lock")
        out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:2]))
    if before.endswith("overwrite"):
        flags.append("--overwrite")
    kept = files(job)
    capsys.readouterr()
    assert run_job(model_with_tokenizer, job / "in.jsonl", out, *flags) == 2
    assert one_line(capsys).startswith("error: --gpu-mem")
    assert files(job) == kept  # no output, settings or lock made; nothing removed under --overwrite


# -- a finished job run again in a folder now read-only -------------------------------------------

WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def read_only(monkeypatch, folder):
    """Every write inside `folder` fails as on a read-only filesystem (EROFS). chmod would not do:
    the tests may run as root, whom no mode stops."""
    def inside(path) -> bool:
        path = os.path.abspath(os.fsdecode(path))
        return path == str(folder) or path.startswith(str(folder) + os.sep)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    real_open, real_builtin = os.open, builtins.open

    def os_open(path, flags, *args, **kwargs):
        if flags & WRITING and inside(path):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def builtin_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and set(mode) & set("wax+") and inside(file):
            refuse(file)
        return real_builtin(file, mode, *args, **kwargs)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", builtin_open)
    for name in ("unlink", "remove", "rename", "replace", "mkdir", "rmdir", "truncate", "chmod", "utime"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path, *args, _real=real, **kwargs:
                            refuse(path) if inside(path) else _real(path, *args, **kwargs))


@pytest.mark.parametrize("flags", [[], ["--ordered"]], ids=["in-finish-order", "ordered"])
def test_a_finished_job_in_a_folder_now_read_only_has_nothing_to_do(model_with_tokenizer, job, capsys, monkeypatch,
                                                                    flags):
    out = job / "out.jsonl"
    assert run_job(model_with_tokenizer, job / "in.jsonl", out, *flags) == 0
    kept = files(job)
    capsys.readouterr()
    with monkeypatch.context() as m:
        read_only(m, job)
        with pytest.raises(OSError):
            open(job / "probe", "w")  # (the folder is read-only indeed)
        assert run_job(model_with_tokenizer, job / "in.jsonl", out, *flags) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("nothing to do") and captured.err == "", captured
    assert files(job) == kept


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever a folder's mode says")
def test_a_finished_job_in_a_folder_made_read_only_by_its_mode_has_nothing_to_do(model_with_tokenizer, job, capsys):
    out = job / "out.jsonl"
    assert run_job(model_with_tokenizer, job / "in.jsonl", out, "--ordered") == 0
    for f in job.iterdir():
        f.chmod(0o444)
    job.chmod(0o555)
    try:
        capsys.readouterr()
        assert run_job(model_with_tokenizer, job / "in.jsonl", out, "--ordered") == 0
        assert capsys.readouterr().out.strip().endswith("nothing to do")
    finally:
        job.chmod(0o755)


# -- a stop during --ordered's rewrite ------------------------------------------------------------

# The job as `python -m flexh2o.run` runs it, stopped by `signal` at a fixed point of the rewrite:
# "created" (its temporary file just made) or "writing" (after two of its lines).
STOPPED_REWRITE = """
import os, signal, sys, tempfile
import flexh2o.jobs.output as output
from flexh2o.common.signals import run_stoppable
from flexh2o.run import main

sig, at = getattr(signal, sys.argv[1]), sys.argv[2]
rewriting = []
real_rewrite, real_mkstemp, real_write = output.JobOutput.rewrite_in_order, tempfile.mkstemp, output.write_lines_atomic

def rewrite_in_order(self, ids):
    rewriting.append(1)
    return real_rewrite(self, ids)

def mkstemp(*args, **kwargs):
    made = real_mkstemp(*args, **kwargs)
    if rewriting and at == "created":
        os.kill(os.getpid(), sig)
    return made

def write_lines_atomic(path, lines):
    def stopping():
        for n, line in enumerate(lines):
            if rewriting and at == "writing" and n == 2:
                os.kill(os.getpid(), sig)
            yield line
    return real_write(path, stopping())

output.JobOutput.rewrite_in_order, tempfile.mkstemp, output.write_lines_atomic = rewrite_in_order, mkstemp, write_lines_atomic
sys.argv = sys.argv[2:]
sys.exit(run_stoppable(main))
"""


def left_over(folder) -> list:
    return [f for f in os.listdir(folder) if ".tmp-" in f]


# Each signal and each moment in make test; the other three pairs in make test-all.
STOPS = [(sig, at) if (sig, at) in {("SIGTERM", "writing"), ("SIGINT", "created"), ("SIGKILL", "writing")}
         else pytest.param(sig, at, marks=pytest.mark.slow)
         for sig in ("SIGTERM", "SIGINT", "SIGKILL") for at in ("created", "writing")]


@pytest.mark.parametrize("sig,at", STOPS)
def test_a_stop_during_the_ordered_rewrite_leaves_no_temporary_file_for_good(model_with_tokenizer, job, capsys, sig,
                                                                             at):
    out = job / "out.jsonl"
    argv = ["--model", str(model_with_tokenizer), *JOB, "--input", str(job / "in.jsonl"), "--output", str(out),
            "--ordered"]
    r = subprocess.run([sys.executable, "-c", STOPPED_REWRITE, sig, at, *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == (-9 if sig == "SIGKILL" else 128 + getattr(signal, sig)), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert sorted(ids(out)) == sorted(rec["id"] for rec in RECORDS)  # every record is whole, in finish order
    if sig != "SIGKILL":
        assert left_over(job) == []
    else:
        assert len(left_over(job)) == 1  # nothing can clean up after a SIGKILL: the next run does
    capsys.readouterr()
    assert run_job(model_with_tokenizer, job / "in.jsonl", out, "--ordered") == 0
    assert capsys.readouterr().out.strip().endswith("nothing to do")
    assert ids(out) == [rec["id"] for rec in RECORDS] and left_over(job) == []


def test_a_left_temporary_file_of_another_output_is_not_touched(model_with_tokenizer, job):
    for name in (".out.jsonl.tmp-abc", ".out.jsonl.tmp-abcdefgh.tmp-12345678", ".tmp-abcdefgh", ".outXjsonl.tmp-abcdefgh"):
        (job / name).write_text("someone else's\n")
    (job / ".out.jsonl.tmp-abcdefgh").write_text("left by a killed rewrite\n")
    JobOutput(str(job / "out.jsonl"), {"model": "m"}).close()
    assert sorted(left_over(job)) == [".out.jsonl.tmp-abc", ".out.jsonl.tmp-abcdefgh.tmp-12345678", ".outXjsonl.tmp-abcdefgh",
                                      ".tmp-abcdefgh"]


# -- the input, named another way or read from /proc ----------------------------------------------

@pytest.mark.parametrize("spelling", ["./in.jsonl", "sub/../in.jsonl", "absolute"])
def test_a_resume_with_the_input_named_another_way_goes_on(model_with_tokenizer, job, capsys, monkeypatch, spelling):
    monkeypatch.chdir(job)
    (job / "sub").mkdir()
    assert run_job(model_with_tokenizer, "in.jsonl", "out.jsonl") == 0
    whole = (job / "out.jsonl").read_bytes()
    (job / "out.jsonl").write_bytes(b"".join(whole.splitlines(keepends=True)[:2]))
    capsys.readouterr()
    name = str(job / "in.jsonl") if spelling == "absolute" else spelling
    assert run_job(model_with_tokenizer, name, "out.jsonl") == 0, capsys.readouterr().err
    assert sorted((job / "out.jsonl").read_bytes().splitlines()) == sorted(whole.splitlines())


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="no /proc")
def test_an_input_whose_size_the_filesystem_does_not_know_runs(model_with_tokenizer, tmp_path, capsys):
    assert os.stat("/proc/version").st_size == 0  # what /proc says of every file
    out = tmp_path / "out.jsonl"
    assert run_job(model_with_tokenizer, "/proc/version", out, "--gen-len", "1") == 0, capsys.readouterr().err
    assert len(complete_records(out)[0]) == 1
    assert run_job(model_with_tokenizer, "/proc/version", out, "--gen-len", "1") == 0  # and resumes
    assert capsys.readouterr().out.strip().endswith("nothing to do")


def test_an_input_rewritten_while_the_job_runs_with_its_size_and_time_put_back_stops_it(model_with_tokenizer, job,
                                                                                        capsys, monkeypatch):
    path, out, whole = job / "in.jsonl", job / "out.jsonl", job / "whole.jsonl"
    assert run_job(model_with_tokenizer, path, whole) == 0
    first, real_append, edited = os.stat(path), JobOutput.append, []

    def append(self, records):  # once the first records are out, the input gets other prompts of the same size
        real_append(self, records)
        if not edited:
            edited.append(records)
            write_jsonl(path, [dict(r, prompt=" ".join(reversed(r["prompt"].split()))) for r in RECORDS])
            os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
            assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (first.st_size, first.st_mtime_ns)
    monkeypatch.setattr(JobOutput, "append", append)
    capsys.readouterr()
    assert run_job(model_with_tokenizer, path, out) == 2
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and line[0].startswith(f"error: --input: {path} changed while the job ran") and \
        "--overwrite" not in line[0], line
    made = {r["id"]: r for r in complete_records(out)[0]}
    assert 0 < len(made) < len(RECORDS)
    assert all(made[i] == r for i, r in {r["id"]: r for r in complete_records(whole)[0]}.items() if i in made)
