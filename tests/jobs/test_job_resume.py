"""A dataset job killed (SIGKILL, Ctrl-C) resumes to what an uninterrupted one writes; a resume never mixes two
inputs, two settings or two versions of the model files; error records never take a real record's id; and a
write that fails (a full disk, a file-size limit, an I/O error) is one line, keeps whole records only and resumes."""

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from flexh2o.common.errors import UsageError
from flexh2o.jobs.input import JobInput
from flexh2o.jobs.output import complete_records
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.run import main
from conftest import REPO, fail_from, last_line
import test_job
from test_job import prompt, records, run

JOB = ["--quiet", "--gpu-batch-size", "2", "--gen-len", "3"]  # the default dtype: resumed records as uninterrupted
RECORDS = [{"id": f"r{n}", "prompt": p} for n, p in enumerate(
    ["the cat sat", "on a mat", "the dog ran", "a cat ran on the mat", "dog", "the mat sat on a dog"])]
mixed_prompts = test_job.mixed_prompts  # the fixture, shared


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def run_job(model, path, out, *flags) -> int:
    return main(["--model", str(model), *JOB, "--input", str(path), "--output", str(out), *flags])


def lines(out) -> list:
    return [json.loads(line) for line in open(out, encoding="utf-8")]


def cut_to(out, n: int):
    """As if the job was killed after writing n records."""
    kept = open(out, "rb").read().splitlines(keepends=True)[:n]
    open(out, "wb").write(b"".join(kept))


