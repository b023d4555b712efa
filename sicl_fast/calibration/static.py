"""The graph-ready ascent: a static step whose whole state lives in preallocated device tensors, and a driver
that reads the state back only every k steps. It computes Algorithm 1 exactly as the readable eager loop
(`Calibrator.run`, the reference) does, and is tested equal to it bit for bit.

    step = StaticStep(backend, config, prompt, X0)  allocates every buffer once
    step = StaticStep.planned(backend, plan, X0)    the same from the prompt's StepPlan (sicl_fast.calibration.
                                                    step_plan: its spec, bucket, proxy plan, forward policy and
                                                    bytes, each worked out once, with the entry checks)
    step()                                          perturb -> forward -> span log-probs -> proxy ->
                                                    best / patience / SNR / stop bookkeeping -> update, in place
    run_static(backend, config, prompt, sync_every=k) -> CalibrationResult
    StepCache(device, capacity, buckets, budget)    steps (and their CUDA graphs: the step's, and its forward's
                                                    reference refresh's) kept per prompt shape, bounded in count
                                                    and bytes; with length buckets (sicl_fast.run.buckets)
                                                    prompts of nearby lengths run padded to one shape and share a
                                                    step

One call of the step reads nothing back to the host: no .item(), no float() / bool() of a tensor, no Python
branch on a tensor value (tests run it under a guard that fails on any). The step index and the stop flag are
device tensors; the noise kernels read the step from the device. Every decision of the eager loop (gate,
patience, SNR skip and stop, max_steps, the projection count, a non-finite proxy) is a masked update of the
state, and once the run has stopped further calls change nothing, so the driver may run past the stop between
two reads. The step allocates no persistent buffer after construction; the forward's temporaries come from
the caching allocator (inside a CUDA graph, from the graph's pool).

Only the fast backend has a sync-free forward: its StepForward (sicl_fast.backends.step_forward), the same object
the eager loop runs, which owns the prefix policy (the prefix K/V of rows [0, a) computed once when nothing can change
those rows, projection_scope 'demos' or no projection; else run in every step's pass), the span plan and the
weight layout.
"""
from __future__ import annotations

import time
import weakref

import torch

from .ascent import CalibrationConfig, CalibrationResult
from ..errors import NumericalError
from ..run.graphs import DEFAULT_CAPACITY, Captures, ReplayCheck, ShapeCache, model_refs, off_by
from ..run.memory import cache_budget
from ..run.knobs import check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from ..run.buckets import Bucket
from .reads import Slot, read, steps_to_read
from .step_plan import StepPlan, plan_step
from ..step.step_state import GATE, NONFINITE, REASONS, StepState


