"""The server's errors, each answered as OpenAI's error JSON with its HTTP status."""

from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the server refuses: status, the message, the request's field it is about (param),
    and a short code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def queue_full(waiting: int) -> ApiError:
    return ApiError(429, f"the server's queue is full ({waiting} sequences wait for a row; --max-queued): "
                    "retry later", code="queue_full")


def unavailable(why: str) -> ApiError:
    return ApiError(503, why, code="unavailable")
