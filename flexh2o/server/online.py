"""An online request's choices through the engine loop: one slot request per (prompt, choice), their
tokens turned into text on the engine thread and handed to the request's asyncio task as events.

A choice's sampling seed is the request's (the first choice) or derived from it and the choice's
index, so a request with a seed gets the same choices again; without one, each choice draws a
fresh seed. A choice whose client went away (a closed connection, a cancelled request) is
cancelled: its row is free at the next token step.
"""

import asyncio
import hashlib
import secrets

from flexh2o.engine.sampling import Sampler
from flexh2o.engine.slot_request import Request
from flexh2o.jobs.job import cut_at_stop, until_eos
from flexh2o.server.engine_loop import Tag
from flexh2o.server.errors import ApiError
from flexh2o.server.responses import Choice
from flexh2o.server.text import TextTracker

_samplers: dict = {}


def sampler_for(sampling) -> Sampler | None:
    """The Sampler of a request's settings (None: greedy, the pool's own), one per setting."""
    if sampling.temperature == 0:
        return None
    if sampling not in _samplers:
        _samplers[sampling] = Sampler(True, sampling.temperature, sampling.top_k, sampling.top_p, 0)
    return _samplers[sampling]


def choice_seed(seed: int | None, choice: int) -> int:
    if seed is None:
        return secrets.randbits(63)
    if choice == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{choice}".encode()).digest()[:8], "little") >> 1


class OnlineChoice(Tag):
    """One choice of an online request: its events go to `events` (an asyncio.Queue of `loop`):
    ("token", index, text, token, score) as tokens come (streams only), ("done", index, Choice),
    ("error", index, message)."""

    def __init__(self, loop, events, index: int, tokenizer, eos, stops: tuple, stream: bool, prompt: list,
                 prompt_text: str, echo: bool, max_tokens: int):
        super().__init__()
        self.loop, self.events, self.index, self.tokenizer, self.eos = loop, events, index, tokenizer, eos
        self.stops, self.stream, self.prompt, self.prompt_text, self.echo = stops, stream, prompt, prompt_text, echo
        self.max_tokens = max_tokens
        self.tracker = TextTracker(tokenizer, stops)

    def token(self, request, token: int):
        text = self.tracker.add(token)
        if self.stream and self.max_tokens:
            score = request.token_scores[-1] if request.logprobs is not None else None
            self._send(("token", self.index, text, token, score))

    def done(self, request, tokens: list, reason: str):
        if reason == "cancelled":
            return
        tokens = tokens[: self.max_tokens]  # (max_tokens 0: the prompt is only scored)
        new, hit_eos = until_eos(tokens, self.eos)
        text, stopped = cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), self.stops)
        choice = Choice(self.index, text, "stop" if hit_eos or stopped else "length", tokens,
                        request.token_scores[: len(tokens)], self.prompt if self.echo else None, self.prompt_text,
                        request.prompt_scores)
        self._send(("done", self.index, choice))

    def fail(self, message: str):
        self._send(("error", self.index, message))

    def _send(self, event):
        self.post(self.loop, self.events.put_nowait, event)


def choices_of(gen, tokenizer, eos) -> tuple[list, asyncio.Queue]:
    """The slot requests of a Generation's choices, and the queue their events come to."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    sampler, requests = sampler_for(gen.sampling), []
    for p, ids in enumerate(gen.prompts):
        for c in range(gen.n):
            index = p * gen.n + c
            tag = OnlineChoice(loop, events, index, tokenizer, eos, gen.stop, gen.stream, ids,
                               gen.texts[p] if gen.texts else "", gen.echo, gen.max_tokens)
            requests.append(Request(ids, max(gen.max_tokens, 1), choice_seed(gen.seed, c),
                                    (lambda tokens, t=tag.tracker: t.stopped) if gen.stop else None, tag, sampler,
                                    gen.logprobs, gen.logprobs if gen.echo else None))
    return requests, events


async def until_disconnect(receive):
    """Returns once the client has gone away (its connection closed)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def gather(requests: list, events: asyncio.Queue, receive) -> list:
    """Every choice's Choice, in index order; the choices are cancelled if the client goes away (or
    this task is cancelled) first. An engine failure is an ApiError 500."""
    left, out = len(requests), [None] * len(requests)
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        while left:
            getting = asyncio.ensure_future(events.get())
            finished, _ = await asyncio.wait({getting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if getting not in finished:
                getting.cancel()
                raise ClientGone()
            kind, index, value = getting.result()
            if kind == "error":
                raise ApiError(500, value, code="engine_failed")
            if kind == "done":
                out[index], left = value, left - 1
        return out
    finally:
        gone.cancel()
        cancel(requests)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


def cancel(requests: list):
    """Cancels whatever of the requests is still queued or running (a no-op for the ended ones)."""
    for request in requests:
        request.cancelled = True