class StaticStep:
    """One prompt's calibration state on the device (`state`, a StepState) and its step (module docstring). X0
    [L, d] float32, checked (sicl_fast.run.checks.calibration_inputs). use_prefix=False: always the full rows [0, b)
    (the packed step, sicl_fast.calibration.packed, runs prompts without their prefix K/V). bucket: a length bucket
    (sicl_fast.run.buckets.Bucket) the step runs padded to, so that prompts of other lengths in it share this step
    and its graph (load); the state then holds X [bucket.length, d], whose first L rows are the prompt's (own).
    own_forward=False: no forward of its own (`forward` None: a packed step's slot, whose batch goes through the
    packed forward). plan: the prompt's StepPlan where the caller made one (StaticStep.planned); else the step plans
    itself from config, prompt, X0, use_prefix and bucket (sicl_fast.calibration.step_plan.StepPlan.of)."""

    def __init__(self, backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor,
                 use_prefix: bool = True, bucket: Bucket | None = None, own_forward: bool = True,
                 plan: StepPlan | None = None) -> None:
        backend.plan.require_sync_free("step")
        backend.plan.check_zeroth_order(config.estimator)
        if plan is None:
            plan = StepPlan.of(backend, config.resolve_scale(backend.lm), prompt, X0, bucket, use_prefix)
        self.backend, self.ops, self.prompt, self.bucket = backend, backend.ops, plan.prompt, plan.bucket
        self.config, self.spec = plan.config, plan.spec
        dev = backend.device
        # the block's own end, read on the device by the noise kernels and the update (None: the spec's b)
        self.rows_end = None if plan.rows_end is None else torch.tensor([plan.rows_end], device=dev)
        self.proxy_plan = plan.proxy  # the step's own from here: load() writes the next prompt's into it
        self.state = StepState.new(self.padded(X0.to(dev)), self.config)
        self.batch = torch.empty(self.spec.B, self.spec.b, self.spec.d, dtype=torch.float32, device=dev)
        self.forward = backend.step_forward(plan.prompt, plan.policy, self.spec.B, self.state.X0,
                                            bucket=plan.bucket) if own_forward else None

    @classmethod
    def planned(cls, backend, plan: StepPlan, X0: torch.Tensor, own_forward: bool = True) -> StaticStep:
        """The step of a StepPlan (plan_step's, made with the entry checks) from X0 [L, d] float32."""
        return cls(backend, plan.config, plan.prompt, X0, bucket=plan.bucket, own_forward=own_forward, plan=plan)

    def padded(self, X: torch.Tensor) -> torch.Tensor:
        """X [L, d] as the state holds it: followed by zero rows up to the bucket's length (X itself: no bucket)."""
        pad = self.spec.L - X.shape[0]
        return torch.cat([X, X.new_zeros(pad, X.shape[1])]) if pad else X

    def own(self, X: torch.Tensor) -> torch.Tensor:
        """The prompt's rows [L, d] of a state tensor [spec.L, d] (a view)."""
        return X[:self.prompt.length]

    @staticmethod
    def shape(backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor,
              bucket: Bucket | None = None, use_prefix: bool = True) -> tuple:
        """What a step's buffers and kernel launches depend on (X0 [L, d]): its plan's shape (StepPlan.shape)."""
        return StepPlan.of(backend, config.resolve_scale(backend.lm), prompt, X0, bucket, use_prefix).shape

    def load(self, plan: StepPlan, X0: torch.Tensor) -> None:
        """Re-arm this step for the prompt of `plan` (of this step's shape: StepPlan.shape) from X0 [L, d]: every
        tensor the step reads is overwritten in place (the plan's proxy plan and block end among them), so a graph
        captured on this step replays the new prompt, and the state starts as a new StaticStep's would."""
        self.proxy_plan.copy_(plan.proxy)
        if self.rows_end is not None:
            self.rows_end.fill_(plan.rows_end)
        self.prompt = plan.prompt
        self.state.reset(self.padded(X0.to(self.backend.device)))
        if self.forward is not None:
            self.forward.load(plan.prompt, self.state.X0)

    def rebind(self, backend) -> None:
        """Run on `backend`'s ops and model from now on (a fallback to the torch ops after a captured step failed
        its check: sicl_fast.run.graphs.first_replay), in place: the state and the proxy plan kept, the forward made
        anew on `backend`, its reference taken at the state's X."""
        self.backend, self.ops = backend, backend.ops
        if self.forward is not None:
            old = self.forward
            self.forward = backend.step_forward(self.prompt, old.policy, self.spec.B, self.state.X0,
                                                bucket=self.bucket)
            self.forward.refresh(self.state.X)

    @torch.no_grad()
    def __call__(self) -> None:
        """One step of Algorithm 1 on the device state (module docstring)."""
        self.perturb()
        self.advance(self.evaluate())

    def perturb(self) -> None:
        """The perturbation batch of this step into self.batch [B, b, d]."""
        self.ops.perturb(self.state.X, self.state.step_t, self.spec, out=self.batch, rows_end=self.rows_end)

    def evaluate(self) -> torch.Tensor:
        """f [B] of self.batch: the forward (decoder and span head) and the proxy."""
        return self.ops.proxy_planned(self.forward(self.batch), self.proxy_plan).f

    def advance(self, f: torch.Tensor) -> None:
        """The update of X (into X_next) and the bookkeeping of the step whose batch gave f [B] (gate, best X,
        patience, SNR, stops), all as masked updates of the device state (sicl_fast.step.step_state)."""
        st = self.state
        _, fired = self.ops.update(st.X, st.X0, f, st.step_t, self.spec, out=st.X_next, rows_end=self.rows_end)
        self.ops.bookkeep(st, f, fired, self.config)

    def result(self, seconds: float, stop_reason: str | None = None, best_at: BestAt | None = None
               ) -> CalibrationResult:
        """The CalibrationResult of a stopped run (reads the state: host syncs). stop_reason: a run ended from
        outside (should_stop, the time budget), with the best X so far. best_at: what the run kept along the way."""
        st = self.state
        reason, n = int(st.reason), int(st.steps_run)
        history = st.history[:n].tolist()
        if reason == NONFINITE:
            raise NumericalError(f"request {self.prompt.id!r}: the proxy is {history[-1]} at step {n - 1}")
        return CalibrationResult(
            embeddings=self.own(st.best.best_X).clone(), initial_proxy=history[0], best_proxy=float(st.best.best_f),
            steps=n, best_step=st.best.best_step, gated=reason == GATE, stop_reason=stop_reason or REASONS[reason],
            history=history, seconds=seconds, projections=int(st.projections), config=self.config,
            impl=self.ops.name, best_at=best_at.kept if best_at is not None else {},
        )


