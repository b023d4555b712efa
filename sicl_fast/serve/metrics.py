"""Prometheus metrics of one server (its own registry, so several servers can live in one process), and the ASGI
middleware that counts every HTTP request, times it, tags it with an X-Request-ID and logs one line for it.

    sicl_fast_requests_total{endpoint, status}         HTTP requests answered
    sicl_fast_errors_total{kind}                        error replies by kind (bad_json, invalid_request, limit, ...)
    sicl_fast_request_seconds{endpoint}                 latency histogram, arrival to last byte
    sicl_fast_queue_wait_seconds                        time in queue: from arrival to admission into the batch
    sicl_fast_batch_seconds{job}                        time in batch: from admission to the reply's end
    sicl_fast_queue_depth, sicl_fast_engine_busy       requests waiting to be admitted; 1 while work is in flight
    sicl_fast_in_flight                                 requests admitted and not done
    sicl_fast_batch_size                                answers in the batches of each decoding unit (histogram)
    sicl_fast_batch_rows                                answers decoding now
    sicl_fast_generated_tokens_total                    answer tokens decoded (rate() = tokens per second)
    sicl_fast_tokens_per_second                         answer tokens per second over the last TOKENS_WINDOW_S
    sicl_fast_calibration_steps_total                   ascent steps run (rate() = steps per second)
    sicl_fast_steps_per_second                          steps / second of the last calibration
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..scheduler import Observer, Scheduler, Ticket

log = logging.getLogger("sicl_fast.serve")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS_WINDOW_S = 10.0


class ServeMetrics(Observer):
    """The registry and its metrics (module docstring); the scheduler's Observer (watch() gives it the gauges)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sicl_fast_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter("sicl_fast_errors", "error replies by kind", ["kind"], registry=r)
        self.latency = Histogram("sicl_fast_request_seconds", "request latency, arrival to last byte", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("sicl_fast_queue_wait_seconds", "time in queue: arrival to admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_seconds = Histogram("sicl_fast_batch_seconds", "time in batch: admission to the end", ["job"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("sicl_fast_batch_size", "answers in the batches of a decoding unit",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("sicl_fast_generated_tokens", "answer tokens decoded", registry=r)
        self.steps = Counter("sicl_fast_calibration_steps", "ascent steps run", registry=r)
        self.steps_per_second = Gauge("sicl_fast_steps_per_second", "ascent steps per second of the last calibration",
                                      registry=r)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the decoding units of the window
        self._lock = threading.Lock()

    def watch(self, scheduler: Scheduler) -> None:
        """The gauges read from the scheduler."""
        r = self.registry
        for name, doc, fn in (
                ("sicl_fast_queue_depth", "requests waiting to be admitted", lambda: scheduler.depth),
                ("sicl_fast_engine_busy", "1 while work is in flight", lambda: float(scheduler.busy)),
                ("sicl_fast_in_flight", "requests admitted and not done", lambda: scheduler.in_flight),
                ("sicl_fast_batch_rows", "answers decoding now", lambda: scheduler.batch_rows),
                ("sicl_fast_tokens_per_second", f"answer tokens per second over the last {TOKENS_WINDOW_S:g} s",
                 self.tokens_per_second)):
            Gauge(name, doc, registry=r).set_function(fn)

    # the scheduler's Observer (on its thread)
    def decoded(self, rows: int, tokens: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.tokens.inc(tokens)
        with self._lock:
            self._recent.append((time.monotonic(), tokens))

    def finished(self, ticket: Ticket) -> None:
        self.queue_wait.observe(ticket.queue_seconds)
        self.batch_seconds.labels(ticket.kind).observe(ticket.batch_seconds)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - TOKENS_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / TOKENS_WINDOW_S

    def calibration_done(self, steps: int, seconds: float) -> None:
        if seconds > 0:
            self.steps_per_second.set(steps / seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def note(request, **fields) -> None:
    """Add fields to the request's log line (e.g. id, steps, proxy=(before, after)); RequestMetrics writes it."""
    request.scope.setdefault("state", {}).setdefault("log", {}).update(fields)


def log_line(scope, rid: str, status: int, seconds: float) -> str:
    """'request RID CLIENT METHOD PATH STATUS SECONDSs k=v ...': strings quoted, floats to 4 digits, pairs a->b."""
    def show(v) -> str:
        if isinstance(v, tuple):
            return "->".join(show(x) for x in v)
        return f"{v:.4f}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)

    client = ":".join(str(x) for x in scope.get("client") or ("-",))
    path = scope["path"] if scope["path"].isprintable() else repr(scope["path"])  # a %0A is no new log line
    fields = "".join(f" {k}={show(v)}" for k, v in scope["state"].get("log", {}).items())
    return f"request {rid} {client} {scope['method']} {path} {status} {seconds:.3f}s{fields}"


class RequestMetrics:
    """ASGI middleware: a request id per HTTP request (scope['state']['request_id'], X-Request-ID header), the
    request counter, the latency histogram and one log line per request (INFO, logger sicl_fast.serve). Paths
    outside `endpoints` are counted as 'other' (bounded label values)."""

    def __init__(self, app, metrics: ServeMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        t0 = time.perf_counter()
        status = [500]

        async def send_tagged(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        finally:
            seconds = time.perf_counter() - t0
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(seconds)
            log.info("%s", log_line(scope, rid, status[0], seconds))
