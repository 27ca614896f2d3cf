"""A load test of its own, bounded in requests and time and on loopback only: 16 concurrent clients
send 96 requests (streamed and not, chat and completions) to a server whose cache lies partly on
disk; no error, no request lost, each answer what the same request gets alone; and once the server
stops, no thread, no open file and no offload file is left."""

import asyncio
import os
import threading

import openai
from tqdm._monitor import TMonitor

from serving import POSITIONS, Running, word_llama  # noqa: F401 - a fixture
from test_openai_client import PROMPTS

CLIENTS, REQUESTS = 16, 96


def ask(n: int) -> dict:
    prompt = PROMPTS[n % len(PROMPTS)]
    settings = {"max_tokens": 3 + n % 11, "temperature": 0 if n % 3 else 0.8, "seed": n}
    if n % 2:
        return {"chat": True, "messages": [{"role": "user", "content": prompt}], **settings}
    return {"chat": False, "prompt": prompt, **settings}


async def send(client, model: str, request: dict, stream: bool) -> str:
    request = dict(request)
    if request.pop("chat"):
        if stream:
            parts = await client.chat.completions.create(model=model, stream=True, **request)
            return "".join([c.choices[0].delta.content or "" async for c in parts if c.choices])
        return (await client.chat.completions.create(model=model, **request)).choices[0].message.content
    if stream:
        parts = await client.completions.create(model=model, stream=True, **request)
        return "".join([c.choices[0].text async for c in parts if c.choices])
    return (await client.completions.create(model=model, **request)).choices[0].text


async def load(url: str, model: str) -> list:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    todo, out = list(range(REQUESTS)), [None] * REQUESTS

    async def worker():
        while todo:
            n = todo.pop()
            out[n] = await send(client, model, ask(n), stream=n % 4 == 0)
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), timeout=300)
    await client.close()
    return out


def open_files() -> set:
    return set(os.listdir(f"/proc/{os.getpid()}/fd"))


def test_concurrent_clients_lose_nothing_and_the_server_leaves_nothing(word_llama, tmp_path):  # noqa: F811
    threads, files = set(threading.enumerate()), open_files()
    offload = tmp_path / "offload"
    server = Running(["--model", word_llama, "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--max-model-len",
                      str(POSITIONS), "--dtype", "float32", "--cache", "gpu=50,cpu=25,disk=25", "--offload-dir",
                      str(offload)])
    try:
        model = server.service.state.ctx.model
        got = asyncio.run(load(server.url, model))
        assert None not in got and len(got) == REQUESTS
        with server.client() as client:
            for n in range(0, REQUESTS, 7):  # alone, one after another
                request = dict(ask(n))
                if request.pop("chat"):
                    assert client.chat.completions.create(model=model, **request).choices[0].message.content == got[n]
                else:
                    assert client.completions.create(model=model, **request).choices[0].text == got[n]
        assert os.listdir(offload)  # the cache's disk part
    finally:
        assert server.stop() == 0
    left = [t for t in threading.enumerate() if t not in threads and t.is_alive() and not isinstance(t, TMonitor)]
    assert not left  # (tqdm's monitor is the process's, started by the first progress bar)
    left_open = {fd: os.readlink(f"/proc/{os.getpid()}/fd/{fd}") for fd in open_files() - files
                 if os.path.exists(f"/proc/{os.getpid()}/fd/{fd}")}
    assert not left_open
    assert all(not os.listdir(os.path.join(offload, d)) for d in os.listdir(offload)) if offload.exists() else True
