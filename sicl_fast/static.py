"""The graph-ready ascent: a static step whose whole state lives in preallocated device tensors, and a driver
that reads the state back only every k steps. It computes Algorithm 1 exactly as the readable eager loop
(`Calibrator.run`, the reference) does, and is tested equal to it bit for bit.

    step = StaticStep(backend, config, prompt)      allocates every buffer once
    step()                                          perturb -> forward -> span log-probs -> proxy ->
                                                    best / patience / SNR / stop bookkeeping -> update, in place
    run_static(backend, config, prompt, sync_every=k) -> CalibrationResult

One call of the step reads nothing back to the host: no .item(), no float() / bool() of a tensor, no Python
branch on a tensor value (tests run it under a guard that fails on any). The step index and the stop flag are
device tensors; the noise kernels read the step from the device. Every decision of the eager loop (gate,
patience, SNR skip and stop, max_steps, the projection count, a non-finite proxy) is a masked update of the
state, and once the run has stopped further calls change nothing, so the driver may run past the stop between
two reads. The step allocates no persistent buffer after construction; the forward's temporaries come from
the caching allocator (inside a CUDA graph, from the graph's pool).

Only the fast backend has a sync-free forward (`FastBackend.span_forward`); the prefix K/V of rows [0, a) is
computed once when nothing can change those rows (projection_scope 'demos', or no projection), and on every
step otherwise (the eager loop recomputes it when the whole-matrix projection rescaled them).
"""
from __future__ import annotations

import math
import time

import torch

from .ascent import CalibrationConfig, CalibrationResult, Calibrator
from .best import BestState
from .errors import NumericalError, SiclError
from .graphs import DEFAULT_CAPACITY, ShapeCache, captured, model_refs
from .knobs import check_range
from .proxy import ProxyPlan
from .spans import Prompt
from .zo import finite_differences

# stop reasons, as the state stores them
RUNNING, GATE, PATIENCE, SNR, MAX_STEPS, NONFINITE = range(6)
REASONS = {GATE: "gate", PATIENCE: "patience", SNR: "snr", MAX_STEPS: "max_steps"}


LOOPS = ("auto", "static", "eager")


def default_sync_every(device) -> int:
    """Steps between two reads of the state: 1 on the CPU (a read costs nothing there and the progress stays
    exact); 8 on a GPU (provisional: the GPU engine measures the best k)."""
    return 1 if torch.device(device).type == "cpu" else 8


def supports_static(backend) -> bool:
    """Does the backend have a forward without host reads (FastBackend.span_forward)?"""
    return hasattr(backend, "span_forward")


