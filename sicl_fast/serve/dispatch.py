"""From a route to the engine and back: admission, the body turned into an engine call, the job on the queue, and
waiting for it while watching the client and the shutdown. Every failure is a ServeHTTPError:

    415 / 413 / 400 / 422   the body (body.py)       429   the queue is full (Retry-After)
    499   the client went away, or its job was cancelled    503   the server is shutting down (shutdown.py)
    500   a bug inside a job (logged; the server keeps serving)
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any
from collections.abc import Callable

from fastapi import Request
from pydantic import BaseModel

from ..errors import SiclError
from .body import check_content_type, read_body
from .errors import ServeHTTPError, internal_error
from .queue import Cancelled, Job, QueueFull, ShuttingDown
from .shutdown import DROPPED, REFUSED
from .state import ServeState, serve_state

log = logging.getLogger("sicl_fast.serve")

POLL_S = 0.1  # how often a waiting request checks its client and the shutdown


def admit(state: ServeState, check: Callable[[], Any]) -> Any:
    """check() (the queue's admit or submit) with QueueFull as the 429 and ShuttingDown as the 503."""
    try:
        return check()
    except QueueFull as exc:
        raise ServeHTTPError(429, "queue_full", str(exc), {"Retry-After": str(exc.retry_after)}) from None
    except ShuttingDown:
        raise state.shutdown.error(REFUSED) from None


async def read_call(request: Request, model: type[BaseModel], to_call: Callable[[Any], Any]) -> Any:
    """The content type, admission (429 before any work), the body, then `to_call(body)` (parsing and tokenizing) on
    a worker thread: a 1 MiB prompt takes about a second to tokenize, and the event loop keeps serving meanwhile."""
    state = serve_state(request)
    check_content_type(request)
    admit(state, state.queue.admit)
    body = await read_body(request, model, state.settings.max_body_bytes)
    return await asyncio.to_thread(to_call, body)


async def run_job(request: Request, kind: str, fn: Callable[[Job], Any], deadline: float | None = None):
    """Queue fn on the engine and wait for it. A client that disconnects cancels it; so does the end of the grace
    period at shutdown. -> (result, job)"""
    state = serve_state(request)
    job = admit(state, lambda: state.queue.submit(fn, deadline, kind))
    fut = asyncio.wrap_future(job.future)
    try:
        await _wait(request, state, fut)
    except (ServeHTTPError, asyncio.CancelledError):
        job.cancel()  # the worker skips it, or stops it at its next step
        fut.cancel()  # nobody will read its outcome
        raise
    try:
        return fut.result(), job
    except Cancelled:
        raise ServeHTTPError(499, "cancelled", "the job was cancelled") from None
    except ShuttingDown:
        raise state.shutdown.error(DROPPED) from None
    except SiclError:
        raise
    except Exception as exc:  # a bug inside the job: log it, answer 500, keep serving
        log.error("internal error in job %s (%s)", request.state.request_id, kind, exc_info=exc)
        raise internal_error(request, exc) from None


async def _wait(request: Request, state: ServeState, fut: asyncio.Future) -> None:
    while not (await asyncio.wait({fut}, timeout=POLL_S))[0]:
        if await request.is_disconnected():
            raise ServeHTTPError(499, "cancelled", "the client disconnected; its job was cancelled")
        if state.shutdown.expired():
            raise state.shutdown.too_late()


def timing(job: Job) -> dict:
    """The reply's `timing`: seconds waiting for the engine and holding it."""
    return {"queue_s": round(job.queue_seconds, 6), "engine_s": round((job.finished or 0) - (job.started or 0), 6)}
