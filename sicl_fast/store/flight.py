"""SingleFlight: concurrent calls for one key in this process run once; the others wait for that call.

    value, led = flight.run(key, fn, should_stop=None)

The first caller for a key runs fn() (led True); callers arriving while it runs wait and get its value (led False).
If fn raised, the waiters get (None, False) and decide themselves (CalibrationStore looks again and leads a new
call): a leader stopped by its own deadline or client must not fail the others. A waiter with should_stop (its own
calibration's hook) looks at it every POLL_S seconds while it waits and raises GaveUp(reason) when it fires
(sicl_fast.store.wait).
"""
from __future__ import annotations

import threading
from typing import Any
from collections.abc import Callable

from .wait import wait


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None


class SingleFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}

    def run(self, key: str, fn: Callable[[], Any], should_stop: Callable[[], str | None] | None = None
            ) -> tuple[Any, bool]:
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = _Call()
        if not leader:
            wait(call.done.wait, should_stop)
            return call.value, False
        try:
            call.value = fn()
            return call.value, True
        finally:
            with self._lock:
                del self._calls[key]
            call.done.set()


__all__ = ["SingleFlight"]