class StepCache:
    """Static steps kept per prompt shape (StepPlan.shape), each with its captured CUDA graph on CUDA unless
    graphs=False (the step itself elsewhere), at most `capacity` of them and at most `budget` bytes (least recently
    used dropped first). get() re-arms the step of the plan's shape for the plan's prompt (StaticStep.load), building
    and capturing it on the first prompt of a shape. buckets: length buckets a doubling (sicl_fast.run.buckets; the
    run plan's length_buckets; plan_step pads a prompt to its bucket), so that prompts of nearby lengths share a step
    and its graph; None: one step a shape. The graphs are one owner's (sicl_fast.run.graphs.Captures): one capture
    stream, and one memory pool for their temporaries (graphs replay one at a time, so they can share it: a new
    bucket adds its buffers, not another pool); a dropped step's graphs are destroyed, or retired where the torch
    version frees a stream's cuBLAS workspaces with any of its graphs (run.graphs, the workspace hazard).

    The bytes: what each kept step holds (its plan's: sicl_fast.run.memory.step_bytes, counted from the shapes before
    it is built: its state, batch, prefix K/V, value rows' reference and logits, the pass K/V its graph holds) and once
    the largest step's activations (the shared pool's), with a captured step's room for the step its first replay is
    checked against (StepCheck: transient, counted with the temporaries). budget None: cache_budget, a share of the
    memory available when the cache is made (the same rule on a CPU, where kept steps take RAM). A dropped step is
    freed by reference counting as it leaves the cache (neither it nor its graphs hold each other), before the next
    step is built."""

    def __init__(self, device, capacity: int = DEFAULT_CAPACITY, buckets: int | None = None,
                 budget: int | None = None, graphs: bool = True) -> None:
        self.device = torch.device(device)
        self.budget = cache_budget(self.device) if budget is None else budget
        self.captures = Captures(self.device) if graphs else None
        self.cache = ShapeCache(capacity, self.budget, self.captures, graphs_of=_graphs_of)
        self.buckets = buckets

    @property
    def pool(self):
        """The memory pool of the steps' graphs (None: none captured)."""
        return None if self.captures is None else self.captures.pool

    @property
    def held(self) -> int:
        """The bytes the kept steps hold (what dropping them all would give back)."""
        return self.cache.held()

    def get(self, backend, plan: StepPlan, X0: torch.Tensor):
        """(step, run): the StaticStep of `plan` (plan_step's, padded to this cache's buckets) armed for its prompt
        from X0 [L, d], and the callable that runs one step of it (its graph's replay on CUDA)."""

        def build():
            st = StaticStep.planned(backend, plan, X0)
            if self.captures is None or not self.captures.on or backend.plan.fallback is not None:
                return st, st
            keep = model_refs(backend.model, backend.ops)
            run = self.captures.capture(st, keep=keep, check=StepCheck(st))
            # the forward's refresh of its reference at the state's X: a graph of its own on the same pool
            st.forward.capture_refresh(st.state.X, self.captures, keep=keep, check=RefreshCheck(st))
            return st, run

        # a new capture's first replay is checked against a step of its own on the torch ops (StepCheck), made and
        # dropped beside it: room for one more step's kept bytes, counted with the temporaries
        checked = self.captures is not None and self.captures.on and backend.plan.fallback is None
        twin = plan.bytes.kept if checked else 0
        # the fallback in the key: after one (first_replay) every step is made anew, as the plan now says (uncaptured,
        # on the torch ops where it says so), none taken from before
        key = (plan.shape, backend.plan.fallback)
        (st, run), hit = self.cache.get(key, build, (plan.bytes.kept, plan.bytes.activations + twin))
        if hit or run is not st:  # a used step, or the capture's warm-up steps moved the new one's state
            st.load(plan, X0)
        return st, run


