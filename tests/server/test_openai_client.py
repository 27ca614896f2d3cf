"""flexh2o's server as OpenAI's Python client meets it: models, completions (every prompt form), chat,
streaming, n choices, log-probabilities and echo, stop strings; and a request's text the same
whatever else is in flight."""

import concurrent.futures
import json
import threading
import time
import urllib.request

import openai
import pytest
import torch

from serving import WORDS, server, start, word_llama  # noqa: F401 - fixtures

PROMPTS = ["the red ship and the blue sea", "one two three", "a cat on the hill at night",
           "the king of the city was old", "hello world", "river"]


def test_the_model_is_listed_and_described(server):
    client = server.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == [server.service.state.ctx.model]
    assert client.models.retrieve(listed[0].id).id == listed[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completions_take_a_string_strings_and_token_ids(server):
    client = server.client()
    one = client.completions.create(model=server.service.state.ctx.model, prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0)
    assert len(one.choices) == 1 and one.choices[0].finish_reason in ("stop", "length")
    assert one.usage.prompt_tokens == len(PROMPTS[0].split()) and 1 <= one.usage.completion_tokens <= 6
    ids = server.service.state.ctx.tokenizer(PROMPTS[0])["input_ids"]
    by_ids = client.completions.create(model=one.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model=one.model, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.choices[0].text == one.choices[0].text
    lists = client.completions.create(model=one.model, prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    assert lists.choices[0].text == one.choices[0].text and len(lists.choices) == 2


def test_chat_goes_through_the_template_and_streams_the_same_text(server):
    client = server.client()
    messages = [{"role": "system", "content": "the sun"}, {"role": "user", "content": "name three rivers"}]
    whole = client.chat.completions.create(model=server.service.state.ctx.model, messages=messages, max_tokens=12,
                                           temperature=0)
    template = server.service.state.ctx.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(template.split())
    assert whole.choices[0].message.role == "assistant"
    parts = [{"type": "text", "text": "name three "}, {"type": "text", "text": "rivers"}]
    joined = client.chat.completions.create(model=whole.model, messages=[messages[0], {"role": "user",
                                            "content": parts}], max_tokens=12, temperature=0)
    assert joined.choices[0].message.content == whole.choices[0].message.content
    stream = client.chat.completions.create(model=whole.model, messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_a_streamed_completion_with_a_stop_string_sends_nothing_past_it(server):
    client = server.client()
    model = server.service.state.ctx.model
    free = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                     stop=None).choices[0].text
    words = free.split()
    assert len(words) > 3
    stop = " ".join(words[2:4])  # a stop string spanning two tokens
    whole = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=30, temperature=0, stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == free[: free.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[3], max_tokens=30, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_n_choices_sampled_with_a_seed_come_again_and_greedy_ones_agree(server):
    client = server.client()
    model = server.service.state.ctx.model
    sampled = [client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, n=3, seed=7,
                                         temperature=1.5) for _ in range(2)]
    texts = [[c.text for c in r.choices] for r in sampled]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1
    alone = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, seed=7, temperature=1.5)
    assert alone.choices[0].text == texts[0][0]  # choice 0 draws from the seed itself
    greedy = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, n=2, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text


def reference_logprobs(directory, ids: list) -> list:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return [logprobs[n, ids[n + 1]].item() for n in range(len(ids) - 1)]


def test_echo_and_logprobs_as_lm_eval_asks_for_them(server, word_llama):
    """lm-eval's loglikelihood request: the token ids, echo, max_tokens 1, logprobs 1. Each prompt
    token after the first has the log-probability transformers gives it; the greedy token's is the
    top one's."""
    client = server.client()
    ids = server.service.state.ctx.tokenizer(PROMPTS[2])["input_ids"]
    out = client.completions.create(model=server.service.state.ctx.model, prompt=ids, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0, seed=1234)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPTS[2])
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(reference_logprobs(word_llama, ids), abs=1e-4)
    generated_top = lp.top_logprobs[-1]
    assert len(generated_top) == 1 and list(generated_top.values())[0] == pytest.approx(lp.token_logprobs[-1])
    scored = client.completions.create(model=out.model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1] and scored.usage.completion_tokens == 0
    chat = client.chat.completions.create(model=out.model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)  # greedy: the likeliest


def alone_and_together(server) -> tuple[list, list]:
    """Greedy and seeded sampled requests, each alone, then all at once from 8 threads (4 rows)."""
    client = server.client()
    model = server.service.state.ctx.model
    asks = [dict(prompt=p, max_tokens=4 + 5 * n, temperature=0) for n, p in enumerate(PROMPTS)]
    asks += [dict(prompt=p, max_tokens=20, temperature=0.9, seed=n, top_p=0.9) for n, p in enumerate(PROMPTS)]

    def ask(kwargs):
        return client.completions.create(model=model, **kwargs).choices[0].text
    alone = [ask(a) for a in asks]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, asks))
    assert len(set(alone)) > len(asks) // 2
    return alone, together


