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
its prompt and again every REFRESH_EVERY of its own steps (as it would be alone); in a captured layout each slot's
refresh is a graph of its own after its first (PackedStep.refresh). A slot computes what its prompt
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
import weakref
from collections.abc import Callable, Sequence

import torch

from .ascent import CalibrationConfig, CalibrationResult
from ..run.graphs import Captures, ReplayCheck, model_refs, weakly
from ..run.knobs import check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from .static import ReferenceCheck, StaticStep, compare_steps, step_outputs
from .reads import Slot, read, steps_to_read
from .step_plan import plan_step


class PackedStep:
    """One step of every slot through one batched forward (module docstring). set() takes the slots (and says whether
    the pass was laid out again); a call refreshes each slot's reference where its own step count says (outside any
    graph, as run_static does), then runs the step: its captured CUDA graph's replay once capture() made one (the
    step itself elsewhere). captures: the owner of its graphs (sicl_fast.run.graphs.Captures: their stream and
    pool), or None (nothing captured). A layout's graph holds this step only weakly, and goes with the layout: the
    only graph of its stream then (no other replays after it), so it is destroyed at once."""

    def __init__(self, backend, slots: Sequence[StaticStep] = (), captures: Captures | None = None) -> None:
        self.backend, self.captures = backend, captures
        self.forward = backend.packed_forward()
        self.slots: list[StaticStep] = []
        self.calls: list[int] = []  # the steps called on each slot
        self.graph = None  # the captured step of the current layout (capture), or None: the step runs itself
        self.refreshes: dict = {}  # slot -> its captured reference refresh in this layout (refresh)
        self.captured = 0
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
            self.graph = None  # the old layout's graphs first: they read the tensors arrange replaces
            self.refreshes = {}
            self.forward.arrange([st.prompt for st in slots], [st.spec.B for st in slots],
                                 [st.state.X for st in slots], kept, [st.bucket for st in slots])
        else:
            for j in loaded:
                self.forward.load(j, slots[j].prompt, slots[j].state.X)
        self.calls = [self.calls[k] if k is not None else 0 for k in kept]
        self.slots = list(slots)
        return changed

    def capture(self) -> None:
        """Capture the step of this layout in a CUDA graph (where its captures capture nothing: nothing). Call it
        after at least one eager step of the layout, its warm-up (every buffer it makes lazily exists), so that the
        capture itself moves no slot's state."""
        if self.graph is None and self.captures is not None and self.captures.on and self.backend.plan.fallback is None:
            m = self.backend.model
            self.graph = self.captures.capture(weakly(self.step), warmup=0, keep=model_refs(m, self.backend.ops),
                                               check=PackedCheck(self))
            self.captured += 1

    @torch.no_grad()
    def __call__(self) -> None:
        every = self.forward.refresh_every
        for j, st in enumerate(self.slots):
            if every and self.calls[j] and self.calls[j] % every == 0:  # the slot's reference, every few of its steps
                self.refresh(j, st)
            self.calls[j] += 1
        if self.graph is not None:
            self.graph()
        else:
            self.step()

    def refresh(self, j: int, st: StaticStep) -> None:
        """Slot j's reference at its X, in place (PackedForward.refresh): a graph of its own once the layout is
        captured (its replay: one launch where the eager pass makes hundreds, 394 at SmolLM2), captured after
        the slot's first refresh in the layout (which was its warm-up), replayed by the later ones; a slot loaded in
        place keeps it (every tensor it reads is rewritten in place)."""
        graph = self.refreshes.get(j)
        if graph is not None:
            graph()
            return
        self.forward.refresh(j, st.state.X)
        if self.graph is not None:  # the layout is captured: the slot's refresh too, from now on
            m = self.backend.model
            self.refreshes[j] = self.captures.capture(weakly(self.forward.refresh, j, st.state.X), warmup=0,
                                                      keep=model_refs(m, self.backend.ops),
                                                      check=PackedRefreshCheck(self, j))

    def rebind(self, backend) -> None:
        """Run on `backend`'s ops and model from now on (a fallback to the torch ops after a captured layout or
        refresh failed its check: sicl_fast.run.graphs.first_replay), in place: every slot keeps its state and its
        count of calls; the pass is laid out again on backend's forward, each slot's reference taken at its X."""
        slots, calls = self.slots, self.calls
        for st in slots:
            st.rebind(backend)
        self.backend, self.forward = backend, backend.packed_forward()
        self.slots, self.graph, self.refreshes = [], None, {}
        self.set(slots)
        self.calls = calls

    def fall_back(self, to: str, why: str) -> None:
        """A captured layout or refresh failed its check: the backend's plan says so (FastBackend.fall_back), this
        layout's graphs are dropped together (the only graphs of their stream), and with 'torch' the step goes on
        through the torch ops (rebind)."""
        self.backend.fall_back(to, why)
        self.graph, self.refreshes = None, {}
        if to == "torch":
            self.rebind(self.backend)

    @torch.no_grad()
    def step(self) -> None:
        """The step of every slot: no host read, every tensor fixed (capturable)."""
        for st in self.slots:
            st.perturb()
        for st, lp in zip(self.slots, self.forward([st.batch for st in self.slots])):
            st.advance(self.backend.ops.proxy_planned(lp, st.proxy_plan).f)


