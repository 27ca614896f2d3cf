"""The server's routes but the Batch API's (batch_routes.py): health, metrics, models, completions,
chat completions, and the tokenizer routes vLLM's server has (lm-eval's `remote` tokenizer uses
them: a GGUF model needs no tokenizer files on the client's side).

Every route is wrapped by `handled`: an ApiError becomes its JSON answer; what a route notes goes
into the request's log line (access.py).
"""

import json

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flexh2o.common.json_data import BadJson, parse_json
from flexh2o.server import responses
from flexh2o.server.access import NOTE
from flexh2o.server.errors import ApiError, bad_request
from flexh2o.server.online import ClientGone, choices_of, gather
from flexh2o.server.openai_requests import parse
from flexh2o.server.streams import chunks

PROMPT_LOG_CHARS = 500  # of a prompt, logged under --log-prompts


async def read_json(request):
    body = await request.body()
    try:
        return parse_json(body)
    except BadJson as e:
        raise bad_request(f"the request body {e}") from None


def handled(handler):
    """handler(request, note) -> response, as a route: an ApiError answered; note: what the handler
    adds to the request's log line (access.py)."""
    async def route(request):
        try:
            return await handler(request, request.scope.setdefault(NOTE, {}))
        except ApiError as e:
            request.scope[NOTE]["error"] = e.message
            return e.response()
    return route


def generation_routes(state) -> list:
    async def generate(request, note, chat: bool):
        state.check_ready()
        body = await read_json(request)
        gen = await run_in_threadpool(parse, body, chat, state.ctx)
        requests, events = choices_of(gen, state.engine_tokenizer, state.eos)
        prompt_tokens = sum(len(p) for p in gen.prompts)
        rid = responses.new_id(chat)
        note.update(id=rid, prompt_tokens=prompt_tokens, choices=len(requests))
        if state.log_prompts:
            note["prompt"] = (json.dumps(body.get("messages")) if chat else str(body.get("prompt")))[:PROMPT_LOG_CHARS]
        state.loop.submit(requests)
        state.metrics.prompt_tokens.inc(prompt_tokens)
        model = state.ctx.model
        if gen.stream:
            return StreamingResponse(chunks(gen, requests, events, rid, model, state.ctx.tokenizer, prompt_tokens,
                                            note),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            choices = await gather(requests, events, request.receive)
        except ClientGone:
            note["error"] = "the client went away"
            return Response(status_code=499)
        note["completion_tokens"] = sum(len(c.tokens) for c in choices)
        if chat:
            return JSONResponse(responses.chat_body(rid, model, choices, state.ctx.tokenizer, gen.logprobs is not None,
                                                    prompt_tokens))
        return JSONResponse(responses.completion_body(rid, model, choices, state.ctx.tokenizer,
                                                      gen.logprobs is not None, gen.echo, prompt_tokens))

    async def completions(request, note):
        return await generate(request, note, chat=False)

    async def chat_completions(request, note):
        return await generate(request, note, chat=True)

    async def health(request, note):
        return JSONResponse({"status": state.status}, status_code=200 if state.status == "ready" else 503)

    async def metrics(request, note):
        return Response(state.metrics.text(), media_type=state.metrics.content_type)

    def model_card() -> dict:
        return {"id": state.ctx.model, "object": "model", "created": state.created, "owned_by": "flexh2o",
                "max_model_len": state.ctx.max_model_len}

    async def models(request, note):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request, note):
        if request.path_params["model"] != state.ctx.model:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist: this server serves "
                                f"{state.ctx.model!r}", "model", "model_not_found")
        return JSONResponse(model_card())

    async def tokenizer_info(request, note):
        t = state.ctx.tokenizer
        return JSONResponse({"tokenizer_class": type(t._tokenizer).__name__, "eos_token": t.eos_token,
                             "bos_token": t.bos_token, "pad_token": t.pad_token,
                             "chat_template": getattr(t, "chat_template", None),
                             "model_max_length": state.ctx.max_model_len})

    async def tokenize(request, note):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise bad_request("give the text to tokenize as \"prompt\" (a string)", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise bad_request("add_special_tokens must be true or false", "add_special_tokens")
        tokens = await run_in_threadpool(lambda: state.ctx.tokenizer(body["prompt"], add_special_tokens=special)
                                         ["input_ids"])
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.ctx.max_model_len})

    async def detokenize(request, note):
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = state.ctx.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise bad_request(f"give \"tokens\": a list of token ids in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": await run_in_threadpool(state.ctx.tokenizer.decode, tokens)})

    table = [("/health", health, "GET"), ("/metrics", metrics, "GET"), ("/v1/models", models, "GET"),
             ("/v1/models/{model:path}", model, "GET"), ("/v1/completions", completions, "POST"),
             ("/v1/chat/completions", chat_completions, "POST"), ("/tokenizer_info", tokenizer_info, "GET"),
             ("/tokenize", tokenize, "POST"), ("/detokenize", detokenize, "POST")]
    return [Route(path, handled(handler), methods=[method]) for path, handler, method in table]
