"""Waiting for another caller's work (single flight, another process's lock) within the waiter's own deadline.

    wait(ready, should_stop)    ready(timeout) -> bool: True once the thing waited for is there, after waiting at
                                most timeout seconds (None: until it is). Without should_stop, one blocking call;
                                with it, ready(POLL_S) in turn with should_stop(): a returned reason ends the wait
                                with GaveUp(reason)

should_stop is a calibration's own hook (the server's deadline and cancellation, the time budget: the loops'
should_stop, sicl_fast.run.run_args.stop_check), so a caller waiting for someone else's calibration stops when its own
calibration would have (CalibrationStore.get_or_compute says what it returns then).
"""
from __future__ import annotations

from collections.abc import Callable

POLL_S = 0.05  # between two looks at should_stop while waiting: far below any deadline a server is given


class GaveUp(Exception):
    """A wait ended by the waiter's should_stop before the result came; reason: what should_stop returned."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def wait(ready: Callable[[float | None], bool], should_stop: Callable[[], str | None] | None) -> None:
    """Wait until ready (module docstring); GaveUp when should_stop says so first."""
    if should_stop is None:
        ready(None)
        return
    while not ready(POLL_S):
        reason = should_stop()
        if reason:
            raise GaveUp(reason)


__all__ = ["POLL_S", "GaveUp", "wait"]
