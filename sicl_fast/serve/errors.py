"""Error replies. Every error is {"error": {"kind", "message", "status", "type", "code", "param"}} with the
X-Request-ID header (type / code / param: the OpenAI error object's fields, so OpenAI clients read it too: code is
the kind), and none reaches uvicorn (which would answer in plain text and drop the keep-alive connection).

    ServeHTTPError   raised by the server's own checks: status, kind (the metrics label), one-line message, headers
    install(app)     the exception handlers: ServeHTTPError; SiclError (the client's input: status and kind from
                     ERROR_KINDS); Starlette's HTTP errors (404, 405); FastAPI's request validation (422)
    CatchAll         ASGI middleware: any other exception is a JSON 500 naming the request id (the details go to the
                     log) and the server keeps serving, on the same connection
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextLengthError, NumericalError, SiclError, TextError
from .metrics import note
from .schema import validation_message
from .validate import LimitError

log = logging.getLogger("sicl_fast.serve")

# SiclError subclass -> (error kind, HTTP status), first match wins: all are the client's input. Text that is not
# valid Unicode is a malformed body (400, as bad JSON is); every other SiclError is a request the server
# understood and refuses (422)
ERROR_KINDS: tuple[tuple[type, str, int], ...] = (
    (TextError, "bad_text", 400),
    (LimitError, "limit", 422),
    (ContextLengthError, "context_length", 422),
    (NumericalError, "numerical", 422),
    (SiclError, "invalid_request", 422),
)
HTTP_KINDS = {404: "not_found", 405: "method_not_allowed"}
# HTTP status -> the OpenAI error object's `type`
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}


class ServeHTTPError(Exception):
    """An error reply: HTTP status, kind (the metrics label), a one-line message, extra headers."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


def error_response(request: Request, exc: ServeHTTPError) -> JSONResponse:
    """The JSON reply of an error; counted in sicl_fast_errors_total and noted on the request's log line."""
    request.app.state.serve.metrics.errors.labels(exc.kind).inc()
    note(request, error=exc.kind)
    return JSONResponse({"error": {"kind": exc.kind, "message": exc.message, "status": exc.status,
                                   "type": OPENAI_TYPES.get(exc.status, "server_error"), "code": exc.kind,
                                   "param": None}},
                        status_code=exc.status, headers=exc.headers)


def internal_error(request: Request, exc: BaseException) -> ServeHTTPError:
    """The 500 for a bug: its type and the request id, never its message or traceback (those go to the log)."""
    rid = request.scope.get("state", {}).get("request_id")
    return ServeHTTPError(500, "internal", f"internal error ({type(exc).__name__}); the server is still running; the "
                                          f"server log has the details (request id {rid})")


async def _serve_error(request: Request, exc: ServeHTTPError) -> JSONResponse:
    return error_response(request, exc)


def from_sicl_error(exc: SiclError, status: int | None = None) -> ServeHTTPError:
    """The reply to a SiclError: its kind and status from ERROR_KINDS (or the given status)."""
    kind, default = next((k, s) for cls, k, s in ERROR_KINDS if isinstance(exc, cls))
    return ServeHTTPError(status or default, kind, str(exc))


async def _sicl_error(request: Request, exc: SiclError) -> JSONResponse:
    return error_response(request, from_sicl_error(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = HTTP_KINDS.get(exc.status_code, "http")
    return error_response(request, ServeHTTPError(exc.status_code, kind, f"{request.method} {request.url.path}: "
                                                                         f"{exc.detail}", exc.headers))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(request, ServeHTTPError(422, "invalid_request", validation_message(exc, exc.body)))


def install(app: FastAPI) -> None:
    """Register the handlers of every error a route may raise on purpose."""
    app.add_exception_handler(ServeHTTPError, _serve_error)
    app.add_exception_handler(SiclError, _sicl_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


class CatchAll:
    """ASGI middleware: an exception that no handler took becomes the JSON 500 (and is logged); a request task
    cancelled by uvicorn at shutdown gets the JSON 503. Nothing escapes to uvicorn, so the connection stays open."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except (Exception, asyncio.CancelledError) as exc:
            request = Request(scope)
            if isinstance(exc, asyncio.CancelledError):
                err = ServeHTTPError(503, "shutting_down", "the server shut down before this request was answered",
                                     {"Connection": "close"})
            else:
                log.error("internal error in %s %s", request.method, request.url.path, exc_info=exc)
                err = internal_error(request, exc)
            if not started:  # else the reply is half sent and the connection cannot carry another one
                await error_response(request, err)(scope, receive, send)
