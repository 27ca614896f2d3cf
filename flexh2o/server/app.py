"""The server's ASGI app: its state, its routes, and every error answered in OpenAI's shape.

Starlette rather than FastAPI: the request bodies are checked by the dataset job's own checks
(openai_requests.py), so FastAPI's models would check every field a second time, with their own
error shape (422) that OpenAI's clients do not expect; Starlette is the routing and ASGI layer
FastAPI itself is built on, and nothing more. uvicorn serves it (service.py).
"""

import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from flexh2o.server.access import Access
from flexh2o.server.batch_routes import batch_routes
from flexh2o.server.errors import ApiError, unavailable
from flexh2o.server.routes import generation_routes


class ServerState:
    """What the routes share: the status (loading, ready, stopping, failed), the parsing context, the
    engine loop, the stores of the Batch API, the metrics."""

    def __init__(self, ctx, eos, metrics, log_prompts: bool = False):
        self.status = "loading"
        self.ctx, self.eos, self.metrics, self.log_prompts = ctx, eos, metrics, log_prompts
        self.engine_tokenizer = ctx.tokenizer.own_copy()  # what the engine thread decodes with
        self.loop = self.files = self.batches = None
        self.created = int(time.time())

    def check_ready(self):
        if self.status != "ready":
            raise unavailable({"loading": "the model is still loading: retry in a moment (GET /health says when it "
                                          "is ready)",
                               "stopping": "the server is shutting down",
                               "failed": "the engine failed; the server is stopping"}[self.status])


def build_app(state: ServerState, api_key: str | None, max_body: int, max_upload: int) -> Starlette:
    async def api_error(request, error: ApiError):
        return error.response()

    async def http_error(request, error: HTTPException):
        what = "route" if error.status_code == 404 else "method for this route"
        return ApiError(error.status_code, f"no such {what}: {request.method} {request.url.path}",
                        code="not_found" if error.status_code == 404 else "method_not_allowed").response()

    handlers = {ApiError: api_error, HTTPException: http_error}  # (any other fault: access.py's 500)
    app = Starlette(routes=generation_routes(state) + batch_routes(state), exception_handlers=handlers,
                    middleware=[Middleware(Access, state=state, api_key=api_key, max_body=max_body,
                                           max_upload=max_upload)])
    app.state.server = state
    return app
