"""EngineQueue: one worker thread runs jobs on the engine, one at a time, in arrival order.

The engine holds one model and its caches and is not safe to call from two threads, and on the CPU one job already
uses every core, so jobs run one at a time (a packed multi-prompt step would let a GPU batch them). The queue is
bounded: `submit` refuses work beyond `max_queue` waiting jobs at once (QueueFull, with a Retry-After estimate)
instead of letting memory grow. A job can be cancelled (its client went away) or carry a deadline; the job's
function polls `job.stop_reason()` (the Calibrator's should_stop hook) and stops at the next step. `drain` (the
server's shutdown) refuses new jobs, fails the waiting ones with ShuttingDown and gives the running one a time
to stop by.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from typing import Any
from collections.abc import Callable

log = logging.getLogger("sicl_fast.serve")


class QueueFull(Exception):
    """The queue holds max_queue waiting jobs; retry_after: seconds until a slot is likely free."""

    def __init__(self, waiting: int, max_queue: int, retry_after: int) -> None:
        super().__init__(f"the engine queue is full ({waiting} waiting, --max-queue {max_queue}); "
                         f"retry after {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The job was cancelled (its client disconnected) before or while it ran."""


class ShuttingDown(Exception):
    """The queue is draining (the server is shutting down): no new jobs; a job still waiting never runs."""


class Job:
    """One unit of engine work. fn(job) runs on the worker thread; its result or exception lands in `future`.

    deadline: time.monotonic() value after which stop_reason() says "deadline" (None: no deadline).
    kind: a label for metrics ("proxy", "calibrate").
    shutdown_at: set by EngineQueue.drain; after it, stop_reason() says "shutdown".
    """

    def __init__(self, fn: Callable[[Job], Any], deadline: float | None = None, kind: str = "job") -> None:
        self.fn = fn
        self.deadline = deadline
        self.kind = kind
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._cancelled = threading.Event()
        self.enqueued = time.monotonic()
        self.shutdown_at: float | None = None
        self.started: float | None = None
        self.finished: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def stop_reason(self) -> str | None:
        """'cancelled', 'deadline', 'shutdown' (the earlier of the two times that passed) or None: what should stop
        this job's work now."""
        if self._cancelled.is_set():
            return "cancelled"
        now = time.monotonic()
        due = [(t, why) for t, why in ((self.deadline, "deadline"), (self.shutdown_at, "shutdown"))
               if t is not None and now >= t]
        return min(due)[1] if due else None

    def fail(self, exc: BaseException) -> None:
        """End a job that will never run with exc."""
        try:
            self.future.set_exception(exc)
        except concurrent.futures.InvalidStateError:  # its waiter already gave up on it (cancelled the future)
            pass

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.monotonic()) - self.enqueued


class EngineQueue:
    """A bounded FIFO of Jobs and the one worker thread that runs them.

    max_queue: jobs allowed to wait while another runs (0: only the running one). on_finish(job) is called on the
    worker thread after each job that ran (for metrics).
    """

    def __init__(self, max_queue: int, on_finish: Callable[[Job], None] | None = None) -> None:
        self.max_queue = max_queue
        self.on_finish = on_finish
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._draining = False  # no new jobs (drain or close)
        self._closed = False  # the worker ends once the queue is empty
        self._mean_seconds = 1.0  # running mean of job time, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="sicl-fast-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def admit(self) -> None:
        """Raise ShuttingDown while draining, QueueFull when max_queue jobs already wait behind a running one (submit
        checks both again)."""
        if self._draining:
            raise ShuttingDown()
        if len(self._waiting) + (self._running is not None) > self.max_queue:
            retry = max(1, math.ceil(self._mean_seconds * (len(self._waiting) + 1)))
            raise QueueFull(len(self._waiting), self.max_queue, retry)

    def submit(self, fn: Callable[[Job], Any], deadline: float | None = None, kind: str = "job") -> Job:
        """Queue fn; raises QueueFull or ShuttingDown (see admit)."""
        job = Job(fn, deadline, kind)
        with self._cond:
            self.admit()
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        # set_running_or_notify_cancel: False when the awaiting side already gave up on the future
        if job.cancelled or not job.future.set_running_or_notify_cancel():
            job.fail(Cancelled())
            return
        job.started = time.monotonic()
        result, error = None, None
        try:
            result = job.fn(job)
        except BaseException as exc:  # noqa: BLE001 - a failing job must never take the worker down
            error = exc
        job.finished = time.monotonic()  # before the waiter wakes up: it reports the timing
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (job.finished - job.started)
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
        if self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:  # noqa: BLE001
                log.exception("metrics hook failed")

    def drain(self, stop_at: float) -> int:
        """Take no new jobs; fail the waiting ones with ShuttingDown; the running one may go on until stop_at (a
        time.monotonic() value), when its stop_reason() becomes 'shutdown'. -> the number of jobs failed."""
        with self._cond:
            self._draining = True
            waiting, self._waiting = list(self._waiting), deque()
            if self._running is not None:
                self._running.shutdown_at = stop_at
        for job in waiting:
            job.fail(ShuttingDown())
        return len(waiting)

    def close(self, timeout: float = 30.0) -> bool:
        """Drain, cancel the running job (it stops at its next step), and join the worker for at most timeout s
        (an idle worker ends at once). -> whether the worker has ended (see `ended`)."""
        self.drain(time.monotonic())
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._running.cancel()
            self._cond.notify_all()
        self._thread.join(timeout)
        return self.ended

    @property
    def ended(self) -> bool:
        """The worker thread has returned. A process must not finalize while it runs: a thread that has run torch
        code and takes the GIL back during the interpreter's finalization is ended inside torch's C++ frames, which
        aborts the process ('terminate called without an active exception'; pytorch/pytorch#38228)."""
        return not self._thread.is_alive()
