"""create_app(engine, settings): the FastAPI application, put together from its parts.

A request passes, outermost first: RequestMetrics (request id, counts, latency, its log line), CatchAll (no
exception reaches uvicorn), LimitConcurrency (503 beyond --max-connections), RefuseWhileDraining (503 at
shutdown), the key check of guarded routers (auth.py), the
exception handlers (errors.py), then its route (routes/). A new concern is a module under routes/ listed in ROUTES.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts

from . import errors, openapi
from .auth import key_dependencies
from .metrics import RequestMetrics
from .overload import LimitConcurrency
from .routes import calibration, chat, info
from .settings import ServeSettings
from .shutdown import RefuseWhileDraining
from .state import ServeState

ROUTES = (info, calibration, chat)  # modules with `router` (behind the key), `BODIES` and maybe `public` (no key)
CLOSE_WAIT_S = 30.0  # at exit without a drain, how long to wait for the work in flight to stop at its next step


def lifespan(state: ServeState):
    @asynccontextmanager
    async def run(app: FastAPI):
        yield
        # after a drain, work still in flight is past the grace period: do not wait for it (serve() then exits without
        # finalizing); an idle scheduler is always joined, as it ends at once (Scheduler.ended says why it must)
        past_grace = state.shutdown.draining and state.scheduler.busy
        await asyncio.to_thread(state.scheduler.close, 0.0 if past_grace else CLOSE_WAIT_S)

    return run


def package_version() -> str:
    """sicl-fast's version as installed (pyproject.toml's, as sicl_fast.__version__): read from the install, not from
    the package's __init__, the top floor, which only hands names on and imports the engine."""
    try:
        return importlib.metadata.version("sicl-fast")
    except importlib.metadata.PackageNotFoundError:  # a tree run without an install
        return "unknown (not installed)"


def create_app(engine, settings: ServeSettings | None = None) -> FastAPI:
    state = ServeState.build(engine, settings or ServeSettings())
    app = FastAPI(title="sicl_fast", version=package_version(), lifespan=lifespan(state),
                  description="Test-time calibration of few-shot prompts (self-improving in-context learning). "
                              f"Model: {engine.lm.name}. One engine, owned by a scheduler: answers decode together, "
                              "calibrations step between them.")
    app.state.serve = state
    guarded = key_dependencies(state.settings.api_key)
    for module in ROUTES:
        if hasattr(module, "public"):
            app.include_router(module.public)
        app.include_router(module.router, dependencies=guarded)
    errors.install(app)
    # add_middleware puts each one outside those added before it
    app.add_middleware(RefuseWhileDraining)
    app.add_middleware(LimitConcurrency, limit=state.settings.max_connections)
    app.add_middleware(errors.CatchAll)
    paths = frozenset(r.path for r in iter_route_contexts(app.routes))
    app.add_middleware(RequestMetrics, metrics=state.metrics, endpoints=paths)
    openapi.install(app, [body for module in ROUTES for body in module.BODIES])
    return app
