"""The packed multi-prompt step (throughput mode): P prompts of different lengths calibrated at once, their
perturbation batches stacked into one forward.

    PackedStep(backend, slots)          slots: one StaticStep per prompt (its own X, X0, rows, best state, stop
                                        flag, seed stream and config; no forward of its own)
    run_packed(backend, items, pack)    a queue of (prompt, config); at most `pack` slots run together; a slot
                                        whose prompt stopped (or whose time budget ran out: checked at each read,
                                        from the slot's start) takes the next prompt of the queue at that read
    PackedRun(backend, pack)            that loop one read interval at a time, its queue open (add()): the
                                        server's scheduler packs concurrent calibrations through it

Layout (sicl_fast.backends.step_forward.PackedForward): the slots' batches [B_j, b_j, d] are stacked along the
batch and right-padded with zeros to the longest b_j. Causal attention never lets a position see a later one, so
the padding changes nothing of a prompt's own rows and needs no mask; each slot reads its span positions from its
own rows. The packed forward runs the full rows [0, b_j) (no prefix K/V); with difference products on, each slot's
rows are differences from its own first row, against a float32 reference of its own rows, made when the slot takes
its prompt and again every REFRESH_EVERY of its own steps (as it would be alone). A slot computes what its prompt
computes alone without the prefix cache: bit for bit when it is packed alone, to rounding beside others (torch's
CPU kernels may round a last bit differently for another row count; tests/test_packed.py: rtol 1e-5, same steps and
stops). Between two reads a stopped slot's state no longer changes (StaticStep), so its result is exact whatever the
read interval.

A slot that changes costs its own: the next prompt takes the stopped slot's place; where its shape is the stopped
one's (StepPlan.shape: with length buckets, a prompt of the same config, prefix rows and span count in the same
bucket) it is loaded into that slot's tensors in place (StaticStep.load, PackedForward.load: its reference, its
span plan), else it gets a step of its own and the pass is laid out again, the other slots keeping their references
(PackedForward.arrange). No slot's reference is made twice for one change. With CUDA graphs (the run plan's graphs),
a pack whose layout went through one read interval unchanged (its warm-up) is captured in one graph and replayed
until its layout changes; prompts loaded in place keep it. The queue's tail (a shrinking pack) runs uncaptured.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .ascent import CalibrationConfig, CalibrationResult
from ..run.graphs import captured, model_refs, shared_pool
from ..run.knobs import check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from .static import StaticStep
from .reads import Slot, read, steps_to_read
from .step_plan import plan_step


class PackedStep:
    """One step of every slot through one batched forward (module docstring). set() takes the slots (and says whether
    the pass was laid out again); a call refreshes each slot's reference where its own step count says (outside any
    graph, as run_static does), then runs the step: its captured CUDA graph's replay once capture() made one (the
    step itself elsewhere). pool: the memory pool of its graphs (run.graphs.shared_pool), or None."""

    def __init__(self, backend, slots: Sequence[StaticStep] = (), pool=None) -> None:
        self.backend, self.pool = backend, pool
        self.forward = backend.packed_forward()
        self.slots: list[StaticStep] = []
        self.calls: list[int] = []  # the steps called on each slot
        self.run = self.step
        self.graph = False  # is `run` a captured graph of the current layout
        self.captures = 0
        if slots:
            self.set(slots)

    def set(self, slots: Sequence[StaticStep], loaded: Sequence[int] = ()) -> bool:
        """Take `slots` (StaticSteps, in their places in the pass). A slot of the last set keeps its reference and
        its count of calls; the places in `loaded` hold their same StaticStep re-armed for another prompt of its
        shape (StaticStep.load), re-armed in place here too; any other slot is new and gets its own reference.
        Returns whether the pass was laid out again (then a graph of the last layout is dropped)."""
        where = {id(st): i for i, st in enumerate(self.slots)}
        kept = [None if j in loaded else where.get(id(st)) for j, st in enumerate(slots)]
        changed = [where.get(id(st)) for st in slots] != list(range(len(self.slots)))
        if changed:
            self.forward.arrange([st.prompt for st in slots], [st.spec.B for st in slots],
                                 [st.state.X for st in slots], kept, [st.bucket for st in slots])
            self.run, self.graph = self.step, False
        else:
            for j in loaded:
                self.forward.load(j, slots[j].prompt, slots[j].state.X)
        self.calls = [self.calls[k] if k is not None else 0 for k in kept]
        self.slots = list(slots)
        return changed

    def capture(self) -> None:
        """Capture the step of this layout in a CUDA graph (off CUDA: the step itself, nothing captured). Call it
        after at least one eager step of the layout, its warm-up (every buffer it makes lazily exists), so that the
        capture itself moves no slot's state."""
        if not self.graph:
            m = self.backend.model
            self.run = captured(self.step, self.backend.device, warmup=0, keep=model_refs(m, self.backend.ops),
                                pool=self.pool)
            self.graph = True
            self.captures += 1

    @torch.no_grad()
    def __call__(self) -> None:
        every = self.forward.refresh_every
        for j, st in enumerate(self.slots):
            if every and self.calls[j] and self.calls[j] % every == 0:  # the slot's reference, every few of its steps
                self.forward.refresh(j, st.state.X)
            self.calls[j] += 1
        self.run()

    @torch.no_grad()
    def step(self) -> None:
        """The step of every slot: no host read, every tensor fixed (capturable)."""
        for st in self.slots:
            st.perturb()
        for st, lp in zip(self.slots, self.forward([st.batch for st in self.slots])):
            st.advance(self.backend.ops.proxy_planned(lp, st.proxy_plan).f)


