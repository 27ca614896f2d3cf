"""Every error the server answers, in OpenAI's shape and with its status, as the openai client and a
raw HTTP client see it; and no body a client sends makes a traceback or stops the server."""

import http.client
import json
import threading
import urllib.parse
import urllib.request

import openai
import pytest

from serving import server, start, word_llama  # noqa: F401 - fixtures
from test_openai_client import wait_for

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def guarded(word_llama, tmp_path_factory):
    """A server with an API key, a 2 KB body limit and a queue of 2 sequences."""
    running = start(word_llama, tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-body-size", "2KB",
                    "--max-queued", "2")
    yield running
    assert running.stop() == 0


def raw(url: str, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    """(status, the JSON answer, or a stream's text) of one request sent as given."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    connection.request(method, path, data, headers or {})
    answer = connection.getresponse()
    text = answer.read()
    connection.close()
    if answer.getheader("content-type", "").startswith("text/event-stream"):
        return answer.status, text.decode()
    return answer.status, json.loads(text)


def error_of(answer: tuple) -> tuple:
    status, body = answer
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, body["error"]["param"]


BAD = [({"prompt": "hello", "max_tokens": "many"}, "max_tokens"), ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
       ({"prompt": "hello", "temperature": -1}, "temperature"), ({"prompt": "hello", "top_p": 0}, "top_p"),
       ({"prompt": "hello", "n": 0}, "n"), ({"prompt": "hello", "seed": 1.5}, "seed"),
       ({"prompt": "hello", "stop": ["a"] * 5}, "stop"), ({"prompt": "hello", "logprobs": 99}, "logprobs"),
       ({"prompt": ""}, "prompt"), ({"prompt": [1, -4]}, "prompt"), ({"prompt": [[]]}, "prompt"),
       ({"prompt": {"text": "x"}}, "prompt"), ({}, "prompt"), ({"prompt": "hello", "stream": "yes"}, "stream"),
       ({"prompt": "hello", "presence_penalty": 0.5}, "presence_penalty"),
       ({"prompt": "hello " * 200, "max_tokens": 4}, "prompt"), ({"prompt": "hello", "max_tokens": 200}, "max_tokens"),
       ({"prompt": "hello", "stream_options": {"include_usage": True}}, "stream_options")]
BAD_CHAT = [({"messages": []}, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
            ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
            ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools")]


@pytest.mark.parametrize("body,param", BAD)
def test_a_bad_completion_field_is_a_400_naming_it(server, body, param):
    assert error_of(raw(server.url, "POST", "/v1/completions", body)) == (400, param)


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_a_bad_chat_field_is_a_400_naming_it(server, body, param):
    assert error_of(raw(server.url, "POST", "/v1/chat/completions", body)) == (400, param)


def test_what_is_not_json_or_not_there(server):
    assert error_of(raw(server.url, "POST", "/v1/completions", b"{not json"))[0] == 400
    assert error_of(raw(server.url, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000))[0] == 400
    assert error_of(raw(server.url, "POST", "/v1/completions", [1, 2]))[0] == 400
    assert error_of(raw(server.url, "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"))[0] \
        == 400
    assert error_of(raw(server.url, "GET", "/v1/no-such-route")) == (404, None)
    assert error_of(raw(server.url, "GET", "/v1/completions"))[0] == 405
    assert error_of(raw(server.url, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})) == (404, "model")
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_an_api_key_is_needed_where_one_is_set(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    assert error_of(raw(guarded.url, "GET", "/v1/models"))[0] == 401
    assert error_of(raw(guarded.url, "POST", "/tokenize", {"prompt": "hi"}))[0] == 401
    assert raw(guarded.url, "GET", "/health")[0] == 200  # health and metrics are open
    assert guarded.client(api_key=KEY).models.list().data
    def counted(line: str) -> bool:  # (a request is counted once its answer is out)
        return line in urllib.request.urlopen(guarded.url + "/metrics").read().decode()
    wait_for(lambda: counted('flexh2o_requests_total{route="(no route)",status="401"}'), "the 401 counted")
    wait_for(lambda: counted('flexh2o_requests_total{route="/v1/models",status="200"}'), "the 200 counted")


def test_a_body_over_the_limit_is_a_413(guarded):
    """Declared (Content-Length) or found while it is read (chunked, no length)."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    assert error_of(raw(guarded.url, "POST", "/v1/completions", {"prompt": "hello " * 500}, headers))[0] == 413
    parts = urllib.parse.urlsplit(guarded.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = json.dumps({"prompt": "hello " * 500}).encode()
    connection.request("POST", "/v1/completions", iter([body[:1000], body[1000:]]), headers, encode_chunked=True)
    answer = connection.getresponse()
    assert answer.status == 413 and json.loads(answer.read())["error"]["code"] == "request_too_large"
    connection.close()
    with pytest.raises(openai.APIStatusError) as caught:
        guarded.client(api_key=KEY).completions.create(model="x", prompt="hello " * 500)
    assert caught.value.status_code == 413


def test_a_full_queue_is_a_429_and_a_request_larger_than_it_a_400(guarded, monkeypatch):
    """The engine held at its first token: two waiting sequences fill the queue; the third is refused."""
    from flexh2o.server.online import OnlineChoice
    client, loop = guarded.client(api_key=KEY), guarded.service.loop
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=guarded.service.state.ctx.model, prompt="hello", n=3)
    held, go = threading.Event(), threading.Event()
    token = OnlineChoice.token

    def holding(tag, request, t):
        held.set()
        go.wait(60)
        token(tag, request, t)
    monkeypatch.setattr(OnlineChoice, "token", holding)
    model = guarded.service.state.ctx.model
    answers = []
    asks = [threading.Thread(target=lambda: answers.append(client.completions.create(
        model=model, prompt="hello", max_tokens=2, temperature=0))) for _ in range(3)]
    asks[0].start()
    assert held.wait(60)
    for t in asks[1:]:
        t.start()
    wait_for(lambda: loop.waiting() == 2, "two sequences to wait")
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=model, prompt="hello", max_tokens=2)
    go.set()
    for t in asks:
        t.join(60)
    assert len(answers) == 3


