"""The response bodies of /v1/completions and /v1/chat/completions, whole and as stream chunks, in
OpenAI's shapes: choices (a prompt's n choices side by side, index prompt x n + choice), their
log-probabilities, usage."""

import secrets
import time
from dataclasses import dataclass, field


@dataclass
class Choice:
    """One choice as it ended."""
    index: int
    text: str
    finish_reason: str
    tokens: list                  # the token ids it generated (an ending EOS included)
    token_scores: list = field(default_factory=list)  # logprobs.scores' entries of those tokens
    prompt: list | None = None    # echo: the prompt's token ids, its text and scores
    prompt_text: str = ""
    prompt_scores: list = field(default_factory=list)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, choice: Choice, offset: int = 0) -> dict:
    """The legacy completions' logprobs object: per token (the prompt's first, with echo), its text,
    log-probability (None for the prompt's first token), likeliest alternatives and text offset."""
    tokens, logprobs, tops = [], [], []
    entries = [(t, None) for t in (choice.prompt or [])[:1]] + list(zip((choice.prompt or [])[1:],
                                                                         choice.prompt_scores))
    entries += list(zip(choice.tokens, choice.token_scores))
    offsets = []
    for token, score in entries:
        text = token_text(tokenizer, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        logprobs.append(None if score is None else score[0])
        tops.append(None if score is None else {token_text(tokenizer, t): lp for t, lp in score[1]})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, tokens: list, scores: list) -> dict:
    def entry(token, logprob):
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                        for token, (logprob, top) in zip(tokens, scores)]}


def completion_body(rid: str, model: str, choices: list, tokenizer, logprobs: bool, echo: bool,
                    prompt_tokens: int) -> dict:
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        text = (c.prompt_text if echo else "") + c.text
        out.append({"index": c.index, "text": text, "finish_reason": c.finish_reason,
                    "logprobs": completion_logprobs(tokenizer, c) if logprobs else None})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": out,
            "usage": usage(prompt_tokens, sum(len(c.tokens) for c in choices))}


def chat_body(rid: str, model: str, choices: list, tokenizer, logprobs: bool, prompt_tokens: int) -> dict:
    out = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
            "logprobs": chat_logprobs(tokenizer, c.tokens, c.token_scores) if logprobs else None}
           for c in sorted(choices, key=lambda c: c.index)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": out,
            "usage": usage(prompt_tokens, sum(len(c.tokens) for c in choices))}


def chunk(rid: str, model: str, chat: bool, index: int, text: str | None, finish_reason: str | None = None,
          logprobs: dict | None = None, role: bool = False) -> dict:
    """A stream chunk of one choice: its new text (chat: a delta, the first also naming the role)."""
    if chat:
        delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
