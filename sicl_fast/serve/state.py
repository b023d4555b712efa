"""ServeState: what one server holds (engine, settings, queue, metrics, validator, shutdown), made once by
create_app and reached by every route and middleware as `request.app.state.serve` (or `Depends(serve_state)`)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from .metrics import ServeMetrics
from .queue import EngineQueue
from .settings import ServeSettings
from .shutdown import Shutdown
from .validate import Validator


@dataclass(frozen=True)
class ServeState:
    engine: object
    settings: ServeSettings
    queue: EngineQueue
    metrics: ServeMetrics
    validator: Validator
    shutdown: Shutdown

    @classmethod
    def build(cls, engine, settings: ServeSettings) -> ServeState:
        queue = EngineQueue(settings.max_queue)
        metrics = ServeMetrics(queue)
        queue.on_finish = lambda job: metrics.job_finished(job, job.kind)
        return cls(engine=engine, settings=settings, queue=queue, metrics=metrics,
                   validator=Validator(engine, settings), shutdown=Shutdown(settings.grace_s, queue))


def serve_state(request: Request) -> ServeState:
    """The server's state (a FastAPI dependency, or called with a Request made from an ASGI scope)."""
    return request.app.state.serve
