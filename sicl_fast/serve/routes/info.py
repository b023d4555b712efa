"""About the server: liveness (no key), the loaded model, the Prometheus metrics."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from ...models.loading import describe
from ..state import ServeState, serve_state

public = APIRouter(tags=["server"])
router = APIRouter(tags=["server"])
BODIES = ()


@public.get("/health")
async def health(state: ServeState = Depends(serve_state)) -> dict:
    """Liveness: no key needed."""
    sched = state.scheduler
    return {"status": "ok", "model": state.engine.lm.name, "queue_depth": sched.depth, "busy": sched.busy,
            "in_flight": sched.in_flight}


@router.get("/v1/models")
async def models(state: ServeState = Depends(serve_state)) -> dict:
    """The loaded model, its backend and the calibration preset this server starts from."""
    engine = state.engine
    info = {"id": engine.lm.name, **describe(engine.lm), "backend": engine.backend.name,
            "preset": dataclasses.asdict(state.validator.preset)}
    return {"object": "list", "data": [info]}


@router.get("/metrics")
async def prometheus(state: ServeState = Depends(serve_state)) -> Response:
    """Prometheus text format."""
    data, ctype = state.metrics.render()
    return Response(content=data, media_type=ctype)