class PackedCheck(ReplayCheck):
    """The first replay of a packed layout's graph against the same step of every slot on the backend's torch twin
    (FastBackend.torch_twin): each slot a new StaticStep with the slot's state, the twin's pass laid out alike with
    the layout's references copied into it; each slot by compare_steps (sicl_fast.calibration.static). The packed
    step is held weakly (it owns the graph that holds this check)."""

    name = "packed step"

    def __init__(self, step: PackedStep) -> None:
        self.step = weakref.ref(step)
        self.Xs: list = []

    def state(self) -> list:
        return [t for st in self.step().slots for t in st.state.tensors()]

    def reference(self) -> list:
        step = self.step()
        twin = step.backend.torch_twin()
        slots = []
        for st in step.slots:
            t = StaticStep(twin, st.config, st.prompt, st.own(st.state.X0), use_prefix=False, bucket=st.bucket,
                           own_forward=False)
            t.state.copy_(st.state)
            slots.append(t)
        ref = PackedStep(twin, slots)
        fwd = ref.forward
        if fwd.rows_on:  # the layout's references, as the step reads them
            for mine, theirs in zip((*fwd.ref.tensors(), *fwd.z_refs), (*step.forward.ref.tensors(),
                                                                       *step.forward.z_refs)):
                mine.copy_(theirs)
        self.Xs = [st.state.X.clone() for st in step.slots]
        ref.step()
        return [t.clone() for st in slots for t in step_outputs(st)]

    def outputs(self) -> list:
        return [t for st in self.step().slots for t in step_outputs(st)]

    def compare(self, got: list, want: list) -> str | None:
        n = len(got) // len(self.Xs)
        for j, X in enumerate(self.Xs):
            why = compare_steps(got[j * n:(j + 1) * n], want[j * n:(j + 1) * n], X)
            if why:
                return f"slot {j}: {why}"
        return None

    def fall_back(self, to: str, why: str) -> None:
        step = self.step()
        step.fall_back(to, why)
        if to == "torch":
            step.step()


class PackedRefreshCheck(ReferenceCheck):
    """The first replay of a slot's captured refresh (PackedStep.refresh) against the torch twin's packed forward
    with that slot alone, at the same X: the slot's reference rows and logits."""

    name = "packed slot's reference refresh"

    def __init__(self, step: PackedStep, j: int) -> None:
        self.step, self.j = weakref.ref(step), j

    def state(self) -> list:
        fwd, j = self.step().forward, self.j
        b = fwd.spans[j].b
        return [*fwd.ref.rows(j * fwd.T, j * fwd.T + b).tensors(), fwd.z_refs[j]]

    def reference(self) -> list:
        step, j = self.step(), self.j
        st = step.slots[j]
        fwd = step.backend.torch_twin().packed_forward()
        fwd.arrange([st.prompt], [st.spec.B], [st.state.X], None, [st.bucket])
        return [t.clone() for t in (*fwd.ref.rows(0, fwd.spans[0].b).tensors(), fwd.z_refs[0])]

    def fall_back(self, to: str, why: str) -> None:
        self.step().fall_back(to, why)


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
            captures = Captures(self.backend.device) if self.graphs else None
            self.step = PackedStep(self.backend, [s.step for s in self.active], captures=captures)
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


def check_packable(backend, prompts: Sequence[Prompt]) -> None:
    """Refuse (a SiclError naming the lengths) prompts that cannot share a packed pass: their rotary tables differ
    (a rope type whose frequencies depend on the length, past its threshold: Transformer.rope_keys). Any two of a
    packed run's prompts may share a pass (a slot takes the next prompt as one ends), so all of them are checked,
    before any work and before a results file is opened (Engine.check_steps)."""
    backend.model.rope_keys(*(p.length for p in prompts))


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
    check_packable(backend, [p for p, _ in items])
    results: list[CalibrationResult | None] = [None] * len(items)
    while run.size:
        for i, res in run.interval():
            if on_result is None:
                results[i] = res
            else:
                on_result(i, res)
    return results if on_result is None else []


__all__ = ["PackedStep", "PackedRun", "PackedCheck", "PackedRefreshCheck", "check_packable", "run_packed"]
