"""A dataset job's output records, in the input's own convention.

Plain text and JSONL input: `{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens"}`,
or `{"id", "error": {"line", "message"}}` for a bad record kept by --skip-bad. OpenAI Batch input:
the Batch API's output lines, `{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": {... "choices", "usage"}}, "error": null}`, and for a bad record `"response": null` with
the error. Ids made here derive from the record's own id, so a resumed job writes what an
uninterrupted one would.
"""

import hashlib
import time


def given(entry):
    """The record's id as the input gave it: an integer stays an integer."""
    return entry.id if entry.given_id is None else entry.given_id


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class PlainFormat:
    def result(self, entry, request, text, finish_reason, prompt_tokens, completion_tokens) -> dict:
        return {"id": given(entry), "text": text, "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens}

    def error(self, entry) -> dict:
        return {"id": given(entry), "error": {"line": entry.line, "message": entry.error}}


class OpenAIFormat:
    def __init__(self, model: str):
        self.model = model

    def result(self, entry, request, text, finish_reason, prompt_tokens, completion_tokens) -> dict:
        chat = request.messages is not None
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        body = {"id": ("chatcmpl-" if chat else "cmpl-") + short_hash(entry.id),
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
        return {"id": "batch_req_" + short_hash(entry.id), "custom_id": given(entry),
                "response": {"status_code": 200, "request_id": short_hash("request:" + entry.id), "body": body},
                "error": None}

    def error(self, entry) -> dict:
        return {"id": "batch_req_" + short_hash(entry.id), "custom_id": given(entry), "response": None,
                "error": {"code": "invalid_request", "message": f"line {entry.line}: {entry.error}"}}


def formatter_for(input_format: str, model: str):
    return OpenAIFormat(model) if input_format == "openai" else PlainFormat()
