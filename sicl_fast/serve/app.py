"""create_app(engine, settings): the FastAPI application (routes, auth, body reading, error replies).

Every error reply is {"error": {"kind", "message", "status"}} with the X-Request-ID header; messages name the
request id and the field as the CLI's do. Bad input is a 4xx; only a bug inside a job is a 500, and the server
keeps running after it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import SiclError
from ..models.loading import describe
from .jobs import run_calibrate, run_proxy
from .metrics import RequestMetrics, ServeMetrics
from .queue import Cancelled, EngineQueue, Job, QueueFull
from .schema import CalibrateBody, ProxyBody, validation_message
from .settings import ServeSettings
from .validate import Validator, error_status

log = logging.getLogger("sicl_fast.serve")

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there


class ServeHTTPError(Exception):
    """An error reply: HTTP status, kind (the metrics label), a one-line message, extra headers."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def create_app(engine, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    queue = EngineQueue(settings.max_queue)
    metrics = ServeMetrics(queue)
    queue.on_finish = lambda job: metrics.job_finished(job, job.kind)
    validator = Validator(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(queue.close)

    app = FastAPI(title="sicl_fast", version=__version__, lifespan=lifespan,
                  description="Test-time calibration of few-shot prompts (self-improving in-context learning). "
                              f"Model: {engine.lm.name}. One engine; requests queue and run one at a time.")
    app.state.queue, app.state.metrics, app.state.settings, app.state.engine = queue, metrics, settings, engine
    app.add_middleware(RequestMetrics, metrics=metrics)

    # --- errors ---
    def error_reply(status: int, kind: str, message: str, headers=None) -> JSONResponse:
        metrics.errors.labels(kind).inc()
        return JSONResponse({"error": {"kind": kind, "message": message, "status": status}}, status_code=status,
                            headers=headers)

    @app.exception_handler(ServeHTTPError)
    async def _serve_error(request: Request, exc: ServeHTTPError):
        return error_reply(exc.status, exc.kind, exc.message, exc.headers)

    @app.exception_handler(SiclError)
    async def _sicl_error(request: Request, exc: SiclError):
        return error_reply(*error_status(exc), str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
        return error_reply(exc.status_code, kind, f"{request.method} {request.url.path}: {exc.detail}",
                           getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("internal error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_reply(500, "internal", internal_message(request, exc))

    def internal_message(request: Request, exc: BaseException) -> str:
        return (f"internal error ({type(exc).__name__}); the server is still running; the server log has the "
                f"details (request id {request.state.request_id})")

    # --- auth ---
    bearer = HTTPBearer(auto_error=False, description="the server's API key (--api-key / SICL_FAST_API_KEY)")

    async def auth(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        key = settings.api_key
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), key.encode()):
            raise ServeHTTPError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 {"WWW-Authenticate": "Bearer"})

    guarded = [Depends(auth)] if settings.api_key else []

    # --- bodies and jobs ---
    async def read_body(request: Request, model: type[BaseModel]) -> Any:
        """The JSON body, at most max_body_bytes (checked on Content-Length and while streaming), as `model`."""
        limit = settings.max_body_bytes
        too_large = ServeHTTPError(413, "body_too_large", f"the request body exceeds this server's limit of {limit} "
                                                          "bytes (--max-body-bytes)")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        try:
            obj = json.loads(b"".join(chunks), parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ServeHTTPError(400, "bad_json", f"body: invalid JSON: {exc}") from None
        if isinstance(obj, dict) and isinstance(obj.get("request"), dict):
            obj["request"].setdefault("id", request.state.request_id)
        try:
            return model.model_validate(obj)
        except ValidationError as exc:
            raise ServeHTTPError(422, "invalid_request", validation_message(exc, obj)) from None

    def admit(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except QueueFull as exc:
            raise ServeHTTPError(429, "queue_full", str(exc), {"Retry-After": str(exc.retry_after)}) from None

    async def read_call(request: Request, model: type[BaseModel], to_call: Callable[[Any], Any]) -> Any:
        """Admission (429 before any work), the body, then parsing and tokenizing on a worker thread (a 1 MiB
        prompt takes about a second to tokenize; the event loop keeps serving meanwhile)."""
        admit(queue.admit)
        body = await read_body(request, model)
        return await asyncio.to_thread(to_call, body)

    async def run_job(request: Request, kind: str, fn: Callable[[Job], Any], deadline: float | None = None):
        """Queue fn on the engine and wait for it; a client that disconnects cancels it. -> (result, job)"""
        job = admit(lambda: queue.submit(fn, deadline, kind))
        fut = asyncio.wrap_future(job.future)
        try:
            while not (await asyncio.wait({fut}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    raise ServeHTTPError(499, "cancelled", "the client disconnected; its job was cancelled")
        except (ServeHTTPError, asyncio.CancelledError):
            job.cancel()  # the worker skips it, or stops it at its next step
            fut.cancel()  # nobody will read its outcome
            raise
        try:
            return fut.result(), job
        except Cancelled:
            raise ServeHTTPError(499, "cancelled", "the job was cancelled") from None
        except SiclError:
            raise
        except Exception as exc:  # a bug inside the job: log it, answer 500, keep serving
            log.error("internal error in job %s (%s)", request.state.request_id, kind, exc_info=exc)
            raise ServeHTTPError(500, "internal", internal_message(request, exc)) from None

    def timing(job: Job) -> dict:
        return {"queue_s": round(job.queue_seconds, 6), "engine_s": round((job.finished or 0) - (job.started or 0), 6)}

    def body_doc(model: type[BaseModel]) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    # --- routes ---
    @app.get("/health", tags=["server"])
    async def health() -> dict:
        """Liveness: no key needed."""
        return {"status": "ok", "model": engine.lm.name, "queue_depth": queue.depth, "busy": queue.busy}

    @app.get("/v1/models", tags=["server"], dependencies=guarded)
    async def models() -> dict:
        """The loaded model, its backend and the calibration preset this server starts from."""
        info = {"id": engine.lm.name, **describe(engine.lm), "backend": engine.backend.name,
                "preset": dataclasses.asdict(validator.preset)}
        return {"object": "list", "data": [info]}

    @app.get("/metrics", tags=["server"], dependencies=guarded)
    async def prometheus() -> Response:
        """Prometheus text format."""
        data, ctype = metrics.render()
        return Response(content=data, media_type=ctype)

    @app.post("/v1/proxy", tags=["calibration"], dependencies=guarded, openapi_extra=body_doc(ProxyBody))
    async def proxy(request: Request) -> dict:
        """f, C, R, G, the per-demonstration c and the token spans of a prompt's own embeddings."""
        call = await read_call(request, ProxyBody, validator.proxy)
        out, job = await run_job(request, "proxy", lambda job: run_proxy(engine, call, job))
        return {**out, "timing": timing(job)}

    @app.post("/v1/calibrate", tags=["calibration"], dependencies=guarded, openapi_extra=body_doc(CalibrateBody))
    async def calibrate(request: Request) -> dict:
        """The ascent on one prompt: summary, history, effective config; with `generate` both greedy answers;
        with `return_embeddings` the calibrated rows (base64). `timeout_s`: return the best X by then."""
        call = await read_call(request, CalibrateBody, validator.calibrate)
        deadline = time.monotonic() + call.timeout_s if call.timeout_s is not None else None

        def work(job: Job) -> dict:
            out = run_calibrate(engine, call, job, on_step=lambda step, f: metrics.steps.inc())
            metrics.calibration_done(out["summary"]["steps"], out["summary"]["seconds"])
            return out

        out, job = await run_job(request, "calibrate", work, deadline)
        return {**out, "timing": timing(job)}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(ProxyBody, "validation"), (CalibrateBody, "validation")],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
