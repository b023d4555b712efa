"""The packed multi-prompt step (throughput mode): P prompts of different lengths calibrated at once, their
perturbation batches stacked into one forward.

    PackedStep(backend, slots)          slots: one StaticStep per prompt (its own X, X0, rows, best state, stop
                                        flag, seed stream and config)
    run_packed(backend, items, pack)    a queue of (prompt, config); at most `pack` slots run together; a slot
                                        whose prompt stopped (or whose time budget ran out: checked at each read,
                                        from the slot's start) is taken out and refilled at the next read

Layout (sicl_fast.backends.step_forward.PackedForward): the slots' batches [B_j, b_j, d] are stacked along the
batch and right-padded with zeros to the longest b_j. Causal attention never lets a position see a later one, so
the padding changes nothing of a prompt's own rows and needs no mask; each slot reads its span positions from its
own rows. The packed forward runs the full rows [0, b_j) (no prefix K/V); with difference products on, each slot's
rows are differences from its own first row. A slot computes what its prompt computes alone without the prefix
cache: bit for bit when it is packed alone, to rounding beside others (torch's CPU kernels may round a last bit
differently for another row count; tests/test_packed.py: rtol 1e-5, same steps and stops). Between two reads a
stopped slot's state no longer changes (StaticStep), so its result is exact whatever the read interval.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .ascent import CalibrationConfig, CalibrationResult
from ..run.checks import calibration_inputs
from ..run.knobs import check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from ..step.spec import resolve_scale
from .static import StaticStep
from .reads import Slot, read, steps_to_read


class PackedStep:
    """One step of every slot through one batched forward (module docstring)."""

    def __init__(self, backend, slots: Sequence[StaticStep]) -> None:
        self.backend, self.slots = backend, list(slots)
        self.forward = backend.packed_forward([st.prompt for st in self.slots], [st.spec.B for st in self.slots],
                                              [st.state.X for st in self.slots])
        self.calls = 0

    @torch.no_grad()
    def __call__(self) -> None:
        every = self.forward.refresh_every
        if every and self.calls and self.calls % every == 0:  # the value rows' reference, every few steps
            self.forward.refresh([st.state.X for st in self.slots])
        self.calls += 1
        for st in self.slots:
            st.perturb()
        for st, lp in zip(self.slots, self.forward([st.batch for st in self.slots])):
            st.advance(self.backend.ops.proxy_planned(lp, st.proxy_plan).f)


def run_packed(backend, items: Sequence[tuple[Prompt, CalibrationConfig]], pack: int, sync_every: int = 1,
               on_result: Callable[[int, CalibrationResult], None] | None = None,
               time_budget_s: float | None = None, best_at: Sequence[int] = ()) -> list[CalibrationResult]:
    """Calibrate every (prompt, config) of `items`, at most `pack` at once (module docstring). With
    on_result(i, res), each result goes there as it finishes (in completion order) and is not kept; without, the
    results come back in the order of `items`. time_budget_s: each item's budget from its start (as
    Calibrator.run's), checked at each read. best_at: step counts at which each item keeps its best X (a read lands
    on each)."""
    for name, v in (("pack", pack), ("sync_every", sync_every)):
        check_range(name, v, "run_packed")
    budget = check_budget(time_budget_s, "run_packed")
    BestAt(best_at, "run_packed")  # the counts checked before any work
    backend.plan.require_sync_free("packed")
    for _, config in items:  # before any work (icleval packs its calibrations here, not through calibrate_many)
        backend.plan.check_zeroth_order(config.estimator)
    queue = list(enumerate(items))
    results: list[CalibrationResult | None] = [None] * len(items)
    active: list[Slot] = []  # each with its item's index and its time budget's check

    def admit() -> None:
        while queue and len(active) < pack:
            i, (prompt, config) = queue.pop(0)
            config = resolve_scale(config, backend.lm)
            kept = BestAt(best_at)
            X0 = calibration_inputs(backend, prompt, config, kept=kept.copies(config.max_steps))
            st = StaticStep(backend, config, prompt, X0, use_prefix=False)
            t0 = time.perf_counter()
            active.append(Slot(st, t0, kept, stop_check(None, budget, t0), index=i))

    admit()
    while active:
        step = PackedStep(backend, [s.step for s in active])  # a new layout whenever the slots change
        k = steps_to_read(active, sync_every)
        for _ in range(k):
            step()
        still = []
        for slot, (reason, n) in zip(active, read(active)):
            slot.calls += k
            res = slot.settle(reason, n)
            if res is None:
                still.append(slot)
            elif on_result is None:
                results[slot.index] = res
            else:
                on_result(slot.index, res)
        active[:] = still
        admit()
    return results if on_result is None else []


__all__ = ["PackedStep", "run_packed"]