EDITS = {
    "prompt-changed": lambda r: [dict(r[0], prompt="a dog sat")] + r[1:],
    "line-inserted": lambda r: r[:2] + [{"id": "new", "prompt": "the cat"}] + r[2:],
    "line-deleted": lambda r: r[:1] + r[2:],
    "max-tokens-changed": lambda r: [dict(r[0], max_tokens=1)] + r[1:],
    "ids-swapped": lambda r: [dict(r[0], id="r1"), dict(r[1], id="r0")] + r[2:],
    "same-size-other-bytes": lambda r: [dict(r[0], prompt="the dog sat")] + r[1:],
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_resume_on_an_edited_input_is_refused_saying_how_to_keep_what_is_done(model_with_tokenizer, tmp_path, capsys,
                                                                               edit):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, RECORDS)
    assert run_job(model_with_tokenizer, path, out) == 0
    cut_to(out, 3)
    kept = out.read_bytes()
    write_jsonl(path, EDITS[edit](RECORDS))
    capsys.readouterr()
    assert run_job(model_with_tokenizer, path, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --input: {path} is not the input {out} was begun with")
    assert "3 finished records" in err[0] and "another --output" in err[0]
    assert "--overwrite" not in err[0]  # it would discard the 3 records
    assert out.read_bytes() == kept
    assert run_job(model_with_tokenizer, path, out, "--overwrite") == 0
    assert len(lines(out)) == len(EDITS[edit](RECORDS))


def test_the_input_changed_while_the_job_runs_is_refused_before_its_prompts_are_read(model_with_tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, RECORDS)
    job_input = JobInput(str(path), load_tokenizer(str(model_with_tokenizer)),
                         {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}, 64)
    job_input.tokens(job_input.entries[1])
    write_jsonl(path, EDITS["line-inserted"](RECORDS))
    job_input.tokens(job_input.entries[1])  # its line, where it was, as it was: the same record
    with pytest.raises(UsageError) as e:
        job_input.tokens(job_input.entries[2])  # the inserted line lies where it was
    assert e.value.flag == "--input" and "changed while the job ran (line 3 " in e.value.message
    assert "--overwrite" not in e.value.message


def test_an_input_rewritten_with_its_size_and_modified_time_put_back_is_still_caught(model_with_tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, RECORDS)
    job_input = JobInput(str(path), load_tokenizer(str(model_with_tokenizer)),
                         {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}, 64)
    before = path.stat()
    edited = EDITS["same-size-other-bytes"](RECORDS)
    write_jsonl(path, edited)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert job_input.tokens(job_input.entries[1])[0].prompt == RECORDS[1]["prompt"]
    with pytest.raises(UsageError) as e:
        job_input.tokens(job_input.entries[0])
    assert e.value.flag == "--input" and "changed while the job ran (line 1 " in e.value.message


def test_a_second_job_on_the_same_output_is_refused_while_the_first_runs(model_with_tokenizer, tmp_path, capsys):
    from flexh2o.jobs.files import OutputLock  # (new: nothing stopped two jobs before)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, RECORDS)
    first = OutputLock(str(out))  # what a running job holds
    assert run_job(model_with_tokenizer, path, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --output: {out} is being written by another job"), err
    assert not out.exists()
    first.release()
    assert run_job(model_with_tokenizer, path, out) == 0 and len(lines(out)) == len(RECORDS)


@pytest.mark.parametrize("bad_first", [True, False])
def test_an_error_record_never_takes_a_real_records_id(model_with_tokenizer, tmp_path, capsys, bad_first):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    real = {"id": "line-1" if bad_first else "line-2", "prompt": "the cat"}
    text = ['{"id": "x", "prompt": ""}', json.dumps(real)]
    path.write_text("\n".join(text if bad_first else text[::-1]) + "\n")
    assert run_job(model_with_tokenizer, path, out, "--skip-bad") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error record takes the id" in err[0] and "give that record another id" in err[0]
    assert not out.exists()


def fail_writes(monkeypatch, out, call: int, code: int):
    """os.write to the output fails with `code` from its `call`-th call on."""
    def to_output(fd, data):
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(out))
    return fail_from(monkeypatch, os, "write", call, OSError(code, os.strerror(code)), when=to_output)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
@pytest.mark.parametrize("call", [1, 2])
def test_a_failed_write_is_one_line_keeps_whole_records_and_resumes(model_with_tokenizer, tmp_path, capsys,
                                                                     monkeypatch, code, call):
    path, out, whole = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    write_jsonl(path, RECORDS)
    assert run_job(model_with_tokenizer, path, whole) == 0
    with monkeypatch.context() as m:
        fail_writes(m, out, call, code)
        capsys.readouterr()
        assert run_job(model_with_tokenizer, path, out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: cannot write {out}: {os.strerror(code)}; the records written before it are kept")
    assert len(lines(out)) == 2 * (call - 1)  # whole blocks of 2, no partial line
    assert run_job(model_with_tokenizer, path, out) == 0
    assert sorted(map(json.dumps, lines(out))) == sorted(map(json.dumps, lines(whole)))


def test_a_failed_write_starts_its_error_on_a_line_of_its_own_below_the_progress_bar(
        model_with_tokenizer, tmp_path, capsys, monkeypatch):
    """The job's bar is drawn (no --quiet; tqdm draws it on a file as on a terminal), ending with no
    newline: the error line must not run on from it."""
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, RECORDS)
    with monkeypatch.context() as m:
        fail_writes(m, out, 2, errno.EFBIG)
        code = main(["--model", str(model_with_tokenizer), *[f for f in JOB if f != "--quiet"], "--input", str(path),
                     "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "job:" in err and "2/6" in err, err  # the bar showed the first block done
    assert f"\nerror: cannot write {out}: {os.strerror(errno.EFBIG)};" in err, err
    assert err.rstrip("\n").splitlines()[-1].startswith("error: "), err  # not followed by the bar drawn again


def test_a_failed_json_out_at_the_end_is_one_line(model_with_tokenizer, tmp_path, capsys, monkeypatch):
    path, out, report = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "report.json"
    write_jsonl(path, RECORDS)
    import flexh2o.common.output_files
    # the first atomic write under a plain .tmp- name (the job's settings go under .out.jsonl.job.json.tmp-)
    fail_from(monkeypatch, flexh2o.common.output_files.os, "fsync", 1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
              when=lambda fd: os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / ".tmp-")))
    assert run_job(model_with_tokenizer, path, out, "--json-out", str(report)) == 1
    line = last_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot write {report}: No space left on device")
    assert len(lines(out)) == len(RECORDS) and not report.exists()
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def limited(size: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def test_a_file_size_limit_for_real_is_one_line_and_resumable(model_with_tokenizer, tmp_path):
    """`ulimit -f`: the kernel refuses the write past the limit with EFBIG (python ignores SIGXFSZ)."""
    path, out, whole = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    records = [{"id": f"r{n}", "prompt": r["prompt"]} for n, r in enumerate(RECORDS * 4)]  # more than the settings
    write_jsonl(path, records)
    assert run_job(model_with_tokenizer, path, whole) == 0
    first_block = sum(map(len, whole.read_bytes().splitlines(keepends=True)[:2]))
    limit = max(os.path.getsize(str(whole) + ".job.json"), first_block) + 1  # the settings and the first block fit
    assert limit < whole.stat().st_size
    cmd = [sys.executable, "-m", "flexh2o.run", "--model", str(model_with_tokenizer), *JOB, "--input", str(path),
           "--output", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limited(limit))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert last_line(r.stderr).startswith(f"error: cannot write {out}: File too large;")
    assert 2 <= len(lines(out)) < len(records)
    assert run_job(model_with_tokenizer, path, out) == 0  # the same job, resumed without the limit
    assert sorted(x["id"] for x in lines(out)) == sorted(x["id"] for x in records)


def test_a_killed_job_resumes_to_what_an_uninterrupted_one_writes(model_with_tokenizer, mixed_prompts, tmp_path):
    path, _ = mixed_prompts
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    flags = ["--gpu-batch-size", "3", "--gen-len", "5"]
    assert run(model_with_tokenizer, path, whole, *flags) == 0
    lines = open(whole, "rb").read().splitlines(keepends=True)
    # as if killed after the second block, in the middle of writing the third
    cut.write_bytes(b"".join(lines[:6]) + lines[6][:11])
    os.link(str(whole) + ".job.json", str(cut) + ".job.json")
    assert len(complete_records(cut)[0]) == 6
    assert run(model_with_tokenizer, path, cut, *flags) == 0
    assert records(cut) == records(whole)
    assert len(open(cut).read().splitlines()) == 10  # every id exactly once
    before = cut.read_bytes()
    assert run(model_with_tokenizer, path, cut, *flags) == 0  # done already: nothing to do
    assert cut.read_bytes() == before


def test_resuming_with_other_settings_is_refused_unless_overwrite(model_with_tokenizer, mixed_prompts, tmp_path,
                                                                   capsys):
    path, _ = mixed_prompts
    out = tmp_path / "out.jsonl"
    assert run(model_with_tokenizer, path, out, "--gpu-batch-size", "5", "--gen-len", "2") == 0
    capsys.readouterr()
    assert run(model_with_tokenizer, path, out, "--gpu-batch-size", "5", "--gen-len", "3") == 2
    err = capsys.readouterr().err
    assert "--output" in err and "max_tokens=2" in err and "another --output" in err and "--overwrite" not in err
    assert run(model_with_tokenizer, path, out, "--gpu-batch-size", "5", "--gen-len", "3", "--overwrite") == 0
    assert all(r["completion_tokens"] <= 3 for r in records(out).values())


def test_resuming_with_int8_activations_switched_is_refused(model_with_tokenizer, mixed_prompts, tmp_path, capsys):
    """The option changes records; a job begun without it records nothing of it (as jobs begun
    before it existed), so only a switch is refused."""
    path, _ = mixed_prompts
    out = tmp_path / "out.jsonl"
    assert run(model_with_tokenizer, path, out, "--gpu-batch-size", "5", "--gen-len", "2") == 0
    assert "int8_activations" not in open(str(out) + ".job.json").read()
    capsys.readouterr()
    assert run(model_with_tokenizer, path, out, "--gpu-batch-size", "5", "--gen-len", "2", "--int8-activations") == 2
    err = capsys.readouterr().err
    assert "int8_activations=None, this run has True" in err and "another --output" in err


def test_resuming_with_another_version_of_the_model_files_is_refused(model_with_tokenizer, mixed_prompts, tmp_path,
                                                                     capsys):
    path, _ = mixed_prompts
    model, out = tmp_path / "model", tmp_path / "out.jsonl"
    shutil.copytree(model_with_tokenizer, model)
    assert run(model, path, out, "--gpu-batch-size", "5", "--gen-len", "2") == 0
    before = json.load(open(str(out) + ".job.json"))["model_sha256"]
    with open(model / "tokenizer_config.json", "a") as f:
        f.write("\n")  # the same tokenizer, other bytes: the job cannot tell what else changed
    capsys.readouterr()
    assert run(model, path, out, "--gpu-batch-size", "5", "--gen-len", "2") == 2
    err = capsys.readouterr().err
    assert f"was made with model_sha256={before!r}, this run has " in err and "another --output" in err


def start_job(model_dir, input_path, output_path, *flags):
    return subprocess.Popen([sys.executable, "-m", "flexh2o.run", "--model", str(model_dir), "--input", str(input_path),
                             "--output", str(output_path), "--quiet", *flags],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(proc, path, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return True
        time.sleep(0.002)
    return False


@pytest.fixture
def many_prompts(tmp_path):
    path = tmp_path / "many.txt"
    path.write_text("\n".join(prompt(1 + (7 * i) % 25, i) for i in range(48)) + "\n")
    return path


@pytest.mark.parametrize("after", [1, pytest.param(20, marks=pytest.mark.slow)])  # 20: make test-all
def test_a_job_killed_with_sigkill_finishes_on_the_same_command(model_with_tokenizer, many_prompts, tmp_path, after):
    flags = ["--gpu-batch-size", "2", "--gen-len", "12", "--weights", "gpu=0,cpu=50,disk=50",
             "--offload-dir", str(tmp_path / "off")]
    whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
    assert run(model_with_tokenizer, many_prompts, whole, *flags) == 0
    proc = start_job(model_with_tokenizer, many_prompts, killed, *flags)
    reached = wait_for_lines(proc, killed, after)
    proc.kill()
    proc.communicate()
    assert reached, "the job ended before it could be killed"
    kept = len(complete_records(killed)[0])
    assert after <= kept < 48
    assert run(model_with_tokenizer, many_prompts, killed, *flags) == 0
    assert records(killed) == records(whole)
    assert len(killed.read_text().splitlines()) == 48


def test_ctrl_c_says_how_many_records_are_safe_and_how_to_resume(model_with_tokenizer, many_prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = start_job(model_with_tokenizer, many_prompts, out, "--gpu-batch-size", "2", "--gen-len", "12")
    assert wait_for_lines(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    line = [x for x in err.splitlines() if x.startswith("stopped by SIGINT")]
    assert len(line) == 1, err
    kept = len(complete_records(out)[0])
    assert f"{kept} of 48 records are safe in {out}" in line[0] and "--input" in line[0]