def test_a_server_that_is_stopping_answers_503(server):
    state = server.service.state
    state.status = "stopping"
    try:
        assert error_of(raw(server.url, "POST", "/v1/completions", {"prompt": "hello"}))[0] == 503
        assert raw(server.url, "GET", "/health") == (503, {"status": "stopping"})
        with pytest.raises(openai.InternalServerError) as caught:
            server.client().completions.create(model=server.service.state.ctx.model, prompt="hello")
        assert caught.value.status_code == 503
    finally:
        state.status = "ready"
    assert raw(server.url, "GET", "/health") == (200, {"status": "ready"})


def test_no_body_makes_a_traceback(server, capfd):
    """Every field of both routes given every kind of JSON value: each answer is a 200 or an error in
    OpenAI's shape below 500, and nothing is printed but the request lines."""
    kinds = [None, True, -1, 0, 3, 2 ** 70, 1e308, float("nan"), "", "x" * 300, [], [1, 2], [[1]], ["a"], {}, {"a": 1}]
    fields = {"/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
                                  "stop", "stream", "stream_options", "logprobs", "echo", "best_of", "suffix"],
              "/v1/chat/completions": ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                       "response_format", "tool_choice"]}
    base = {"/v1/completions": {"prompt": "hello", "max_tokens": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}}
    for path, names in fields.items():
        for name in names:
            for value in kinds:
                body = json.dumps({**base[path], name: value}, allow_nan=True).encode()
                status, answer = raw(server.url, "POST", path, body)
                assert status in (200, 400, 404), (path, name, value, answer)
                if status != 200:
                    error_of((status, answer))
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err + printed.out
    assert raw(server.url, "GET", "/health")[0] == 200