# the first replay of a captured step against the torch ops' step (sicl_fast.run.graphs.first_replay): f0 (the history)
# within 1e-3 (1 + |f0|) (float32 sums in another order through every layer, and a bf16 difference product rounding a
# last bit differently, move it by far less), the update X_next and X within 5 % of the step's move (the move is a sum
# of the rows' proxies' differences over mu, each a few ulps of f apart: a per cent at most) plus 1e-6 of X, the
# counters and the stop reason equal
F0_TOL, MOVE_TOL = 1e-3, 0.05


def compare_steps(got: list, want: list, X: torch.Tensor) -> str | None:
    """Why a step's outputs (step_outputs) are not the reference's (the tolerances above), X the state's X before
    the step; or None."""
    hist, X_next, X_new, *counters = got
    w_hist, w_next, w_new, *w_counters = want
    move = float((w_next - X).abs().max()) * MOVE_TOL + 1e-6 * float(X.abs().max())
    for why in (off_by("f0 (the history)", hist, w_hist, F0_TOL * (1 + float(w_hist.nan_to_num().abs().max()))),
                off_by("the update X_next", X_next, w_next, move), off_by("X", X_new, w_new, move)):
        if why:
            return why
    if not all(torch.equal(a, b) for a, b in zip(counters, w_counters)):
        return "the step's counters or stop reason differ"
    return None


def step_outputs(st) -> list:
    """What a step's first replay is compared by (compare_steps): history, X_next, X, step index, steps run, stop
    reason, projections."""
    s = st.state
    return [s.history, s.X_next, s.X, s.step_t, s.steps_run, s.reason, s.projections]


class StepCheck(ReplayCheck):
    """The first replay of a StaticStep's graph (StepCache) against a new step of the same prompt on the backend's
    torch twin (FastBackend.torch_twin) from the same state: compare_steps. The step is held weakly (it owns the
    graph that holds this check)."""

    name = "static step"

    def __init__(self, st: StaticStep) -> None:
        self.st = weakref.ref(st)
        self.X = None

    def state(self) -> list:
        return self.st().state.tensors()

    def reference(self) -> list:
        st = self.st()
        twin = StaticStep(st.backend.torch_twin(), st.config, st.prompt, st.own(st.state.X0), bucket=st.bucket)
        twin.state.copy_(st.state)
        self.X = st.state.X.clone()
        twin()
        return [t.clone() for t in step_outputs(twin)]

    def outputs(self) -> list:
        return step_outputs(self.st())

    def compare(self, got: list, want: list) -> str | None:
        return compare_steps(got, want, self.X)

    def fall_back(self, to: str, why: str) -> None:
        st = self.st()
        st.backend.fall_back(to, why)
        if to == "torch":
            st.rebind(st.backend)
            st()


# a refresh's first replay against the torch ops' (RefreshCheck, the packed slots' too): every tensor of the value
# rows' reference, and their logits, within 1e-3 of its largest magnitude (float32 sums in another order; a wrong
# kernel or a stale graph is off by far more)
REF_TOL = 1e-3


