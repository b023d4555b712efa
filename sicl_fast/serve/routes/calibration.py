"""The calibration endpoints: the proxy of a prompt, and the ascent (with answers and calibrated rows)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..dispatch import read_call, run_job, timing
from ..jobs import calibrate_flow, proxy_flow, refuse_early
from ..metrics import note
from ..openapi import body_doc
from ..schema import CalibrateBody, ProxyBody
from ..state import ServeState, serve_state

router = APIRouter(tags=["calibration"])
BODIES = (ProxyBody, CalibrateBody)


@router.post("/v1/proxy", openapi_extra=body_doc(ProxyBody))
async def proxy(request: Request, state: ServeState = Depends(serve_state)) -> dict:
    """f, C, R, G, the per-demonstration c and the token spans of a prompt's own embeddings."""
    call = await read_call(request, ProxyBody, state.validator.proxy)
    note(request, id=call.prompt.id)
    out, ticket = await run_job(request, "proxy", proxy_flow(call))
    note(request, proxy=out["proxy"])
    return {**out, "timing": timing(ticket)}


@router.post("/v1/calibrate", openapi_extra=body_doc(CalibrateBody))
async def calibrate(request: Request, state: ServeState = Depends(serve_state)) -> dict:
    """The ascent on one prompt: summary, history, effective config; with `generate` both greedy answers;
    with `return_embeddings` the calibrated rows (base64). `timeout_s`: return the best X by then."""
    call = await read_call(request, CalibrateBody,
                           lambda body: refuse_early(state.scheduler, state.validator.calibrate(body)))
    note(request, id=call.prompt.id)
    deadline = time.monotonic() + call.timeout_s if call.timeout_s is not None else None
    metrics = state.metrics
    flow = calibrate_flow(state.engine, call, on_step=lambda step, f: metrics.steps.inc(),
                          done=lambda res: metrics.calibration_done(res.steps, res.seconds))
    out, ticket = await run_job(request, "calibrate", flow, deadline)
    s = out["summary"]
    note(request, steps=s["steps"], proxy=(s["initial_proxy"], s["best_proxy"]), stop=s["stop_reason"])
    return {**out, "timing": timing(ticket)}
