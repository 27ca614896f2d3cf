"""The bodies of POST /v1/completions and /v1/chat/completions, checked and tokenized.

The fields a dataset job's records share (max_tokens, temperature, top_p, top_k, seed, stop, the
chat messages and their template) go through the job's own checks (jobs/input.py), so a body is
accepted online exactly where the same body is accepted in a batch. A bad field is a 400 naming
it; a field flexh2o does not act on (tools, penalties, logit_bias...) is refused unless it is
left at its neutral value; fields it does not know are ignored, as OpenAI's SDKs add their own.
"""

from dataclasses import dataclass

from flexh2o.engine.sampling import MAX_SEED
from flexh2o.jobs.input import (BadRecord, Request, chat_messages, check_text, number_field, prompt_ids, sampling,
                                stop_strings)
from flexh2o.server.errors import ApiError, bad_request

MAX_N = 128               # choices per prompt, as OpenAI's API
MAX_LOGPROBS = 20         # likeliest tokens beside each one
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's (chat: the rest of the context)
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "suffix": ("",),
           "tools": ([],), "functions": ([],), "tool_choice": ("none",), "best_of": (1,)}


@dataclass
class Generation:
    """One request as the engine runs it: each prompt's token ids, n choices each."""
    chat: bool
    prompts: list            # token ids per prompt
    texts: list              # each prompt's text (a completion's echo), None for a chat
    n: int
    max_tokens: int          # 0: the prompt scored only (echo)
    sampling: object         # jobs.input.Sampling
    seed: int | None
    stop: tuple
    stream: bool
    include_usage: bool
    logprobs: int | None     # alternatives per token; None: no log-probabilities
    echo: bool


@dataclass
class Context:
    """What parsing needs of the server."""
    tokenizer: object
    model: str               # the name it serves under
    max_model_len: int       # tokens of one sequence, prompt and new
    vocab_size: int


def parse(body, chat: bool, ctx: Context) -> Generation:
    """A request body (parsed JSON) as a Generation, or an ApiError (400, or 404 for another model)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != ctx.model:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {ctx.model!r}", "model",
                       "model_not_found")
    for key, neutral in NEUTRAL.items():
        if body.get(key) is not None and body[key] not in neutral:
            raise bad_request(f"{key} is not supported by flexh2o (give {neutral[0]!r} or leave it out)", key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format")
    try:
        return _parse(body, chat, ctx)
    except BadRecord as e:
        raise bad_request(str(e), e.param) from None


def _parse(body: dict, chat: bool, ctx: Context) -> Generation:
    """The fields checked first, the prompt (tokenizing it) last."""
    n = number_field(body, "n", int, 1, 1, MAX_N)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise BadRecord("stream_options must be an object, and only with stream: true", "stream_options")
    include_usage = flag(options, "include_usage") if options and "include_usage" in options else True
    chosen = sampling(number_field(body, "temperature", float, 1.0, 0.0, 100.0),
                      number_field(body, "top_p", float, 1.0, 0.0, 1.0, low_open=True),
                      number_field(body, "top_k", int, 0, 0, 1 << 31))
    seed = number_field(body, "seed", int, None, 0, MAX_SEED)
    stops = stop_strings(body.get("stop"))
    echo = not chat and flag(body, "echo")
    if chat:
        logprobs = number_field(body, "top_logprobs", int, 0, 0, MAX_LOGPROBS) if flag(body, "logprobs") else None
        if logprobs is None and body.get("top_logprobs") is not None:
            raise BadRecord("top_logprobs needs logprobs: true", "top_logprobs")
        if "max_completion_tokens" in body and "max_tokens" not in body:
            body = dict(body, max_tokens=body["max_completion_tokens"])
    else:
        logprobs = number_field(body, "logprobs", int, None, 0, MAX_LOGPROBS)
    max_tokens = number_field(body, "max_tokens", int, None if chat else COMPLETION_MAX_TOKENS, 0 if echo else 1,
                              1 << 20)
    prompts, texts = ([_chat_prompt(body, ctx)], None) if chat else _completion_prompts(body.get("prompt"), ctx)
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = ctx.max_model_len - longest
    if longest + max(max_tokens, 1) > ctx.max_model_len:
        where = "messages" if chat else "prompt"
        raise BadRecord(f"this server's sequences hold {ctx.max_model_len} tokens (--max-model-len); the request "
                        f"asks {longest + max_tokens} ({longest} in the {where}, {max_tokens} to generate): shorten "
                        f"the {where} or lower max_tokens", where if longest >= ctx.max_model_len else "max_tokens")
    return Generation(chat, prompts, texts, n, max_tokens, chosen, seed, stops, stream, include_usage, logprobs, echo)


def flag(record: dict, key: str) -> bool:
    """record[key]: true or false (absent or null: false)."""
    value = record.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRecord(f"{key} must be true or false, got {value!r}", key)
    return value


def _completion_prompts(prompt, ctx: Context) -> tuple[list, list]:
    """A completion's prompt (a string, a list of strings, token ids or a list of token id lists) as
    token ids per prompt, and each one's text."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRecord("prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
                        "such lists", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    out, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise BadRecord("prompt: a prompt must not be empty", "prompt")
            check_text("prompt", item, "prompt")
            ids = ctx.tokenizer(item)["input_ids"]
            if not ids:
                raise BadRecord("prompt: a prompt gives no tokens", "prompt")
            out.append(ids)
            texts.append(item)
            continue
        if not isinstance(item, list) or not item or \
                not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < ctx.vocab_size for t in item):
            raise BadRecord(f"prompt: token ids must be non-empty lists of integers in [0, {ctx.vocab_size})",
                            "prompt")
        out.append(list(item))
        texts.append(ctx.tokenizer.decode(item))
    return out, texts


def _chat_prompt(body: dict, ctx: Context) -> list:
    """The messages (text content parts joined) through the model's chat template, as token ids."""
    messages = body.get("messages")
    if isinstance(messages, list):
        messages = [_text_message(m) for m in messages]
    request = Request("", None, chat_messages(messages), 1, sampling(0, 1, 0), (), None)
    try:
        ids = prompt_ids(ctx.tokenizer, request, chat=True)
    except BadRecord as e:
        raise BadRecord(str(e), "messages") from None
    if not ids:
        raise BadRecord("messages: the chat template gave no tokens", "messages")
    return ids


def _text_message(message):
    """A message whose content is a list of text parts, as one with their text joined."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise BadRecord("messages: only text content is supported ({\"type\": \"text\", \"text\": ...} parts)",
                        "messages")
    return dict(message, content="".join(p["text"] for p in parts))
