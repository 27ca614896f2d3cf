"""The Python API refuses bad arguments with a UsageError naming them (their type and their range), runs calls
from several threads one at a time, refuses a closed engine, releases an engine dropped without close(), and shows
a large generate call's progress."""

import gc
import os
import threading

import pytest
import torch

from flexh2o import LLM, Engine, Policy, UsageError
from flexh2o.jobs.llm import CHUNK_BATCHES
from conftest import VOCAB, padded_batch


@pytest.fixture
def engine(tiny_models, tmp_path):
    directory, _ = tiny_models["tiny"]
    policy = Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0)
    with Engine.from_pretrained(directory, policy=policy, dtype=torch.float32, offload_dir=str(tmp_path)) as e:
        yield e


def test_generate_from_several_threads_runs_one_call_at_a_time(engine, tmp_path):
    prompts = [padded_batch(2, 6, pads=[0, 1], seed=s) for s in range(4)]
    alone = [engine.generate(ids, mask, max_new_tokens=4, eos_token_id=None) for ids, mask in prompts]
    files = sorted(os.listdir(next(tmp_path.iterdir())))
    results, errors = [None] * 4, []

    def call(n):
        try:
            results[n] = engine.generate(*prompts[n], max_new_tokens=4, eos_token_id=None)
        except BaseException as e:  # noqa: BLE001 - the test reports any
            errors.append(e)
    threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert all(torch.equal(a, b) for a, b in zip(alone, results))
    assert sorted(os.listdir(next(tmp_path.iterdir()))) == files  # no cache file left behind


BAD = {
    "ids-above-the-vocabulary": (dict(input_ids=torch.tensor([[5, VOCAB], [5, 6]])), "input_ids"),
    "negative-ids": (dict(input_ids=torch.tensor([[5, -1], [5, 6]])), "input_ids"),
    "float-ids": (dict(input_ids=torch.ones(2, 3)), "input_ids"),
    "empty-prompt": (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), "input_ids"),
    "mask-of-twos": (dict(attention_mask=torch.full((2, 3), 2)), "attention_mask"),
    "a-row-of-padding-only": (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "attention_mask"),
    "fractional-max-new-tokens": (dict(max_new_tokens=2.5), "max_new_tokens"),
    "string-max-new-tokens": (dict(max_new_tokens="4"), "max_new_tokens"),
    "forced-token-outside": (dict(forced_tokens=torch.tensor([[1, VOCAB + 3], [1, 2]]), max_new_tokens=2),
                             "forced_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_argument_is_a_usage_error_naming_it(engine, case):
    changes, name = BAD[case]
    args = dict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2) | changes
    with pytest.raises(UsageError) as e:
        engine.generate(**args)
    assert e.value.flag == name


def test_a_closed_engine_is_refused(engine):
    engine.close()
    with pytest.raises(UsageError, match="the engine was closed"):
        engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2)


ENGINE_CALLS = {
    "eos-a-string": (dict(eos_token_id="</s>"), "eos_token_id"),
    "eos-outside-the-vocabulary": (dict(eos_token_id=[2, VOCAB]), "eos_token_id"),
    "eos-a-bool": (dict(eos_token_id=True), "eos_token_id"),
    "do-sample-a-string": (dict(do_sample="yes"), "do_sample"),
    "temperature-zero": (dict(do_sample=True, temperature=0), "temperature"),
    "temperature-a-string": (dict(temperature="hot"), "temperature"),
    "top-k-fractional": (dict(top_k=1.5), "top_k"),
    "top-p-above-one": (dict(top_p=1.5), "top_p"),
    "seed-negative": (dict(seed=-3), "seed"),
    "seed-a-string": (dict(seed="7"), "seed"),
    "pad-negative": (dict(pad_token_id=-1), "pad_token_id"),
    "stop-check-not-a-function": (dict(stop_check=5), "stop_check"),
    "progress-a-string": (dict(progress="yes"), "progress"),
}


@pytest.mark.parametrize("case", list(ENGINE_CALLS))
def test_a_bad_generate_setting_is_a_usage_error_naming_it(engine, case):
    changes, name = ENGINE_CALLS[case]
    with pytest.raises(UsageError) as e:
        engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2, **changes)
    assert e.value.flag == name, e.value


