"""Teacher forcing and python -m flexh2o.eval: perplexity through the engine's real cache."""

import json
import random

import pytest
import torch

import flexh2o.eval
from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.common.version import version
from flexh2o import Engine, Policy

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


@pytest.fixture
def text(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "text.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(300)))
    return path


def windows_of(n=3, width=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n, width), generator=g)


@pytest.mark.parametrize("nb,cache", [(1, "gpu"), (3, "disk")])
def test_teacher_forced_logprobs_equal_one_forward_pass_of_transformers(tiny_models, tmp_path, nb, cache):
    """Fed one token per step through the real cache, each scored token's log-probability is what
    transformers gives it from one forward pass over the whole window."""
    directory, model = tiny_models["tiny"]
    windows, prompt_len = windows_of(), 16
    policy = Policy(3 // nb, nb, cache_gpu_percent=100 if cache == "gpu" else 0, cache_cpu_percent=0)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32,
                                offload_dir=str(tmp_path / "off")) as engine:
        logprobs, greedy = flexh2o.eval.teacher_forced(engine, windows, prompt_len)
    with torch.no_grad():
        reference = torch.log_softmax(model(windows).logits.double(), dim=-1)
    # position t's logits score token t + 1: the prompt step's last position scores token prompt_len
    expected = reference[:, prompt_len - 1:-1].gather(2, windows[:, prompt_len:, None]).squeeze(2)
    assert torch.allclose(logprobs, expected, atol=1e-4), (logprobs - expected).abs().max()
    assert torch.equal(greedy, reference[:, prompt_len - 1:-1].argmax(dim=-1))


def test_a_budget_that_holds_every_token_scores_like_the_full_cache(tiny_models):
    directory, _ = tiny_models["tiny"]
    windows = windows_of()
    scores = {}
    for name, policy in (("full", Policy(3)), ("h2o", Policy(3, hh_ratio=1.0)), ("small", Policy(3, hh_ratio=0.125))):
        with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32) as engine:
            scores[name] = flexh2o.eval.teacher_forced(engine, windows, 16)[0]
    assert torch.allclose(scores["full"], scores["h2o"], atol=1e-6)
    assert not torch.allclose(scores["full"], scores["small"], atol=1e-3)  # 2 + 2 slots of 16 + 8: evictions


def test_eval_cli_writes_ppl_and_settings_and_repeats_itself(model_with_tokenizer, text, tmp_path, capsys):
    args = ["--model", str(model_with_tokenizer), "--text", str(text), "--prompt-len", "16", "--eval-len", "8",
            "--windows", "4", "--num-gpu-batches", "2", "--hh-ratio", "0.25", "--dtype", "float32", "--agreement"]
    results = []
    for n in range(2):
        out = tmp_path / f"q{n}.json"
        assert flexh2o.eval.main(args + ["--json-out", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    r = results[0]
    assert r["tokens_scored"] == 4 * 8 and r["ppl"] > 1 and 0 <= r["agreement"] <= 1 and r["full_cache_ppl"] > 1
    assert r["policy"]["kv_policy"] == "h2o" and r["prompt_len"] == 16 and r["windows"] == 4
    assert (r["dtype"], r["model_sha256"], r["flexh2o_version"]) == \
        ("float32", model_sha256(str(model_with_tokenizer)), version())
    assert {k: v for k, v in r.items() if k != "seconds"} == {k: v for k, v in results[1].items() if k != "seconds"}
    captured = capsys.readouterr()
    assert "perplexity:" in captured.out
    assert "scoring 4 windows of 16 + 8 tokens (32 tokens scored, then again with the full cache)" in captured.err
    assert "generate:" in captured.err  # the bar over the fed tokens


@pytest.mark.parametrize("extra,flag,text_part", [
    (["--windows", "40"], "--text", "give fewer --windows"),
    (["--windows", "3", "--num-gpu-batches", "2"], "--num-gpu-batches", "must divide --windows 3"),
    (["--eval-len", "0"], "--eval-len", "positive integer"),
    (["--prompt-len", "60"], "--prompt-len/--eval-len", "exceeds the 64 positions"),
])
def test_eval_bad_input_is_one_line(model_with_tokenizer, text, capsys, extra, flag, text_part):
    args = ["--model", str(model_with_tokenizer), "--text", str(text), "--prompt-len", "16", "--eval-len", "8"]
    assert flexh2o.eval.main(args + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}: ") and text_part in err and "\n" not in err
