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

import torch

from .ascent import CalibrationConfig, CalibrationResult
from ..errors import NumericalError
from ..run.graphs import DEFAULT_CAPACITY, ShapeCache, captured, model_refs, shared_pool
from ..run.memory import cache_budget
from ..run.knobs import check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from ..step.spec import resolve_scale
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
            plan = StepPlan.of(backend, resolve_scale(config, backend.lm), prompt, X0, bucket, use_prefix)
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
        return StepPlan.of(backend, resolve_scale(config, backend.lm), prompt, X0, bucket, use_prefix).shape

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
    """Static steps kept per prompt shape (StepPlan.shape), each with its captured CUDA graph on CUDA (the step
    itself elsewhere), at most `capacity` of them and at most `budget` bytes (least recently used dropped first).
    get() re-arms the step of the plan's shape for the plan's prompt (StaticStep.load), building and capturing it on
    the first prompt of a shape. buckets: length buckets a doubling (sicl_fast.run.buckets; the run plan's
    length_buckets; plan_step pads a prompt to its bucket), so that prompts of nearby lengths share a step and its
    graph; None: one step a shape. On CUDA
    every graph draws its temporaries from one memory pool (graphs replay one at a time, so they can share it: a new
    bucket adds its buffers, not another pool).

    The bytes: what each kept step holds (its plan's: sicl_fast.run.memory.step_bytes, counted from the shapes before
    it is built: its state, batch, prefix K/V, value rows' reference and logits, the pass K/V its graph holds) and once
    the largest step's activations (the shared pool's). budget None: cache_budget, a share of the memory available
    when the cache is made (the same rule on a CPU, where kept steps take RAM)."""

    def __init__(self, device, capacity: int = DEFAULT_CAPACITY, buckets: int | None = None,
                 budget: int | None = None) -> None:
        self.device = torch.device(device)
        self.budget = cache_budget(self.device) if budget is None else budget
        self.cache = ShapeCache(capacity, self.budget)
        self.buckets = buckets
        self.pool = shared_pool(self.device)

    @property
    def held(self) -> int:
        """The bytes the kept steps hold (what dropping them all would give back)."""
        return self.cache.held()

    def get(self, backend, plan: StepPlan, X0: torch.Tensor):
        """(step, run): the StaticStep of `plan` (plan_step's, padded to this cache's buckets) armed for its prompt
        from X0 [L, d], and the callable that runs one step of it (its graph's replay on CUDA)."""

        def build():
            st = StaticStep.planned(backend, plan, X0)
            keep = model_refs(backend.model, backend.ops)
            run = captured(st, self.device, keep=keep, pool=self.pool)
            # the forward's refresh of its reference at the state's X: a graph of its own on the same pool
            st.forward.capture_refresh(st.state.X, self.device, keep=keep, pool=self.pool)
            return st, run

        (st, run), hit = self.cache.get(plan.shape, build, (plan.bytes.kept, plan.bytes.activations))
        if hit or run is not st:  # a used step, or the capture's warm-up steps moved the new one's state
            st.load(plan, X0)
        return st, run


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


__all__ = ["StaticStep", "StepCache", "run_static"]