@pytest.mark.parametrize("changes, name", [
    (dict(policy="h2o"), "policy"), (dict(policy={"gpu_batch_size": 2}), "policy"), (dict(seed="1"), "seed"),
    (dict(seed=-1), "seed"), (dict(offload_dir=5), "offload_dir"), (dict(dummy="no"), "dummy"),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v[k]!r}" for k in v))
def test_a_bad_engine_argument_is_a_usage_error_naming_it(tiny_models, changes, name):
    with pytest.raises(UsageError) as e:
        Engine.from_pretrained(tiny_models["tiny"][0], **changes)
    assert e.value.flag == name


LLM_ARGUMENTS = {
    "weights-a-triple": (dict(weights=(100, 0, 0)), "weights"),
    "weights-a-string": (dict(weights="gpu"), "weights"),
    "cache-over-a-hundred": (dict(cache=(150, 0)), "cache"),
    "weights-and-cache-sum": (dict(weights=(60, 60)), "weights/cache"),
    "batch-a-string": (dict(gpu_batch_size="8"), "gpu_batch_size"),
    "batch-a-bool": (dict(gpu_batch_size=True), "gpu_batch_size"),
    "batch-zero": (dict(num_gpu_batches=0), "num_gpu_batches"),
    "hh-ratio-a-string": (dict(kv_policy="h2o", hh_ratio="0.2"), "hh_ratio"),
    "kv-policy-unknown": (dict(kv_policy="lru"), "kv_policy"),
    "compress-a-string": (dict(compress_weight="yes"), "compress_weight"),
    "chat-a-number": (dict(chat=1), "chat"),
    "seed-negative": (dict(seed=-1), "seed"),
    "seed-a-float": (dict(seed=1.5), "seed"),
    "offload-dir-a-number": (dict(offload_dir=5), "offload_dir"),
    "path-empty": (dict(path=""), "path"),
}


@pytest.mark.parametrize("case", list(LLM_ARGUMENTS))
def test_a_bad_llm_argument_is_a_usage_error_naming_it(model_with_tokenizer, case):
    changes, name = LLM_ARGUMENTS[case]
    with pytest.raises(UsageError) as e:
        LLM(str(model_with_tokenizer), **changes)
    assert e.value.flag == name, e.value


def test_a_model_that_is_not_a_string_is_named():
    for model in (None, 123, ["m"]):
        with pytest.raises(UsageError) as e:
            LLM(model)
        assert e.value.flag == "model"


@pytest.fixture(scope="module")
def llm(tiny_models, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    directory = tmp_path_factory.mktemp("llm")
    for f in os.listdir(tiny_models["tiny"][0]):
        os.symlink(os.path.join(tiny_models["tiny"][0], f), directory / f)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{w: 4 + i for i, w in enumerate(["the", "cat", "sat"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                            chat_template=template).save_pretrained(directory)
    with LLM(str(directory), gpu_batch_size=2, dtype=torch.float32) as model:
        yield model


GENERATE_ARGUMENTS = {
    "prompts-one-string": (dict(prompts="the cat"), "prompts"),
    "prompts-one-chat": (dict(prompts=[{"role": "user", "content": "the cat"}]), "prompts"),
    "prompts-a-number": (dict(prompts=5), "prompts"),
    "prompt-empty": (dict(prompts=["the", ""]), "prompts"),
    "prompt-none": (dict(prompts=[None]), "prompts"),
    "message-without-content": (dict(prompts=[[{"role": "user"}]]), "prompts"),
    "message-not-a-dict": (dict(prompts=[["the cat"]]), "prompts"),
    "prompt-lone-surrogate": (dict(prompts=["the \udc00 cat"]), "prompts"),
    "prompt-only-whitespace": (dict(prompts=["the cat", " \t\n "]), "prompts"),
    "max-tokens-a-string": (dict(max_tokens="4"), "max_tokens"),
    "max-tokens-zero": (dict(max_tokens=0), "max_tokens"),
    "max-tokens-fractional": (dict(max_tokens=2.5), "max_tokens"),
    "max-tokens-a-bool": (dict(max_tokens=True), "max_tokens"),
    "max-tokens-of-5000-digits": (dict(max_tokens=10 ** 4999), "max_tokens"),
    "seed-of-5000-digits": (dict(seed=-10 ** 4999), "seed"),
    "stop-a-dict": (dict(stop={"a": 1}), "stop"),
    "stop-empty": (dict(stop=""), "stop"),
    "stop-an-empty-one": (dict(stop=["cat", ""]), "stop"),
    "stop-too-many": (dict(stop=["a"] * 5), "stop"),
    "stop-a-number": (dict(stop=[1]), "stop"),
    "seed-negative": (dict(seed=-1), "seed"),
    "seed-a-string": (dict(seed="1"), "seed"),
    "temperature-negative": (dict(temperature=-1), "temperature"),
    "temperature-nan": (dict(temperature=float("nan")), "temperature"),
    "top-p-zero": (dict(top_p=0), "top_p"),
    "top-k-negative": (dict(top_k=-1), "top_k"),
    "progress-a-string": (dict(progress="yes"), "progress"),
}


@pytest.mark.parametrize("case", list(GENERATE_ARGUMENTS))
def test_a_bad_llm_generate_argument_is_a_usage_error_naming_it(llm, case):
    changes, name = GENERATE_ARGUMENTS[case]
    args = dict(prompts=["the cat"], max_tokens=2) | changes
    with pytest.raises(UsageError) as e:
        llm.generate(**args)
    assert e.value.flag == name, e.value


def test_a_prompt_the_tokenizer_makes_nothing_of_is_named_before_anything_runs(llm, monkeypatch):
    """A whitespace-only prompt has no token to predict from: it reached the model as an empty row."""
    monkeypatch.setattr(Engine, "generate_refilled", lambda *a, **k: pytest.fail("the engine ran"))
    with pytest.raises(UsageError) as e:
        llm.generate(["the cat", "   "], max_tokens=2, progress=False)
    assert str(e.value) == "prompts: prompt 1: the prompt has no tokens with this model's tokenizer (is it only " \
                           "whitespace?)"


def test_a_huge_integer_is_said_by_its_length(llm):
    with pytest.raises(UsageError, match="got an integer of about 5000 digits"):
        llm.generate(["the cat"], max_tokens=10 ** 4999)


def finished_in_time(work, seconds: float = 120):
    """work() on a thread of its own: ("returned", what it returned) or ("raised", the error); a
    thread still waiting after `seconds` (a deadlock) fails the test instead of hanging it. (The
    test's engine is then left unclosed: closing it would wait for the lock the thread holds.)"""
    done = []

    def run():
        try:
            done.append(("returned", work()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            done.append(("raised", e))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a deadlock"
    return done[0]


def test_generate_from_inside_a_running_stream_is_refused_not_a_deadlock(model_with_tokenizer):
    llm = LLM(str(model_with_tokenizer), gpu_batch_size=2, dtype=torch.float32)
    refused = []

    def progress(records, tokens):
        for name, call in (("generate", lambda: llm.generate(["the cat"], max_tokens=1, progress=False)),
                           ("stream", lambda: llm.stream(["the cat"])), ("close", llm.close)):
            with pytest.raises(UsageError) as e:
                call()
            refused.append(e.value.flag)
            assert "called from inside the progress callback" in e.value.message
    how, got = finished_in_time(lambda: list(llm.stream(["the cat", "sat", "the"], max_tokens=2, progress=progress)))
    assert how == "returned" and sorted(c.index for c in got) == [0, 1, 2]
    assert refused == ["generate", "stream", "close"] * (len(refused) // 3) and refused
    assert len(llm.generate(["the cat"], max_tokens=1, progress=False)) == 1  # the engine is free again
    llm.close()


def test_an_engine_call_from_its_own_callback_is_refused_not_a_deadlock(tiny_models):
    engine = Engine.from_pretrained(tiny_models["tiny"][0], policy=Policy(gpu_batch_size=2), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])

    def stop_check(row, tokens):
        return engine.generate(ids, max_new_tokens=1)
    how, error = finished_in_time(lambda: engine.generate(ids, max_new_tokens=3, stop_check=stop_check))
    assert how == "raised" and isinstance(error, UsageError) and error.flag == "generate", error
    assert engine.generate(ids, max_new_tokens=1).shape == (2, 4)  # and the lock is given back
    engine.close()


def test_a_refilled_request_without_prompt_tokens_is_a_usage_error(engine):
    from flexh2o.engine.slot_request import Request
    with pytest.raises(UsageError) as e:
        engine.generate_refilled([Request([5, 6], 2), Request([], 2)], lambda *a: None, prompt_len=4, gen_len=2)
    assert e.value.flag == "requests" and "without prompt tokens" in e.value.message


def io_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("flexh2o-io")]


@pytest.mark.parametrize("cycle", [False, True])
def test_an_engine_dropped_without_close_releases_its_threads_and_files(tiny_models, tmp_path, cycle):
    before = io_threads()
    policy = Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0)
    engine = Engine.from_pretrained(tiny_models["tiny"][0], policy=policy, dtype=torch.float32,
                                    offload_dir=str(tmp_path))
    engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2)
    assert len(io_threads()) > len(before) and os.listdir(tmp_path)
    if cycle:
        engine.me = engine  # collected by the garbage collector, not by its count of references
    del engine
    gc.collect()
    assert io_threads() == before and os.listdir(tmp_path) == []


def test_a_large_generate_call_shows_progress_and_does_linear_work(llm, monkeypatch, capsys):
    batch = 2  # the llm fixture's (its engine's policy follows each block's own size)
    n = 3 * CHUNK_BATCHES * batch + 1  # more than three chunks
    calls = {"tokenize": 0, "generate": 0}

    def counted(owner, name, key):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: (calls.__setitem__(key, calls[key] + 1), real(*a, **k))[1])
    counted(type(llm.tokenizer), "__call__", "tokenize")
    counted(Engine, "generate_refilled", "generate")
    got = llm.generate(["the cat sat"] * n, max_tokens=1)
    assert [c.index for c in got] == list(range(n))
    assert calls["tokenize"] == 2 * n  # each prompt tokenized when checked and when its slot takes it
    assert calls["generate"] == 4  # one engine call per chunk of prompts read ahead
    calls["generate"] = 0
    assert len(llm.generate(["the cat"] * 4 * batch, max_tokens=1, progress=False)) == 4 * batch
    assert calls["generate"] == 1
    assert f"{n}/{n}" in capsys.readouterr().err
