"""At most --max-connections HTTP requests in progress; beyond, the JSON 503 (uvicorn's own limit answers in plain
text). Requests in progress are what holds memory (bodies being read, replies being made); idle keep-alive
connections are closed by uvicorn after 5 s."""
from __future__ import annotations

from fastapi import Request

from .errors import ServeHTTPError, error_response


class LimitConcurrency:
    """ASGI middleware: a request beyond `limit` in progress is answered 503 (kind overloaded, Retry-After: 1)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_progress = 0  # only touched on the event loop

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.limit:
            err = ServeHTTPError(503, "overloaded", f"the server has {self.in_progress} requests in progress, its "
                                                   f"limit (--max-connections {self.limit}); retry after 1 s",
                                 {"Retry-After": "1", "Connection": "close"})
            await error_response(Request(scope, receive), err)(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
