"""The read loop the static and packed runs share: between two reads the device steps run with no host read; at a
read, one host read gives every slot's stop reason and steps run, and each slot keeps its best X for best_at,
reports its steps, checks the caller's stop hook and, once stopped, gives its CalibrationResult.

    slot = Slot(step, t0, best_at, should_stop, on_step)     one calibration (a Stepped: a StaticStep) as the reads
                                                             see it
    k = steps_to_read(slots, sync_every)                     the steps to run before the next read
    for slot, (reason, n) in zip(slots, read(slots)):        the one host read
        result = slot.settle(reason, n)                      None while it runs on

A stopped slot's state no longer changes (StaticStep), so its result is exact whatever the read interval.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..run.run_args import BestAt
from ..step.step_state import GATE, RUNNING, StepState
from .ascent import CalibrationConfig, CalibrationResult


class Stepped(Protocol):
    """What the reads need of a calibration: a StaticStep (static.py) is one. Named here, not imported from
    static.py, which runs its loop on this module (no import circle, type-only ones included)."""

    state: StepState
    config: CalibrationConfig

    def own(self, X: torch.Tensor) -> torch.Tensor: ...

    def result(self, seconds: float, stop_reason: str | None = None, best_at: BestAt | None = None
               ) -> CalibrationResult: ...


@dataclass
class Slot:
    """One calibration run by the static or packed loop. t0: its start (time.perf_counter()); should_stop: the
    caller's hook with the time budget (run_args.stop_check); on_step(step, f0): its progress, given at each read;
    index: its place among the run's items; calls: the steps called on it; reported: the steps given to on_step."""

    step: Stepped
    t0: float
    best_at: BestAt
    should_stop: Callable[[], str | None] | None = None
    on_step: Callable[[int, float], None] | None = None
    index: int = 0
    calls: int = 0
    reported: int = 0

    def settle(self, reason: int, n: int) -> CalibrationResult | None:
        """After a read of its stop reason and steps run n: the best X kept at n (a gated run keeps nothing, as the
        eager loop), the steps reported, and the result once it stopped by itself or the stop hook says so."""
        state = self.step.state
        if self.best_at.wants(n) and reason != GATE:
            self.best_at.keep(n, state.best.best_step, self.step.own(state.best.best_X))
        if self.on_step is not None and n > self.reported:
            for i, v in enumerate(state.history[self.reported:n].tolist(), start=self.reported):
                self.on_step(i, v)
            self.reported = n
        why = self.should_stop() if reason == RUNNING and self.should_stop is not None else None
        if reason == RUNNING and not why:
            return None
        return self.step.result(time.perf_counter() - self.t0, stop_reason=why, best_at=self.best_at)


def steps_to_read(slots: Sequence[Slot], sync_every: int) -> int:
    """Steps to run before the next read: sync_every, no more than the most any slot can still take (it stops by
    its max_steps at the latest), and a read on each step count a slot keeps its best X at."""
    return min(sync_every, max(s.step.config.max_steps - s.calls for s in slots),
               *(s.best_at.until_next(s.calls) for s in slots))


def read(slots: Sequence[Slot]) -> list[tuple[int, int]]:
    """(stop reason, steps run) of every slot, in one host read."""
    values = torch.cat([t for s in slots for t in (s.step.state.reason, s.step.state.steps_run)]).tolist()
    return list(zip(values[::2], values[1::2]))


__all__ = ["Slot", "Stepped", "steps_to_read", "read"]