class PackedRun:
    """The packed loop, one read interval a call (run_packed drives it over a fixed list; the server's scheduler
    over the calibrations as they arrive): add() queues a calibration; interval() fills the free slots from the
    queue (at most `pack` run at once), runs the steps to the next read, reads, and gives the calibrations that
    stopped, whose slots take the next queued ones (module docstring). Each item keeps its own config, time budget
    (from its start), stop hook, best_at and progress hook. graphs: capture the pack (None: the run plan's); its
    length buckets (the plan's) pad each slot."""

    def __init__(self, backend, pack: int, sync_every: int = 1, graphs: bool | None = None) -> None:
        for name, v in (("pack", pack), ("sync_every", sync_every)):
            check_range(name, v, "run_packed")
        backend.plan.require_sync_free("packed")
        self.backend, self.pack, self.sync_every = backend, pack, sync_every
        self.graphs = backend.plan.graphs if graphs is None else graphs
        self.queue: list[tuple] = []  # (index, prompt, config, time budget, best_at, should_stop, on_step)
        self.active: list[Slot] = []
        self.shapes: dict[int, tuple] = {}  # id(step) -> its plan's shape (StepPlan.shape)
        self.step: PackedStep | None = None
        self.full = 0  # the most slots run together so far: a pack that full is captured once warmed up
        self.added = 0

    def add(self, prompt: Prompt, config: CalibrationConfig, time_budget_s: float | None = None,
            best_at: Sequence[int] = (), should_stop: Callable[[], str | None] | None = None,
            on_step: Callable[[int, float], None] | None = None) -> int:
        """Queue one calibration (checked now); -> its index, which interval() gives back with its result."""
        self.backend.plan.check_zeroth_order(config.estimator)
        budget = check_budget(time_budget_s, "run_packed")
        BestAt(best_at, "run_packed")  # the counts checked before any work
        self.queue.append((self.added, prompt, config, budget, tuple(best_at), should_stop, on_step))
        self.added += 1
        return self.added - 1

    @property
    def size(self) -> int:
        """Calibrations running and queued."""
        return len(self.active) + len(self.queue)

    def _admit(self, free: StaticStep | None = None) -> tuple[Slot, bool]:
        """(the next queued item's slot, whether it took `free`, a stopped slot's step, in place)."""
        backend, plan = self.backend, self.backend.plan
        i, prompt, config, budget, best_at, should_stop, on_step = self.queue.pop(0)
        kept = BestAt(best_at)
        # the slot's step planned once (its spec, bucket, bytes, proxy plan), without the prefix K/V
        step_plan, X0 = plan_step(backend, config, prompt, buckets=plan.length_buckets,
                                  kept=kept.copies(config.max_steps), use_prefix=False)
        loaded = free is not None and self.shapes.get(id(free)) == step_plan.shape
        if loaded:
            free.load(step_plan, X0)
            st = free
        else:
            st = StaticStep.planned(backend, step_plan, X0, own_forward=False)
            self.shapes.pop(id(free), None)
            self.shapes[id(st)] = step_plan.shape
        t0 = time.perf_counter()
        return Slot(st, t0, kept, stop_check(should_stop, budget, t0), on_step, index=i), loaded

    def interval(self) -> list[tuple[int, CalibrationResult]]:
        """One read interval (class docstring) -> (index, result) of each calibration that stopped in it."""
        grew = False
        while self.queue and len(self.active) < self.pack:
            self.active.append(self._admit()[0])
            grew = True
        if not self.active:
            return []
        if self.step is None:
            pool = shared_pool(self.backend.device) if self.graphs else None
            self.step = PackedStep(self.backend, [s.step for s in self.active], pool=pool)
        elif grew:
            self.step.set([s.step for s in self.active])
        self.full = max(self.full, len(self.active))
        k = steps_to_read(self.active, self.sync_every)
        for _ in range(k):
            self.step()
        done, loaded, gone = [], [], []
        for j, (slot, (reason, n)) in enumerate(zip(self.active, read(self.active))):
            slot.calls += k
            res = slot.settle(reason, n)
            if res is None:
                continue
            done.append((slot.index, res))
            if self.queue:  # the next prompt takes the place
                self.active[j], took = self._admit(slot.step)
                if took:
                    loaded.append(j)
            else:
                gone.append(j)
        self.active = [slot for j, slot in enumerate(self.active) if j not in gone]
        if not self.active:
            self.step, self.shapes = None, {}  # idle: nothing held (a later calibration lays out a new pass)
        elif not self.step.set([s.step for s in self.active], loaded) and self.graphs and len(self.active) == self.full:
            self.step.capture()  # the layout went through a read interval unchanged: warmed up
        return done


