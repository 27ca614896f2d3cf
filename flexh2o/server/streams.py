"""`stream: true`: a request's choices as server-sent events, one chunk per new piece of text, each
choice's last chunk with its finish_reason, then (unless stream_options.include_usage is false)
a chunk of usage, then `data: [DONE]`. A client that goes away cancels its choices."""

import json

from flexh2o.server import responses
from flexh2o.server.online import cancel


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def chunks(gen, requests: list, events, rid: str, model: str, tokenizer, prompt_tokens: int, note: dict):
    """The events of a streamed Generation whose choices are `requests` (queued already); note gets
    the tokens generated."""
    trackers = {request.tag.index: request.tag.tracker for request in requests}
    completion_tokens, ended = 0, False
    try:
        for request in requests:  # chat: the role first; a completion's echo: its prompt first
            tag = request.tag
            if gen.chat:
                yield event(responses.chunk(rid, model, True, tag.index, "", role=True))
            elif gen.echo:
                yield event(responses.chunk(rid, model, False, tag.index, tag.prompt_text))
        left = len(requests)
        while left:
            kind, index, *rest = await events.get()
            if kind == "error":
                yield event({"error": {"message": rest[0], "type": "server_error", "param": None,
                                       "code": "engine_failed"}})
                break
            if kind == "token":
                text, token, score = rest
                logprobs = None
                if score is not None:
                    one = responses.Choice(index, text, "", [token], [score])
                    logprobs = responses.chat_logprobs(tokenizer, [token], [score]) if gen.chat else \
                        responses.completion_logprobs(tokenizer, one)
                if text or logprobs:
                    yield event(responses.chunk(rid, model, gen.chat, index, text, logprobs=logprobs))
                continue
            choice = rest[0]
            completion_tokens += len(choice.tokens)
            note["completion_tokens"] = completion_tokens
            left -= 1
            yield event(responses.chunk(rid, model, gen.chat, index, trackers[index].finish(choice.text),
                                        choice.finish_reason))
        else:
            if gen.include_usage:
                yield event(responses.usage_chunk(rid, model, gen.chat, prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
        ended = True
    finally:
        if not ended:
            note["error"] = "the client went away"
        cancel(requests)
