"""Model files are data: a hostile or broken chat template, GGUF header, safetensors header or tokenizer.json is one
line naming the file and what is wrong (exit 2), never a traceback, a hang or a recursion out of the stack."""

import json
import os
import shutil
import struct

import pytest

from flexh2o.common.errors import UsageError
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.run import main

JOB = ["--dtype", "float32", "--quiet", "--gpu-batch-size", "1", "--gen-len", "2"]
SMALL = ["--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "1", "--dtype", "float32"]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}" \
       "{% endfor %}{% endfor %}"

TEMPLATES = {
    "raises": ("{{ raise_exception('only user turns') }}", "only user turns"),
    "includes": ("{% include 'other.jinja' %}", "no loader for this environment"),
    "imports": ("{% import 'macros.jinja' as m %}{{ m.x() }}", "no loader for this environment"),
    "reaches-a-dunder": ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    "calls-a-method-that-mutates": ("{{ messages.append(1) }}", "SecurityError"),
    "syntax-error": ("{% for m in messages %}{{ m.content }}", "TemplateSyntaxError"),
    "unknown-filter": ("{{ messages | shell }}", "No filter named 'shell'"),
    "loops-forever": (LOOP, "ran for over 0.5 s (a loop?) and was stopped"),
    "outputs-forever": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}"
                        "{% endfor %}", "ran for over 0.5 s"),
    "repeats-a-string": ("{{ 'x' * 1000000000 }}", "repeats 1 items 1000000000 times"),
    "repeats-a-list": ("{{ ([1] * 1000000000) | length }}", "repeats 1 items 1000000000 times"),
    "a-huge-power": ("{{ 10 ** 1000000000 }}", "raises 10 to the power 1000000000"),
    "recurses": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
}


@pytest.fixture
def with_template(model_with_tokenizer, monkeypatch):
    monkeypatch.setattr("flexh2o.checkpoints.chat_template.MAX_SECONDS", 0.5)  # (a new module: no limit before)

    def make(template: str):
        tokenizer = load_tokenizer(str(model_with_tokenizer))
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(model_with_tokenizer))
        return model_with_tokenizer
    return make


