"""`sicl-fast serve`: the HTTP/JSON calibration server (FastAPI + uvicorn, the `serve` extra).

Importing this package needs nothing beyond sicl_fast itself; `require()` says what to install when the extra is
missing. The server's parts, one job a module:

    settings.py   ServeSettings (caps, auth, bind address, the `serve` flags) and the loopback-only bind rule
    schema.py     request bodies (pydantic, strict: their types and the OpenAPI schema)
    validate.py   bodies -> engine calls (parse, tokenize, caps) before anything is queued
    queue.py      EngineQueue: one worker thread runs jobs on the engine one at a time; bounded; cancellation
    jobs.py       what a job does on the engine: proxy, calibrate (deadline / cancel hook), answers, embeddings
    metrics.py    Prometheus metrics and the ASGI middleware that counts and times every request
    app.py        create_app(engine, settings): routes, auth, body reading, error replies
    server.py     serve(engine, settings) on uvicorn (the CLI); ServerThread for tests, benchmarks, embedding
"""
from __future__ import annotations

from ..errors import require as require_module

_NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx", "safetensors")


def require() -> None:
    """Raise MissingExtraError naming the install command when a package of the `serve` extra is missing."""
    for name in _NEEDED:
        require_module(name)