class StaticStep:
    """One prompt's calibration state on the device and its step (module docstring). `config` with its scale
    resolved (Calibrator does it); X0 [L, d] float32 checked by Calibrator.initial_embeddings. use_prefix=False:
    always the full rows [0, b) (the packed step, sicl_fast.packed, runs prompts without their prefix K/V)."""

    def __init__(self, backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor,
                 use_prefix: bool = True) -> None:
        if not supports_static(backend):
            raise SiclError(f"the static step needs a forward without host reads, which the {backend.name!r} "
                            "backend does not have; use the 'fast' or 'fast-fp32' backend, or the eager loop")
        if config.estimator == "grad":
            raise SiclError("the static and packed steps run the zeroth-order ascent only; estimator 'grad' runs on "
                            "the eager loop (loop 'eager' or 'auto', --loop eager; no --pack)")
        cal = Calibrator(backend, config)
        self.backend, self.ops, self.config, self.prompt = backend, backend.ops, cal.config, prompt
        cfg = self.config
        dev, m = backend.device, backend.model
        self.spec = cal.step_spec(prompt, X0)
        self.span = backend.span_plan(prompt)
        self.plan = ProxyPlan.build(prompt.offsets, int(prompt.positions.numel()), dev, cfg.alpha, cfg.beta,
                                    cfg.gamma, cfg.q)
        self.X0 = X0.to(dev, torch.float32).contiguous().clone()
        self.X = self.X0.clone()
        self.X_next = torch.empty_like(self.X)
        self.batch = torch.empty(self.spec.B, self.spec.b, self.spec.d, dtype=torch.float32, device=dev)
        self.best = BestState(self.X0)
        i64 = dict(dtype=torch.int64, device=dev)
        self.step_t = torch.zeros(1, **i64)  # the step index, read by the noise kernels
        self.steps_run = torch.zeros(1, **i64)
        self.reason = torch.zeros(1, **i64)  # RUNNING until a stop
        self.low_snr = torch.zeros(1, **i64)
        self.projections = torch.zeros(1, **i64)
        self.history = torch.full((cfg.max_steps,), math.nan, dtype=torch.float32, device=dev)
        self.counters = (self.step_t, self.steps_run, self.reason, self.low_snr, self.projections)
        self.minus_inf = torch.full((1,), -math.inf, dtype=torch.float32, device=dev)
        # for the fused bookkeeping (kernels/advance.py): tau and the SNR threshold in float64, as the reference
        # compares them, and its two flags (f0 beat the best, X takes X_next)
        self.thresholds = torch.tensor([cfg.tau, cfg.snr_threshold], dtype=torch.float64, device=dev)
        self.flags = torch.zeros(2, dtype=torch.int32, device=dev)
        a = prompt.demo_start
        self.use_prefix = use_prefix and backend.prefix_cache and a > 0
        rows_fixed = cfg.projection_scope == "demos" or cfg.kappa <= 0  # nothing rescales rows [0, a)
        self.prefix = m.prefix_kv(self.X0[:a].to(m.dtype)) if self.use_prefix and rows_fixed else None

    @staticmethod
    def shape(backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor) -> tuple:
        """What a step's buffers and kernel launches depend on (config resolved, X0 [L, d]). Prompts of one shape
        can share one StaticStep, and its captured graph, through `load`: their spans may differ in place, not in
        count or length, and their texts in everything."""
        spec = Calibrator(backend, config).step_spec(prompt, X0)
        return (config, spec, int(prompt.positions.numel()), len(prompt.token_spans),
                backend.span_plan(prompt).from_prefix)

    def load(self, prompt: Prompt, X0: torch.Tensor) -> None:
        """Re-arm this step for `prompt` (of this step's `shape`) from X0 [L, d]: every tensor the step reads is
        overwritten in place, so a graph captured on this step replays the new prompt, and the state starts as a
        new StaticStep's would."""
        m, cfg, dev = self.backend.model, self.config, self.backend.device
        span = self.backend.span_plan(prompt)
        plan = ProxyPlan.build(prompt.offsets, int(prompt.positions.numel()), dev, cfg.alpha, cfg.beta, cfg.gamma,
                               cfg.q)
        for mine, new in ((self.span.idx, span.idx), (self.span.idx_suffix, span.idx_suffix),
                          (self.span.targets, span.targets), (self.plan.offsets, plan.offsets),
                          (self.plan.offsets_dev, plan.offsets_dev), (self.plan.seg, plan.seg),
                          (self.plan.lengths, plan.lengths)):
            mine.copy_(new)
        self.prompt = prompt
        self.X0.copy_(X0)
        self.X.copy_(X0)
        self.best.best_X.copy_(X0)
        self.best.best_f.fill_(-math.inf)
        self.best.counters.zero_()
        for t in self.counters:
            t.zero_()
        self.history.fill_(math.nan)
        if self.prefix is not None:
            new = m.prefix_kv(self.X0[:prompt.demo_start].to(m.dtype))
            self.prefix.rows.copy_(new.rows)
            self.prefix.hidden.copy_(new.hidden)
            for (k, v), (k_new, v_new) in zip(self.prefix.kv, new.kv):
                k.copy_(k_new)
                v.copy_(v_new)

    def _prefix(self):
        if not self.use_prefix:
            return None
        if self.prefix is not None:
            return self.prefix
        m = self.backend.model
        return m.prefix_kv(self.X[:self.prompt.demo_start].to(m.dtype))

    @torch.no_grad()
    def __call__(self) -> None:
        """One step of Algorithm 1 on the device state (module docstring)."""
        self.perturb()
        self.advance(self.evaluate())

    def perturb(self) -> None:
        """The perturbation batch of this step into self.batch [B, b, d]."""
        self.ops.perturb(self.X, self.step_t, self.spec, out=self.batch)

    def evaluate(self) -> torch.Tensor:
        """f [B] of self.batch: the forward, the span head and the proxy."""
        m = self.backend.model
        x = self.batch[:, :self.prompt.demo_end].to(m.dtype)
        lp = self.backend.span_forward(x, self.span, self._prefix(), near_row0=True)
        return self.ops.proxy_planned(lp, self.plan).f

    def advance(self, f: torch.Tensor) -> None:
        """The update of X (into X_next) and the bookkeeping of the step whose batch gave f [B] (gate, best X,
        patience, SNR, stops), all as masked updates of the device state (advance_reference)."""
        _, fired = self.ops.update(self.X, self.X0, f, self.step_t, self.spec, out=self.X_next)
        self.ops.advance(self, f, fired, self.config)

    def result(self, seconds: float, stop_reason: str | None = None) -> CalibrationResult:
        """The CalibrationResult of a stopped run (reads the state: host syncs). stop_reason: a run ended from
        outside (should_stop), with the best X so far."""
        reason, n = int(self.reason), int(self.steps_run)
        history = self.history[:n].tolist()
        if reason == NONFINITE:
            raise NumericalError(f"request {self.prompt.id!r}: the proxy is {history[-1]} at step {n - 1}")
        return CalibrationResult(
            embeddings=self.best.best_X.clone(), initial_proxy=history[0], best_proxy=float(self.best.best_f),
            steps=n, best_step=self.best.best_step, gated=reason == GATE, stop_reason=stop_reason or REASONS[reason],
            history=history, seconds=seconds, projections=int(self.projections), config=self.config,
            impl=self.ops.name,
        )


