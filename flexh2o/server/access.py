"""Who may use the server and how much they may send, as ASGI middleware around the app.

- With an API key, every route but /health and /metrics needs `Authorization: Bearer KEY`
  (compared in constant time); a missing or wrong key is a 401.
- A request body is at most `max_body` bytes (an upload to /v1/files at most `max_upload`): a
  declared Content-Length over it is refused at once, and a body that grows past it while it is
  read ends the request with 413. Nothing of it is kept.
- Whatever a handler raises that is not an ApiError is a 500 in OpenAI's shape and one log line,
  never a traceback that reaches the client or the terminal.
"""

import hmac
import logging

from flexh2o.server.errors import ApiError

OPEN_PATHS = ("/health", "/metrics")
UPLOAD_PATH = "/v1/files"

log = logging.getLogger("flexh2o.serve")


class BodyTooLarge(Exception):
    pass


def _header(scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope.get("headers", []) if key.lower() == name), None)


class Access:
    def __init__(self, app, api_key: str | None, max_body: int, max_upload: int):
        self.app, self.max_body, self.max_upload = app, max_body, max_upload
        self.key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def answer(error: ApiError, headers=None):
            if not started:
                await error.response(headers)(scope, receive, send)
        path = scope.get("path", "")
        if self.key is not None and path not in OPEN_PATHS and \
                not hmac.compare_digest(_header(scope, b"authorization") or b"", self.key):
            return await answer(ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer "
                                              "KEY' with the key the server was started with (--api-key)",
                                         code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        limit = self.max_upload if path == UPLOAD_PATH else self.max_body
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await answer(_too_large(limit))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge()
            return message
        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            await answer(_too_large(limit))
        except ApiError as e:
            await answer(e)
        except Exception as e:  # noqa: BLE001 - a fault of the server's, not the client's: one line, a 500
            log.error("error: %s %s failed: %s: %s", scope.get("method"), path, type(e).__name__, e)
            await answer(ApiError(500, f"the server failed on this request ({type(e).__name__})",
                                  code="internal_error"))


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes; --max-body-size, "
                         f"--max-upload-size for /v1/files)", code="request_too_large")