def test_a_request_gets_the_same_text_whatever_else_is_in_flight(server):
    alone, together = alone_and_together(server)
    assert together == alone


@pytest.mark.parametrize("flags", [
    ["--hh-ratio", "0.3", "--weights", "gpu=50,cpu=25,disk=25", "--cache", "gpu=50,cpu=0,disk=50", "--compress-cache"],
    ["--prompt-chunk", "3", "--cache", "gpu=50,cpu=50,disk=0", "--compress-weight"]])
def test_every_placement_and_policy_keeps_a_request_to_its_own_text(word_llama, tmp_path, flags):  # noqa: F811
    """H2O with weights and a compressed cache partly on disk; prompts in chunks beside 4-bit weights."""
    running = start(word_llama, tmp_path, *flags)
    try:
        alone, together = alone_and_together(running)
    finally:
        assert running.stop() == 0
    assert together == alone


def wait_for(condition, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.01)


def test_a_closed_stream_frees_its_row_at_the_next_step(server, monkeypatch):
    """The engine is held at the sequence's second token while the client closes its stream after
    the first chunk; once let go, the sequence leaves its row at the next step, far short of its
    max_tokens."""
    from flexh2o.server.online import OnlineChoice
    held, go = threading.Event(), threading.Event()
    token = OnlineChoice.token

    def holding(tag, request, t):
        if len(tag.tracker.tokens) == 1:  # (the second token)
            held.set()
            go.wait(60)
        token(tag, request, t)
    monkeypatch.setattr(OnlineChoice, "token", holding)
    client, loop = server.client(), server.service.loop
    stream = client.completions.create(model=server.service.state.ctx.model, prompt=PROMPTS[0], max_tokens=100,
                                       temperature=0, stream=True)
    next(iter(stream))
    assert held.wait(60)
    (request,) = list(loop.in_pool)
    stream.close()
    wait_for(lambda: request.cancelled, "the server to see the client go")
    go.set()
    wait_for(loop.idle, "the row to be freed")
    assert len(request.tag.tracker.tokens) == 2


def test_metrics_count_what_was_served(server):
    server.client().completions.create(model=server.service.state.ctx.model, prompt="hello", max_tokens=3,
                                       temperature=0)

    def counts() -> dict:
        text = urllib.request.urlopen(server.url + "/metrics").read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}
    wait_for(lambda: counts().get('flexh2o_requests_total{route="/v1/completions",status="200"}'),
             "the request counted (once its answer is out)")
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    counts = counts()
    assert counts['flexh2o_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert counts["flexh2o_generated_tokens_total"] >= 3 and counts["flexh2o_rows"] == 4
    assert counts["flexh2o_time_to_first_token_seconds_count"] >= 1
    assert "flexh2o_inter_token_latency_seconds_bucket" in text and "flexh2o_queue_depth" in text
    health = json.load(urllib.request.urlopen(server.url + "/health"))
    assert health == {"status": "ready"}


def test_words_known(server):
    assert set(" ".join(PROMPTS).split()) <= set(WORDS)