def advance_reference(st: StaticStep, f: torch.Tensor, fired: torch.Tensor, cfg: CalibrationConfig) -> None:
    """The bookkeeping of one step on the state of `st` (a StaticStep), after ops.update wrote st.X_next with
    its projection flag `fired` (int32 [1]): the eager loop's decisions as masked updates, in torch (TorchOps
    runs it; kernels/advance.py fuses it)."""
    s = st.step_t
    active = st.reason == RUNNING  # [1] bool
    f0 = f[:1]
    finite = torch.isfinite(f0)
    ok = active & finite
    st.steps_run += active.long()
    st.history.index_copy_(0, s, torch.where(active, f0, st.history.index_select(0, s)))
    bad = active & ~finite
    gate = ok & (s == 0) & (f0.double() < cfg.tau)  # float64, as the eager loop compares python floats
    st.ops.track_best(torch.where(ok, f0, st.minus_inf), st.X, st.best)
    patience = ok & ~gate & (st.best.counters[:1] >= cfg.patience) if cfg.patience else torch.zeros_like(ok)
    go = ok & ~gate & ~patience  # the eager loop gets past its stop checks
    if cfg.snr_threshold > 0:
        d = finite_differences(f, cfg.mu_eff, cfg.estimator)
        snr = (d.mean().abs() / (d.std() + 1e-12)).reshape(1) if d.numel() >= 2 else torch.zeros_like(f0)
        low = go & (snr.double() < cfg.snr_threshold)
        st.low_snr.copy_(torch.where(low, st.low_snr + 1, torch.where(go, 0, st.low_snr)))
        snr_stop = low & (st.low_snr >= max(cfg.patience, 1))
    else:
        low = snr_stop = torch.zeros_like(ok)
    last = go & ~snr_stop & (s == cfg.max_steps - 1)
    update = go & ~low & ~last
    st.X.copy_(torch.where(update.view(1, 1), st.X_next, st.X))
    st.projections += (update & (fired != 0)).long()
    reason = (bad.long() * NONFINITE + gate.long() * GATE + patience.long() * PATIENCE
              + snr_stop.long() * SNR + last.long() * MAX_STEPS)  # at most one is set
    st.reason.copy_(torch.where(active, reason, st.reason))
    s.copy_(torch.where(active & (reason == RUNNING), s + 1, s))


class StepCache:
    """Static steps kept per prompt shape (StaticStep.shape), each with its captured CUDA graph on CUDA (the step
    itself elsewhere), at most `capacity` of them (least recently used dropped). get() re-arms the step of the
    prompt's shape for that prompt (StaticStep.load), building and capturing it on the first prompt of a shape."""

    def __init__(self, device, capacity: int = DEFAULT_CAPACITY) -> None:
        self.device = torch.device(device)
        self.cache = ShapeCache(capacity)

    def get(self, backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor):
        """(step, run): the StaticStep armed for prompt from X0 [L, d] (config resolved), and the callable that
        runs one step of it (its graph's replay on CUDA)."""
        def build():
            st = StaticStep(backend, config, prompt, X0)
            return st, captured(st, self.device, keep=model_refs(backend.model, backend.ops))

        (st, run), hit = self.cache.get(StaticStep.shape(backend, config, prompt, X0), build)
        if hit or run is not st:  # a used step, or the capture's warm-up steps moved the new one's state
            st.load(prompt, X0)
        return st, run


def run_static(backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor | None = None,
               sync_every: int = 1, on_step=None, should_stop=None, steps: StepCache | None = None,
               on_update=None) -> CalibrationResult:
    """Calibrate one prompt with the static step, reading its state back every `sync_every` steps. Returns the
    CalibrationResult the eager loop would (history, best_step, stop_reason, steps, projections, embeddings).
    should_stop: as Calibrator.run's, checked at each read; a returned string ends the run with that stop_reason
    and the best X so far. steps: a StepCache to take the step (and its graph) from; None: a new step.
    on_update(X): called with the state's X [L, d] after every step (device work only, no host read)."""
    check_range("sync_every", sync_every, "run_static")
    t0 = time.perf_counter()
    cal = Calibrator(backend, config)
    X0 = cal.initial_embeddings(prompt, X0)
    if steps is None:
        st = run = StaticStep(backend, cal.config, prompt, X0)
    else:
        st, run = steps.get(backend, cal.config, prompt, X0)
    reported = n = 0
    while True:
        for _ in range(min(sync_every, cal.config.max_steps - n)):  # no calls past the last step the run can take
            run()
            if on_update is not None:
                on_update(st.X)
        done, n = int(st.reason) != RUNNING, int(st.steps_run)  # the one read per sync_every steps
        if on_step is not None and n > reported:
            for i, v in enumerate(st.history[reported:n].tolist(), start=reported):
                on_step(i, v)
            reported = n
        if done:
            break
        reason = should_stop() if should_stop is not None else None
        if reason:
            return st.result(time.perf_counter() - t0, stop_reason=reason)
    return st.result(time.perf_counter() - t0)


__all__ = ["StaticStep", "StepCache", "advance_reference", "run_static", "supports_static", "default_sync_every", "LOOPS"]
