"""A dataset job's input records that are not what they look like: one line naming the file, the line and what is
wrong (exit 2, nothing written), or with --skip-bad an error record; integer ids come back as integers."""

import json

import pytest

import flexh2o.jobs.input
from flexh2o.run import main

JOB = ["--dtype", "float32", "--quiet", "--gpu-batch-size", "2", "--gen-len", "2"]
GOOD = '{"id": "a", "prompt": "the cat"}'
# An integer longer than Python converts from text (sys.get_int_max_str_digits(), 4300 by default).
HUGE = "1" + "0" * 4999
TOO_LONG = "the line holds an integer of more than"

BAD_LINES = {
    "json-nested-deeply": ("[" * 100000 + "]" * 100000, "JSON nested too deeply"),
    "object-nested-deeply": ('{"id": "x", "prompt": "a", "more": ' + "[" * 100000 + "]" * 100000 + "}",
                             "JSON nested too deeply"),
    "id-beyond-float-range": ('{"id": 1' + "0" * 400 + ', "prompt": "the cat"}', "an integer of 401 digits"),
    "id-beyond-64-bits": ('{"id": 18446744073709551616, "prompt": "the cat"}', "signed 64-bit integer"),
    "max-tokens-beyond-float-range": ('{"id": "x", "prompt": "a", "max_tokens": 1' + "0" * 400 + "}",
                                      "max_tokens must be within [1, 1048576], got an integer of 401 digits"),
    "seed-beyond-float-range": ('{"id": "x", "prompt": "a", "seed": -1' + "0" * 400 + "}", "seed must be within"),
    "lone-surrogate-in-id": ('{"id": "a\\ud800", "prompt": "the cat"}', "id holds a lone UTF-16 surrogate"),
    "lone-surrogate-in-prompt": ('{"id": "x", "prompt": "the \\udc00 cat"}', "prompt holds a lone UTF-16 surrogate"),
    "lone-surrogate-in-message": ('{"id": "x", "messages": [{"role": "user", "content": "\\ud83d"}]}',
                                  "a message's content holds a lone UTF-16 surrogate"),
    "lone-surrogate-in-stop": ('{"id": "x", "prompt": "a", "stop": ["\\udfff"]}', "stop holds a lone UTF-16"),
    "huge-integer-id": ('{"id": ' + HUGE + ', "prompt": "the cat"}', TOO_LONG),
    "huge-integer-max-tokens": ('{"id": "x", "prompt": "a", "max_tokens": ' + HUGE + "}", TOO_LONG),
    "huge-negative-seed": ('{"id": "x", "prompt": "a", "seed": -' + HUGE + "}", TOO_LONG),
    "huge-integer-in-a-field-of-no-use": ('{"id": "x", "prompt": "a", "user": [' + HUGE + "]}", TOO_LONG),
    "huge-integer-in-a-message": ('{"id": "x", "messages": [{"role": "user", "content": "a", "n": ' + HUGE + "}]}",
                                  TOO_LONG),
}


def run_job(model, path, out, *flags) -> int:
    return main(["--model", str(model), *JOB, "--input", str(path), "--output", str(out), *flags])


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_record_is_one_line_or_an_error_record(model_with_tokenizer, tmp_path, capsys, case):
    line, text = BAD_LINES[case]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(GOOD + "\n" + line + "\n", encoding="utf-8")
    assert run_job(model_with_tokenizer, path, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --input: {path}:2: ") and text in err[0], err
    assert len(err[0]) < 400 and not out.exists()
    assert run_job(model_with_tokenizer, path, out, "--skip-bad") == 0
    got = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in got] == ["line-2", "a"] and text in got[0]["error"]["message"]


GOOD_SECOND = {"jsonl": '{"id": "b", "prompt": "the cat"}',
               "openai": '{"custom_id": "b", "method": "POST", "url": "/v1/completions", '
                         '"body": {"prompt": "the cat"}}'}
FIRST_LINES = {"huge-integer": ('{"id": ' + HUGE + ', "prompt": "the cat"}', TOO_LONG),
               "nested-deeply": ('{"id": "a", "prompt": ' + "[" * 200000 + "]" * 200000 + "}",
                                 "the line is JSON nested too deeply")}


@pytest.mark.parametrize("fmt", GOOD_SECOND)
@pytest.mark.parametrize("case", FIRST_LINES)
def test_a_bad_first_line_is_one_line_or_an_error_record_and_the_next_decides_the_format(
        model_with_tokenizer, tmp_path, capsys, case, fmt):
    """The first line is where the format is told from: a record there that cannot be parsed is
    reported as any other, and the first one that can be says how the file is read."""
    line, text = FIRST_LINES[case]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(line + "\n" + GOOD_SECOND[fmt] + "\n", encoding="utf-8")
    assert run_job(model_with_tokenizer, path, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --input: {path}:1: {text}"), err
    assert not out.exists()
    assert run_job(model_with_tokenizer, path, out, "--skip-bad") == 0
    bad, good = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    if fmt == "openai":
        assert bad["custom_id"] == "line-1" and bad["error"]["message"].startswith(f"line 1: {text}")
        assert good["custom_id"] == "b" and good["response"]["status_code"] == 200
    else:
        assert bad == {"id": "line-1", "error": {"line": 1, "message": bad["error"]["message"]}}
        assert bad["error"]["message"].startswith(text) and good["id"] == "b" and "text" in good


@pytest.mark.parametrize("newline", ["", "\n"])
def test_a_line_longer_than_any_record_is_refused_without_an_output(model_with_tokenizer, tmp_path, capsys,
                                                                    monkeypatch, newline):
    monkeypatch.setattr(flexh2o.jobs.input, "MAX_LINE", 1 << 20)
    path, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    path.write_text("the cat\n" + "dog " * (1 << 19) + newline)
    assert run_job(model_with_tokenizer, path, out, "--skip-bad") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --input: {path}:2: a line longer than 1 MB: not a record (one prompt per line)"]
    assert not out.exists()


def test_a_nul_byte_is_not_text(model_with_tokenizer, tmp_path, capsys):
    path, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    path.write_bytes(b"the cat\n\0\0\0garbage\n")
    assert run_job(model_with_tokenizer, path, out) == 2
    assert capsys.readouterr().err.strip() == f"error: --input: {path}:2: not text (a NUL byte at character 0)"
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
def test_integer_ids_come_back_as_integers(model_with_tokenizer, tmp_path, fmt):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    if fmt == "jsonl":
        records = [{"id": 7, "prompt": "the cat"}, {"id": "7x", "prompt": "a dog"}, {"id": -(1 << 62), "prompt": "a"}]
    else:
        records = [{"custom_id": n, "method": "POST", "url": "/v1/completions", "body": {"prompt": "the cat"}}
                   for n in (7, 1 << 40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_job(model_with_tokenizer, path, out, "--ordered") == 0
    key = "id" if fmt == "jsonl" else "custom_id"
    assert [json.loads(x)[key] for x in out.read_text().splitlines()] == [r[key] for r in records]
