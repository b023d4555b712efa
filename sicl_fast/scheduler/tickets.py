"""A request to the scheduler (a Ticket) and the ways it can end besides its result.

    ticket = scheduler.submit(flow, kind="chat", deadline=None)
    ticket.result(timeout)            the flow's return value (or its exception: Cancelled, ShuttingDown, QueueFull,
    await ticket                      a SiclError of the work); `ticket.future` is a concurrent.futures.Future
    ticket.cancel()                   it leaves at the next boundary of the work it is in (a token, a step); so
                                      does a cancelled ticket.future, or a cancelled asyncio task awaiting it

A flow is a generator: it yields work (sicl_fast.scheduler.work: a calibration, an answer, a call on the engine, or a
list of them, which run together) and gets each result back, and returns the reply; the scheduler runs the work on
the engine and advances the flow on its own thread, so a flow must be quick between two yields.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Generator
from typing import Any

log = logging.getLogger("sicl_fast.scheduler")


class QueueFull(Exception):
    """max_queue requests already wait to be admitted; retry_after: seconds until one is likely admitted."""

    def __init__(self, waiting: int, max_queue: int, retry_after: int) -> None:
        super().__init__(f"the engine queue is full ({waiting} waiting, --max-queue {max_queue}); "
                         f"retry after {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The request was cancelled (its client went away) before or while it ran."""


class ShuttingDown(Exception):
    """The scheduler is draining (the server is shutting down): no new requests; one still waiting never runs."""


class _Future(concurrent.futures.Future):
    """A concurrent future whose done-callbacks each run whatever another one raised. concurrent.futures catches an
    Exception of a callback only: one raising asyncio.CancelledError (a BaseException) skipped the callbacks after
    it (an `await ticket` waited for ever) and ended the thread that set the outcome, the scheduler's."""

    def _invoke_callbacks(self) -> None:
        for callback in self._done_callbacks:
            try:
                callback(self)
            except BaseException:  # noqa: BLE001 - the callback's own failure, logged as concurrent.futures does
                log.exception("a done-callback of a scheduler ticket failed: %r", callback)


class Ticket:
    """One request (module docstring). deadline: time.monotonic() after which stop_reason() says 'deadline' (a
    calibration stops at its next step with the best X so far); shutdown_at: set by the drain, after which it says
    'shutdown'. submitted / admitted / finished: time.monotonic() of each (admitted: its first work took a place
    in the batch; None while it waits)."""

    def __init__(self, flow: Generator, kind: str = "request", deadline: float | None = None) -> None:
        self.flow, self.kind, self.deadline = flow, kind, deadline
        self.future: concurrent.futures.Future = _Future()
        self._cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.admitted: float | None = None
        self.finished: float | None = None
        self.shutdown_at: float | None = None
        self.decided: concurrent.futures.Future = _Future()  # done once admitted or ended
        self.seq = 0  # arrival order (the scheduler's)
        # a front end that cancels the future (future.cancel(), or the asyncio task awaiting the ticket, whose
        # cancellation asyncio passes on to it) cancels the request: its work stops at the next token or step
        self.future.add_done_callback(lambda f: f.cancelled() and self._cancelled.set())

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self.future.done()

    def stop_reason(self) -> str | None:
        """'cancelled', 'deadline', 'shutdown' (the earlier of the two times that passed) or None: what should stop
        this request's calibration now."""
        if self._cancelled.is_set():
            return "cancelled"
        now = time.monotonic()
        due = [(t, why) for t, why in ((self.deadline, "deadline"), (self.shutdown_at, "shutdown"))
               if t is not None and now >= t]
        return min(due)[1] if due else None

    def end(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the outcome (once; a waiter that gave up on the future is not an error). A flow ended while it waits
        at a yield (cancelled, refused, drained) is closed: a failure of its own cleanup (a `finally` that raises, a
        GeneratorExit ignored) is logged and leaves the outcome as it is."""
        self.finished = time.monotonic()
        try:
            self.flow.close()
        except BaseException:  # noqa: BLE001 - the flow's own failure: it must not end the scheduler's thread
            log.warning("request %r: its flow failed as it was closed; it ends as it was ending", self.kind,
                        exc_info=True)
        try:
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        self.decide()

    def decide(self) -> None:
        """Admitted (or ended): what a streaming reply waits for before it sends its headers."""
        try:
            self.decided.set_result(None)
        except concurrent.futures.InvalidStateError:
            pass

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()

    @property
    def queue_seconds(self) -> float:
        """Time waiting to be admitted (so far, while it waits)."""
        return (self.admitted or self.finished or time.monotonic()) - self.submitted

    @property
    def batch_seconds(self) -> float:
        """Time in the batch: from admission to the end (0 when never admitted)."""
        if self.admitted is None:
            return 0.0
        return (self.finished or time.monotonic()) - self.admitted


__all__ = ["Ticket", "QueueFull", "Cancelled", "ShuttingDown"]
