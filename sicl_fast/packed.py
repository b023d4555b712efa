"""The packed multi-prompt step (throughput mode): P prompts of different lengths calibrated at once, their
perturbation batches stacked into one forward.

    PackedStep(backend, slots)          slots: one StaticStep per prompt (its own X, X0, rows, best state, stop
                                        flag, seed stream and config)
    run_packed(backend, items, pack)    a queue of (prompt, config); at most `pack` slots run together; a slot
                                        whose prompt stopped is taken out and refilled at the next read

Layout: the slots' batches [B_j, b_j, d] are stacked along the batch and right-padded with zeros to the longest
b_j. Causal attention never lets a position see a later one, so the padding changes nothing of a prompt's own
rows and needs no mask; each slot reads its span positions from its own rows. The packed forward runs the full
rows [0, b_j) with plain products (no prefix K/V, no difference products: rows of different prompts are not
near one row 0), so a slot computes what its prompt computes alone on a fast-fp32 backend without the prefix
cache: bit for bit when it is packed alone, to float32 rounding beside others (torch's CPU kernels may round a
last bit differently for another row count; tests/test_packed.py: rtol 1e-5, same steps and stops). Between two reads a stopped slot's state no longer changes (StaticStep), so its
result is exact whatever the read interval.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .ascent import CalibrationConfig, CalibrationResult
from .checks import calibration_inputs
from .knobs import check_range
from .spans import Prompt
from .spec import resolve_scale
from .static import StaticStep
from .step_state import RUNNING


class PackedStep:
    """One step of every slot through one batched forward (module docstring)."""

    def __init__(self, backend, slots: Sequence[StaticStep]) -> None:
        m = backend.model
        self.backend, self.slots = backend, list(slots)
        self.rows = []  # (first batch row, last + 1) of each slot
        r = 0
        for st in self.slots:
            self.rows.append((r, r + st.spec.B))
            r += st.spec.B
        b_max = max(st.prompt.demo_end for st in self.slots)
        self.x = torch.zeros(r, b_max, m.d, dtype=m.dtype, device=m.device)  # padding rows stay zero

    @torch.no_grad()
    def __call__(self) -> None:
        m, ops = self.backend.model, self.backend.ops
        for st, (r0, r1) in zip(self.slots, self.rows):
            st.perturb()
            b = st.prompt.demo_end
            self.x[r0:r1, :b].copy_(st.batch[:, :b])
        hidden = m.forward(self.x)  # [sum B_j, b_max, d]
        for st, (r0, r1) in zip(self.slots, self.rows):
            h = hidden[r0:r1].index_select(1, st.span.idx)  # [B_j, P_j, d]
            lp = ops.span_head(h, m.head, st.span.targets, softcap=m.final_softcap)
            st.advance(ops.proxy_planned(lp, st.proxy_plan).f)


def run_packed(backend, items: Sequence[tuple[Prompt, CalibrationConfig]], pack: int, sync_every: int = 1,
               on_result: Callable[[int, CalibrationResult], None] | None = None) -> list[CalibrationResult]:
    """Calibrate every (prompt, config) of `items`, at most `pack` at once (module docstring). With
    on_result(i, res), each result goes there as it finishes (in completion order) and is not kept; without, the
    results come back in the order of `items`."""
    for name, v in (("pack", pack), ("sync_every", sync_every)):
        check_range(name, v, "run_packed")
    backend.plan.require_sync_free("packed")
    queue = list(enumerate(items))
    results: list[CalibrationResult | None] = [None] * len(items)
    active: list[tuple[int, StaticStep, float]] = []  # (item index, state, start time)
    calls: dict[int, int] = {}  # steps called on each active slot (it stops by its max_steps at the latest)

    def admit() -> None:
        while queue and len(active) < pack:
            i, (prompt, config) = queue.pop(0)
            config = resolve_scale(config, backend.lm)
            st = StaticStep(backend, config, prompt, calibration_inputs(backend, prompt, config), use_prefix=False)
            active.append((i, st, time.perf_counter()))
            calls[i] = 0

    admit()
    while active:
        step = PackedStep(backend, [st for _, st, _ in active])  # a new layout whenever the slots change
        k = min(sync_every, max(st.config.max_steps - calls[i] for i, st, _ in active))
        for _ in range(k):
            step()
        for i, _, _ in active:
            calls[i] += k
        reasons = torch.cat([st.state.reason for _, st, _ in active]).tolist()  # the one read per sync_every steps
        still = []
        for (i, st, t0), reason in zip(active, reasons):
            if reason == RUNNING:
                still.append((i, st, t0))
                continue
            res = st.result(time.perf_counter() - t0)
            if on_result is None:
                results[i] = res
            else:
                on_result(i, res)
        active[:] = still
        admit()
    return results if on_result is None else []


__all__ = ["PackedStep", "run_packed"]