def compare_references(got: list, want: list) -> str | None:
    """Why a refresh's tensors (the reference's, then the logits) are not the reference's (REF_TOL); or None."""
    for i, (g, w) in enumerate(zip(got, want)):
        why = off_by(f"the reference's tensor {i}", g, w, REF_TOL * float(w.abs().max()) + 1e-30)
        if why:
            return why
    return None


class ReferenceCheck(ReplayCheck):
    """The first replay of a refresh (a static step's, a packed slot's): what it writes, the value rows' reference
    and their logits (state()), is what it outputs, compared with the torch twin's by compare_references."""

    def outputs(self) -> list:
        return self.state()

    def compare(self, got: list, want: list) -> str | None:
        return compare_references(got, want)


class RefreshCheck(ReferenceCheck):
    """The first replay of a StaticStep's forward's refresh graph (StepForward.capture_refresh) against the torch
    twin's forward's reference at the same X."""

    name = "reference refresh"

    def __init__(self, st: StaticStep) -> None:
        self.st = weakref.ref(st)

    def state(self) -> list:
        fwd = self.st().forward
        return [*fwd.ref.tensors(), fwd.z_ref]

    def reference(self) -> list:
        st = self.st()
        fwd = st.forward
        twin = st.backend.torch_twin().step_forward(st.prompt, fwd.policy, st.spec.B, st.state.X, bucket=st.bucket)
        return [t.clone() for t in (*twin.ref.tensors(), twin.z_ref)]

    def fall_back(self, to: str, why: str) -> None:
        st = self.st()
        st.backend.fall_back(to, why)
        if to == "torch":
            st.rebind(st.backend)  # its new forward's reference is at the state's X


def _graphs_of(entry) -> list:
    """The graphs of a StepCache entry (step, run): the step's and its forward's refresh's."""
    st, run = entry
    return [run, st.forward.refresh_graph]


def run_static(backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor | None = None,
               sync_every: int | None = None, on_step=None, should_stop=None, steps: StepCache | None = None,
               on_update=None, time_budget_s: float | None = None, best_at: BestAt | None = None
               ) -> CalibrationResult:
    """Calibrate one prompt with the static step, reading its state back every `sync_every` steps (None: the
    backend's run plan's). Returns the CalibrationResult the eager loop would (history, best_step, stop_reason,
    steps, projections, embeddings). should_stop and time_budget_s: as Calibrator.run's, checked at each read; a
    stop ends the run with its stop_reason and the best X so far. best_at: the best X after its step counts (a read
    lands on each). steps: a StepCache to take the step (and its graph) from; None: a new step. on_update(X):
    called with the state's X [L, d] after every step (device work only, no host read)."""
    sync_every = backend.plan.sync_every if sync_every is None else sync_every
    check_range("sync_every", sync_every, "run_static")
    t0 = time.perf_counter()
    should_stop = stop_check(should_stop, check_budget(time_budget_s, "run_static"), t0)
    best_at = best_at if best_at is not None else BestAt()
    plan, X0 = plan_step(backend, config, prompt, X0, None if steps is None else steps.buckets,
                         best_at.copies(config.max_steps), reclaimable=0 if steps is None else steps.held)
    if steps is None:
        st = run = StaticStep.planned(backend, plan, X0)
    else:
        st, run = steps.get(backend, plan, X0)
    slot = Slot(st, t0, best_at, should_stop, on_step)
    every = st.forward.refresh_every
    while True:
        for _ in range(steps_to_read([slot], sync_every)):
            if every and slot.calls and slot.calls % every == 0:  # as the eager loop: the forward's reference of X,
                st.forward.refresh(st.state.X)  # in place between two steps (its own graph where StepCache made one)
            run()
            slot.calls += 1
            if on_update is not None:
                on_update(st.own(st.state.X))
        (reason, n), = read([slot])
        result = slot.settle(reason, n)
        if result is not None:
            return result


__all__ = ["StaticStep", "StepCache", "StepCheck", "ReferenceCheck", "RefreshCheck", "compare_steps",
           "compare_references", "step_outputs", "run_static", "F0_TOL", "MOVE_TOL", "REF_TOL"]
