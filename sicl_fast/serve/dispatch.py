"""From a route to the engine and back: admission, the body turned into an engine call, the request's flow on the
scheduler, and waiting for it while watching the client and the shutdown. Every failure is a ServeHTTPError:

    415 / 413 / 400 / 422   the body (body.py)       429   the queue is full (Retry-After)
    499   the client went away, or its request was cancelled    503   the server is shutting down (shutdown.py)
    500   a bug inside a request (logged; the server keeps serving)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from ..errors import LimitError, SiclError
from ..scheduler import Cancelled, QueueFull, ShuttingDown, Ticket
from .body import check_content_type, read_body
from .errors import ServeHTTPError, from_sicl_error, internal_error
from .shutdown import DROPPED, REFUSED
from .state import ServeState, serve_state

log = logging.getLogger("sicl_fast.serve")

POLL_S = 0.1  # how often a waiting request checks its client and the shutdown


def queue_full(exc: QueueFull) -> ServeHTTPError:
    return ServeHTTPError(429, "queue_full", str(exc), {"Retry-After": str(exc.retry_after)})


def admit(state: ServeState, check: Callable[[], Any]) -> Any:
    """check() (the scheduler's check or submit) with QueueFull as the 429 and ShuttingDown as the 503."""
    try:
        return check()
    except QueueFull as exc:
        raise queue_full(exc) from None
    except ShuttingDown:
        raise state.shutdown.error(REFUSED) from None


async def read_call(request: Request, model: type[BaseModel], to_call: Callable[[Any], Any]) -> Any:
    """The content type, admission (429 before any work), the body, then `to_call(body)` (parsing and tokenizing) on
    a worker thread: a 1 MiB prompt takes about a second to tokenize, and the event loop keeps serving meanwhile."""
    state = serve_state(request)
    check_content_type(request)
    admit(state, state.scheduler.check)
    body = await read_body(request, model, state.settings.max_body_bytes)
    return await asyncio.to_thread(to_call, body)


def submit(request: Request, kind: str, flow: Generator, deadline: float | None = None) -> Ticket:
    """The request's flow on the scheduler (429 / 503 when it takes no more)."""
    state = serve_state(request)
    return admit(state, lambda: state.scheduler.submit(flow, kind, deadline))


async def watch(request: Request, ticket: Ticket, future) -> None:
    """Wait for `future` (a concurrent future of the ticket); a client that disconnects, or the end of the grace
    period at shutdown, cancels the request (ServeHTTPError 499 / 503)."""
    state = serve_state(request)
    fut = asyncio.wrap_future(future)
    try:
        while not (await asyncio.wait({fut}, timeout=POLL_S))[0]:
            if await request.is_disconnected():
                raise ServeHTTPError(499, "cancelled", "the client disconnected; its request was cancelled")
            if state.shutdown.expired():
                raise state.shutdown.too_late()
    except (ServeHTTPError, asyncio.CancelledError):
        ticket.cancel()  # it leaves the queue, or its work at the next token or step
        fut.cancel()  # nobody will read its outcome
        raise
    fut.exception()  # read here (outcome() reads the ticket's own future): asyncio would log it as never retrieved


def outcome(request: Request, ticket: Ticket, limit_status: int | None = None) -> Any:
    """The ended request's result, or its failure as the reply it gets. limit_status: the status of a limit the
    scheduler refused the work for as it was queued (LimitError; default its own, 422; the chat endpoint's 400)."""
    state = serve_state(request)
    try:
        return ticket.future.result(0)
    except QueueFull as exc:
        raise queue_full(exc) from None
    except Cancelled:
        raise ServeHTTPError(499, "cancelled", "the request was cancelled") from None
    except ShuttingDown:
        raise state.shutdown.error(DROPPED) from None
    except LimitError as exc:
        raise from_sicl_error(exc, limit_status) from None
    except SiclError:
        raise
    except Exception as exc:  # a bug inside the request: log it, answer 500, keep serving
        log.error("internal error in request %s (%s)", request.state.request_id, ticket.kind, exc_info=exc)
        raise internal_error(request, exc) from None


async def run_job(request: Request, kind: str, flow: Generator, deadline: float | None = None,
                  limit_status: int | None = None):
    """Submit the flow and wait for its reply (limit_status: outcome's). -> (result, ticket)"""
    ticket = submit(request, kind, flow, deadline)
    await watch(request, ticket, ticket.future)
    return outcome(request, ticket, limit_status), ticket


def timing(ticket: Ticket) -> dict:
    """The reply's `timing`: seconds waiting to be admitted, and in the batch (shared with the work beside it)."""
    return {"queue_s": round(ticket.queue_seconds, 6), "engine_s": round(ticket.batch_seconds, 6)}
