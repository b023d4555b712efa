"""What a caller asks of one calibration besides its config: when to stop from outside, and which best-so-far X to
keep along the way. Neither changes what a step computes, so neither is a CalibrationConfig field (a calibration is
identified by its config); each loop (Calibrator.run, run_static, run_packed) takes them as run arguments.

    stop_check(should_stop, time_budget_s, t0)   one hook for the loops: the caller's should_stop (e.g. the
                                                 server's deadline), then the time budget: "time_budget" once
                                                 time_budget_s seconds have passed since t0 (time.perf_counter())
    BestAt(steps)                                the best X after each of `steps` steps run (icleval --answer-at)

The loops check the hook at a step boundary after the best X is updated (the eager loop after every step; the
static and packed loops at each read of the state, every sync_every steps), so at least one step always runs and a
budget stops the run within one step (or one read) of its end, with the best X so far.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from .knobs import check_range

TIME_BUDGET = "time_budget"  # the stop reason of a run ended by its time budget


def check_budget(time_budget_s: float | None, where: str) -> float | None:
    """time_budget_s (seconds, sicl_fast.run.knobs' range) as a float, or None for no budget."""
    return None if time_budget_s is None else float(check_range("time_budget_s", time_budget_s, where))


def stop_check(should_stop: Callable[[], str | None] | None, time_budget_s: float | None,
               t0: float) -> Callable[[], str | None] | None:
    """The loops' should_stop: the caller's hook first, then the budget (module docstring); None when neither."""
    if time_budget_s is None:
        return should_stop

    def check() -> str | None:
        reason = should_stop() if should_stop is not None else None
        return reason or (TIME_BUDGET if time.perf_counter() - t0 >= time_budget_s else None)

    return check


class BestAt:
    """The best X after given numbers of steps (step counts >= 1). A static loop reads no later than
    `until_next(n)` steps after n, so that a read lands on each count, and calls `keep(n, best_step, best_X)`;
    `kept` maps n -> (best_step, X [L, d]), X shared between counts whose best step is the same. Counts the run
    never reached are not kept, nor is anything of a gated run: the run's final X is the best there."""

    def __init__(self, steps: Iterable[int] = (), where: str = "best_at") -> None:
        self.steps = sorted({int(check_range("max_steps", k, where, "a step count")) for k in steps})
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}

    def copies(self, max_steps: int) -> int:
        """At most how many X a run of max_steps steps keeps (one per count it reaches): for the memory check."""
        return sum(k <= max_steps for k in self.steps)

    def wants(self, n: int) -> bool:
        """Is the best X after n steps one to keep (and not kept yet)?"""
        return n in self.steps and n not in self.kept

    def until_next(self, n: int) -> int:
        """Steps from n to the next count to keep (a large number when none is left): a static loop reads no
        later than that."""
        return next((k - n for k in self.steps if k > n), 1 << 62)

    def keep(self, n: int, best_step: int, best_X: torch.Tensor) -> None:
        """The best X after n steps (best_step: the step it comes from), when n is a count to keep."""
        if not self.wants(n):
            return
        last = self.kept[max(self.kept)] if self.kept else None
        X = last[1] if last is not None and last[0] == best_step else best_X.detach().clone()
        self.kept[n] = (best_step, X)


__all__ = ["TIME_BUDGET", "check_budget", "stop_check", "BestAt"]
