"""`sicl-fast serve`: the HTTP/JSON calibration server (FastAPI + uvicorn, the `serve` extra).

Importing this package needs nothing beyond sicl_fast itself; `require()` says what to install when the extra is
missing. The server's parts, one job a module:

    settings.py   ServeSettings (caps, auth, bind address, the `serve` flags) and the loopback-only bind rule
    schema.py     request bodies (pydantic, strict: their types and the OpenAPI schema)
    validate.py   bodies -> engine calls (parse, tokenize, caps) before anything is queued
    jobs.py       what a request does on the engine, as a flow of the scheduler (sicl_fast.scheduler, which owns the
                  engine: answers decode together, calibrations step between them; bounded; cancellation; drain)
    metrics.py    Prometheus metrics; the ASGI middleware that counts, times and logs (one line) every request
    app.py        create_app(engine, settings): the application put together from the parts below
    state.py      ServeState: the engine, settings, scheduler, metrics, validator and shutdown of one server
    routes/       one module per concern (info: health, models, metrics; calibration: proxy, calibrate)
    dispatch.py   route -> scheduler: admission, body -> call, the request's flow and waiting for it (disconnect,
                  shutdown)
    body.py       reading a body: JSON only (415), size (413), depth and syntax (400), schema (422)
    errors.py     the JSON error replies, their handlers, and CatchAll (no exception reaches uvicorn)
    auth.py       the API key
    shutdown.py   the drain on SIGTERM / SIGINT (503s, grace period, exit 0)
    overload.py   at most --max-connections requests in progress (the JSON 503 beyond)
    openapi.py    the bodies in the OpenAPI document
    server.py     serve(engine, settings) on uvicorn with the drain (the CLI); ServerThread for tests, embedding
"""
from __future__ import annotations

from ..errors import require as require_module

_NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx", "safetensors")


def require() -> None:
    """Raise MissingExtraError naming the install command when a package of the `serve` extra is missing."""
    for name in _NEEDED:
        require_module(name)
