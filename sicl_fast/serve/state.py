"""ServeState: what one server holds (engine, settings, scheduler, metrics, validator, shutdown), made once by
create_app and reached by every route and middleware as `request.app.state.serve` (or `Depends(serve_state)`)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from ..scheduler import Scheduler
from .metrics import ServeMetrics
from .settings import ServeSettings
from .shutdown import Shutdown
from .validate import Validator


@dataclass(frozen=True)
class ServeState:
    engine: object
    settings: ServeSettings
    scheduler: Scheduler
    metrics: ServeMetrics
    validator: Validator
    shutdown: Shutdown

    @classmethod
    def build(cls, engine, settings: ServeSettings) -> ServeState:
        metrics = ServeMetrics()
        scheduler = Scheduler(engine, settings.limits(), observer=metrics, name="sicl-fast-serve-scheduler")
        metrics.watch(scheduler)
        return cls(engine=engine, settings=settings, scheduler=scheduler, metrics=metrics,
                   validator=Validator(engine, settings), shutdown=Shutdown(settings.grace_s, scheduler))


def serve_state(request: Request) -> ServeState:
    """The server's state (a FastAPI dependency, or called with a Request made from an ASGI scope)."""
    return request.app.state.serve
