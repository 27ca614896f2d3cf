"""Who may use the server and how much they may send, as ASGI middleware around the app.

- With an API key, every route but /health and /metrics needs `Authorization: Bearer KEY`
  (compared in constant time); a missing or wrong key is a 401.
- A request body is at most `max_body` bytes (an upload to /v1/files at most `max_upload`): a
  declared Content-Length over it is refused at once, and a body that grows past it while it is
  read ends the request with 413. Nothing of it is kept.
- Whatever a handler raises that is not an ApiError is a 500 in OpenAI's shape and one log line,
  never a traceback that reaches the client or the terminal.
- Every request is counted by its route and status (metrics.py) and logged in one line at info
  level once its answer is out (a stream: at its end): method, path, status, seconds, and what the
  route noted (a generation's id and tokens; its prompt only under --log-prompts). A client gone
  before its answer began counts as 499.
"""

import hmac
import json
import logging
import time

from flexh2o.server.errors import ApiError

OPEN_PATHS = ("/health", "/metrics")
UPLOAD_PATH = "/v1/files"
NOTE = "flexh2o.note"  # the scope's key of what a route adds to the request's log line

log = logging.getLogger("flexh2o.serve")


def _header(scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope.get("headers", []) if key.lower() == name), None)


class Access:
    """The middleware: state is the server's (app.py), for its metrics and whether prompts are logged."""

    def __init__(self, app, state, api_key: str | None, max_body: int, max_upload: int):
        self.app, self.state, self.max_body, self.max_upload = app, state, max_body, max_upload
        self.key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, note, status = time.monotonic(), scope.setdefault(NOTE, {}), [None]
        with_prompt = self.state.log_prompts

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def answer(error: ApiError, headers=None):
            note["error"] = error.message
            if status[0] is None:
                await error.response(headers)(scope, receive, tracked_send)
        try:
            await self._checked(scope, receive, tracked_send, answer)
        finally:
            self._record(scope, status[0] or 499, began, note, with_prompt)

    async def _checked(self, scope, receive, send, answer):
        path = scope.get("path", "")
        if self.key is not None and path not in OPEN_PATHS and \
                not hmac.compare_digest(_header(scope, b"authorization") or b"", self.key):
            return await answer(ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer "
                                              "KEY' with the key the server was started with (--api-key)",
                                         code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        limit = self.max_upload if path == UPLOAD_PATH else self.max_body
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await answer(too_large(limit))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)
            return message
        try:
            await self.app(scope, limited_receive, send)
        except ApiError as e:
            await answer(e)
        except Exception as e:  # noqa: BLE001 - a fault of the server's, not the client's: one line, a 500
            log.error("error: %s %s failed: %s: %s", scope.get("method"), path, type(e).__name__, e)
            await answer(ApiError(500, f"the server failed on this request ({type(e).__name__})",
                                  code="internal_error"))

    def _record(self, scope, status: int, began: float, note: dict, with_prompt: bool):
        """The request counted by its route and status, and its log line."""
        route = scope.get("route")
        self.state.metrics.answered(route.path if route is not None else "(no route)", status)
        if not with_prompt:
            note.pop("prompt", None)
        words = " ".join(f"{k}={v if isinstance(v, (int, float)) else json.dumps(v, ensure_ascii=False)}"
                         for k, v in note.items())
        log.info("%s", f"{scope.get('method')} {scope.get('path')} {status} {time.monotonic() - began:.3f}s "
                       f"{words}".rstrip())


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes; --max-body-size, "
                         f"--max-upload-size for /v1/files)", code="request_too_large")