def run_packed(backend, items: Sequence[tuple[Prompt, CalibrationConfig]], pack: int, sync_every: int = 1,
               on_result: Callable[[int, CalibrationResult], None] | None = None,
               time_budget_s: float | None = None, best_at: Sequence[int] = (),
               graphs: bool | None = None) -> list[CalibrationResult]:
    """Calibrate every (prompt, config) of `items`, at most `pack` at once (module docstring; PackedRun). With
    on_result(i, res), each result goes there as it finishes (in completion order) and is not kept; without, the
    results come back in the order of `items`. time_budget_s: each item's budget from its start (as
    Calibrator.run's), checked at each read. best_at: step counts at which each item keeps its best X (a read lands
    on each). graphs: capture the pack (None: the run plan's graphs); its length buckets (the plan's) pad each
    slot."""
    run = PackedRun(backend, pack, sync_every, graphs)
    for prompt, config in items:  # every item checked before any work (icleval packs its calibrations here)
        run.add(prompt, config, time_budget_s, best_at)
    results: list[CalibrationResult | None] = [None] * len(items)
    while run.size:
        for i, res in run.interval():
            if on_result is None:
                results[i] = res
            else:
                on_result(i, res)
    return results if on_result is None else []


__all__ = ["PackedStep", "PackedRun", "run_packed"]
