"""The server's drain on SIGTERM or SIGINT (server.Server turns the signal into `Shutdown.request`).

With g = --grace-s, from the signal at t0:

    t0          every new request is answered 503 (the JSON error, Retry-After, Connection: close), /health
                included; each request still waiting to be admitted is answered 503 and never runs; the batches in
                flight go on (answers decode to their stop)
    t0 + 0.8 g  a calibration still running stops after its current step and answers with the best X so far
                (stop_reason "shutdown"); work that ends before (done, or at its own timeout_s) answers as usual
    t0 + g      a request still in flight is answered 503 and the server exits; it exits at once when nothing is
                in flight

The process then exits with status 0. A second signal makes t0 + g now.
"""
from __future__ import annotations

import logging
import math
import time

from fastapi import Request

from .errors import ServeHTTPError, error_response
from ..scheduler import Scheduler

log = logging.getLogger("sicl_fast.serve")

STOP_FRACTION = 0.8  # of the grace period: when the running calibration is asked to stop, leaving it time to answer
REFUSED = "the server is shutting down and takes no new work; retry later (another instance, or this one restarted)"
DROPPED = "the server is shutting down; this request was still queued and did not run"


class Shutdown:
    """The drain of one server. `request` may be called from a signal handler: it only writes two floats; the
    event loop calls `tick` (every 0.1 s) to act on them."""

    def __init__(self, grace_s: float, scheduler: Scheduler) -> None:
        self.grace_s = grace_s
        self.scheduler = scheduler
        self.end: float | None = None  # time.monotonic() by which the server exits; None: not shutting down
        self.stop_at: float | None = None  # when the running calibration is asked to stop
        self._began = False

    def request(self) -> None:
        """Begin the drain (the first call) or end it now (a second call)."""
        now = time.monotonic()
        if self.end is None:
            self.stop_at, self.end = now + STOP_FRACTION * self.grace_s, now + self.grace_s
        else:
            self.stop_at = self.end = min(self.end, now)

    @property
    def draining(self) -> bool:
        return self.end is not None

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def tick(self) -> bool:
        """On the event loop: drain the queue once asked. True when the server should exit now (nothing is in
        flight, or the grace period is over)."""
        if self.end is None:
            return False
        if not self._began:
            self._began = True
            running = self.scheduler.busy
            dropped = self.scheduler.drain(self.stop_at)
            log.info("shutting down: taking no new work; %d request(s) waiting to be admitted answered 503; %s",
                     dropped,
                     f"the work in flight may go on: a calibration is asked to stop in "
                     f"{STOP_FRACTION * self.grace_s:g} s, and what runs past {self.grace_s:g} s (--grace-s) is "
                     "answered 503" if running else "nothing in flight")
        return not self.scheduler.busy or self.expired()

    def error(self, message: str) -> ServeHTTPError:
        """The 503 for work refused or dropped while draining; Retry-After: when this server will be gone."""
        retry = max(1, math.ceil(self.end - time.monotonic())) if self.end is not None else 1
        return ServeHTTPError(503, "shutting_down", message, {"Retry-After": str(retry), "Connection": "close"})

    def too_late(self) -> ServeHTTPError:
        """The 503 for a request still in flight when the grace period ends (its work is lost)."""
        return self.error(f"the server shut down before this request finished (grace period {self.grace_s:g} s, "
                          "--grace-s)")


class RefuseWhileDraining:
    """ASGI middleware: while the server drains, every HTTP request is answered with the 503 before any work."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            shutdown: Shutdown = scope["app"].state.serve.shutdown
            if shutdown.draining:
                request = Request(scope, receive)
                await error_response(request, shutdown.error(REFUSED))(scope, receive, send)
                return
        await self.app(scope, receive, send)