@pytest.mark.parametrize("case", TEMPLATES)
def test_a_hostile_chat_template_fails_its_record_in_one_line(with_template, tmp_path, capsys, case):
    template, says = TEMPLATES[case]
    model = with_template(template)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "the cat"}]}) + "\n")
    code = main(["--model", str(model), *JOB, "--input", str(path), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --input: {path}:1: the chat template of {model}") and says in err[0], err[0]
    assert not out.exists()


@pytest.mark.parametrize("case", ["raises", "loops-forever", "syntax-error"])
def test_a_hostile_chat_template_under_chat_is_one_line(with_template, tmp_path, capsys, case):
    template, says = TEMPLATES[case]
    model = with_template(template)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n")
    code = main(["--model", str(model), *SMALL, "--prompts-file", str(prompts), "--chat"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --chat: the chat template of {model}"), err
    assert says in err[0]


def test_a_good_template_renders_as_transformers_renders_it(with_template):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content * 2 }}{% endfor %}{{ 2 ** 3 }}"
    tokenizer = load_tokenizer(str(with_template(template)))
    messages = [{"role": "user", "content": "the cat"}]
    from flexh2o.checkpoints.chat_template import render_chat
    assert render_chat(tokenizer, messages, "m") == \
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<user>the catthe cat8"


def gguf_bytes(kvs=(), tensors=(), tensor_count=None, kv_count=None, data=b"\0" * 64) -> bytes:
    """A GGUF file of version 3: kvs as (key, type id, packed value), tensors as (name, dims, type id, offset)."""
    def string(text):
        return struct.pack("<Q", len(text)) + text.encode()
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if tensor_count is None else tensor_count,
                                len(kvs) if kv_count is None else kv_count)
    for key, type_id, value in kvs:
        out += string(key) + struct.pack("<I", type_id) + value
    for name, dims, type_id, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
    return out + b"\0" * (-len(out) % 32) + data


F32, Q4_0, U32, STRING = 0, 2, 4, 8
ONE_TENSOR = [("t", (4,), F32, 0)]
GGUF_HEADERS = {
    "alignment-0": (dict(kvs=[("general.alignment", U32, struct.pack("<I", 0))], tensors=ONE_TENSOR),
                    "general.alignment is 0: a power of two up to 1048576 is accepted"),
    "alignment-not-a-power-of-two": (dict(kvs=[("general.alignment", U32, struct.pack("<I", 24))],
                                          tensors=ONE_TENSOR), "general.alignment is 24"),
    "alignment-as-text": (dict(kvs=[("general.alignment", STRING, struct.pack("<Q", 2) + b"32")],
                               tensors=ONE_TENSOR), "general.alignment is '32'"),
    "tensor-count-beyond-the-file": (dict(tensor_count=1 << 60), "counts 1152921504606846976 tensors"),
    "kv-count-beyond-the-file": (dict(kv_count=1 << 62), "counts 4611686018427387904 metadata items"),
    "dimension-count": (dict(tensors=[("t", (4,) * 9, F32, 0)]), "tensor 't' has 9 dimensions"),
    "dimension-beyond-the-file": (dict(tensors=[("t", (1 << 40, 4), F32, 0)]), "runs past the end of the file"),
    "rows-not-whole-blocks": (dict(tensors=[("t", (33,), Q4_0, 0)]), "rows of 33 values, not whole blocks of 32"),
    "string-length": (dict(kvs=[("k", STRING, struct.pack("<Q", 1 << 62))]), "it is cut short"),
    "array-count": (dict(kvs=[("k", 9, struct.pack("<IQ", U32, 1 << 61))]), "it is cut short"),
    "unknown-value-type": (dict(kvs=[("k", 99, b"")]), "unknown metadata value type 99"),
    "tensor-offset": (dict(tensors=[("t", (4,), F32, 1 << 50)]), "runs past the end of the file"),
}


@pytest.mark.parametrize("case", GGUF_HEADERS)
def test_a_malformed_gguf_header_is_one_line(tmp_path, capsys, case):
    pytest.importorskip("gguf")
    fields, says = GGUF_HEADERS[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes(**fields))
    code = main(["--model", str(path), *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --model: {path} is not a readable GGUF file (") and says in err[0], err[0]


def safetensors_file(header: bytes, data: bytes = b"\0" * 16, length=None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


ENTRY = '{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
SAFETENSORS = {
    "nested-deeply": (safetensors_file(b"[" * 100000 + b"]" * 100000), "its header is JSON nested too deeply"),
    "nested-deeply-in-metadata": (safetensors_file(b'{"__metadata__": ' + b'{"a": ' * 50000 + b"1" + b"}" * 50001),
                                  "its header is JSON nested too deeply"),
    "duplicate-tensor": (safetensors_file(f'{{"w": {ENTRY}, "w": {ENTRY}}}'.encode()),
                         "its header gives the key 'w' twice"),
    "duplicate-field": (safetensors_file(b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [4], '
                                         b'"data_offsets": [0, 16]}}'), "its header gives the key 'dtype' twice"),
    "length-past-the-file": (safetensors_file(b"{}", length=1 << 40), "more than the 18 bytes after it"),
    "not-json": (safetensors_file(b"{nope"), "its header is not JSON"),
    "not-an-object": (safetensors_file(b"[1, 2]"), "its header is not a JSON object"),
    "not-utf8": (safetensors_file(b'{"\xff": 1}'), "its header is not JSON"),
    "shorter-than-its-length": (b"\x01\x02", "it holds 2 bytes, less than its header's 8-byte length"),
    "a-5000-digit-integer": (safetensors_file(b'{"w": {"dtype": "F32", "shape": [' + b"4" * 5000 + b'], '
                                              b'"data_offsets": [0, 16]}}'),
                             "its header holds an integer of more than"),
}


@pytest.mark.parametrize("case", SAFETENSORS)
def test_a_malformed_safetensors_header_is_one_line(tiny_models, tmp_path, capsys, case):
    content, says = SAFETENSORS[case]
    model = tmp_path / "model"
    shutil.copytree(tiny_models["tiny"][0], model)
    weights = model / "model.safetensors"
    weights.write_bytes(content)
    code = main(["--model", str(model), *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --model: weights file {weights} is not a valid safetensors file: ")
    assert says in err[0], err[0]


TOKENIZER_JSON = {
    "not-json": (b"{not json", "is not JSON"),
    "cut-short": (None, "is not JSON"),
    "a-list": (b"[]", "is not a JSON object"),
    "no-model": (b'{"version": "1.0"}', "is not a valid tokenizer: Model missing"),
    "model-of-unknown-type": (b'{"version": "1.0", "model": {"type": "Nope"}}', "is not a valid tokenizer"),
    "nested-deeply": (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "a-5000-digit-integer": (b'{"version": "1.0", "truncation": ' + b"7" * 5000 + b"}",
                             "holds an integer of more than"),
}


@pytest.mark.parametrize("case", TOKENIZER_JSON)
def test_a_broken_tokenizer_json_is_one_line_naming_it(model_with_tokenizer, tmp_path, capsys, case):
    content, says = TOKENIZER_JSON[case]
    path = model_with_tokenizer / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:100] if content is None else content)
    with pytest.raises(UsageError) as e:
        load_tokenizer(str(model_with_tokenizer))
    assert e.value.flag == "--model/--path" and e.value.message.startswith(f"{path} ") and says in e.value.message
    prompts = tmp_path / "in.txt"
    prompts.write_text("the cat\n")
    code = main(["--model", str(model_with_tokenizer), *JOB, "--input", str(prompts), "--output",
                 str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(path) in err[0], err


def test_a_tokenizer_config_that_is_not_json_is_named(model_with_tokenizer):
    path = model_with_tokenizer / "tokenizer_config.json"
    path.write_text('{"tokenizer_class": ')
    with pytest.raises(UsageError) as e:
        load_tokenizer(str(model_with_tokenizer))
    assert e.value.message.startswith(f"{path} is not JSON")
    os.remove(path)


def test_a_looping_template_is_stopped_off_the_main_thread_too(with_template):
    import threading
    from flexh2o.checkpoints.chat_template import ChatTemplateError, render_chat
    tokenizer = load_tokenizer(str(with_template(LOOP)))
    caught = []

    def render():
        try:
            render_chat(tokenizer, [{"role": "user", "content": "x"}], "m")
        except ChatTemplateError as e:
            caught.append(str(e))
    thread = threading.Thread(target=render)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and caught and "ran for over 0.5 s" in caught[0]


def test_the_callers_own_alarm_and_handler_are_kept(with_template):
    import signal
    from flexh2o.checkpoints.chat_template import render_chat
    tokenizer = load_tokenizer(str(with_template("{{ messages[0].content }}")))
    mine = lambda *a: None  # noqa: E731
    before = signal.signal(signal.SIGALRM, mine)
    signal.setitimer(signal.ITIMER_REAL, 1000)
    try:
        assert render_chat(tokenizer, [{"role": "user", "content": "the cat"}], "m") == "the cat"
        assert signal.getsignal(signal.SIGALRM) is mine and 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1000
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
