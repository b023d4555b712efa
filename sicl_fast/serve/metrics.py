"""Prometheus metrics of one server (its own registry, so several servers can live in one process), and the ASGI
middleware that counts every HTTP request, times it, tags it with an X-Request-ID and logs one line for it.

    sicl_fast_requests_total{endpoint, status}         HTTP requests answered
    sicl_fast_errors_total{kind}                        error replies by kind (bad_json, invalid_request, limit, ...)
    sicl_fast_request_seconds{endpoint}                 latency histogram, arrival to last byte
    sicl_fast_queue_wait_seconds / sicl_fast_engine_seconds{job}   time waiting for / holding the engine
    sicl_fast_queue_depth, sicl_fast_engine_busy       requests waiting; 1 while a job runs
    sicl_fast_calibration_steps_total                   ascent steps run (rate() = steps per second)
    sicl_fast_steps_per_second                          steps / second of the last calibration
"""
from __future__ import annotations

import logging
import time
import uuid

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .queue import EngineQueue, Job

log = logging.getLogger("sicl_fast.serve")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServeMetrics:
    def __init__(self, queue: EngineQueue) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sicl_fast_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter("sicl_fast_errors", "error replies by kind", ["kind"], registry=r)
        self.latency = Histogram("sicl_fast_request_seconds", "request latency, arrival to last byte", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("sicl_fast_queue_wait_seconds", "time a job waited for the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.engine_seconds = Histogram("sicl_fast_engine_seconds", "time a job held the engine", ["job"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        depth = Gauge("sicl_fast_queue_depth", "requests waiting for the engine", registry=r)
        depth.set_function(lambda: queue.depth)
        busy = Gauge("sicl_fast_engine_busy", "1 while a job runs on the engine", registry=r)
        busy.set_function(lambda: float(queue.busy))
        self.steps = Counter("sicl_fast_calibration_steps", "ascent steps run", registry=r)
        self.steps_per_second = Gauge("sicl_fast_steps_per_second", "ascent steps per second of the last calibration",
                                      registry=r)

    def job_finished(self, job: Job, kind: str) -> None:
        self.queue_wait.observe(job.queue_seconds)
        if job.finished is not None and job.started is not None:
            self.engine_seconds.labels(kind).observe(job.finished - job.started)

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
