"""A function that runs in turns: on a thread of its own, but only while the scheduler has handed it the engine.

    co = Coroutine(fn, name)    fn() calls co.pause() wherever it may be interrupted (a calibration: its should_stop
                                hook, which every loop calls at a step boundary: after each step, or each read of
                                the static step's state)
    more = co.resume()          runs fn until its next pause() or its end (then co.result / co.error); -> False once
                                it has ended

Exactly one of the two threads runs at any moment: resume() waits until fn pauses or ends, and fn waits in pause()
until the next resume(). A calibration run this way is Engine.calibrate itself (its loop, the store, the reuse rules)
interrupted between steps, so its result is the one it has alone: what runs between its turns (other requests'
tokens) changes nothing it reads (sicl_fast.scheduler.loop refits the rotary tables of rope types that depend on the
length, the one state of the model that a unit sets for itself).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Coroutine:
    def __init__(self, fn: Callable[[], Any], name: str = "sicl-fast-calibration") -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.turns = 0  # resume() calls so far
        self._go = threading.Semaphore(0)  # the scheduler hands the engine to fn
        self._back = threading.Semaphore(0)  # fn hands it back (a pause, or its end)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        self._go.acquire()
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the scheduler's to deliver
            self.error = exc
        finally:
            self.done = True
            self._back.release()

    def resume(self) -> bool:
        """Run fn until it pauses or ends (module docstring); -> whether it has more to run."""
        if self.done:
            return False
        if self.turns == 0:
            self._thread.start()
        self.turns += 1
        self._go.release()
        self._back.acquire()
        return not self.done

    def pause(self) -> None:
        """On fn's thread: hand the engine back and wait for the next turn."""
        self._back.release()
        self._go.acquire()

    def join(self) -> None:
        """Wait for fn's thread to return (it does at once after fn ended)."""
        if self.turns:
            self._thread.join()

    @property
    def started(self) -> bool:
        return self.turns > 0


__all__ = ["Coroutine"]
