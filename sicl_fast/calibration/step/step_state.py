"""The static step's state: one prompt's calibration held in device tensors, and the torch reference of its
bookkeeping. It sits below the ops and the kernels (which take a StepState, as Liger's launchers take plain
tensors) and below sicl_fast.calibration.static (which owns one and runs its step).

    state = StepState.new(X0, cfg)                                every tensor allocated once, on X0's device
    bookkeep_reference(state, f, fired, cfg)                       one step's bookkeeping, in place (TorchStepOps;
                                                                  kernels/bookkeep.py fuses it)

Stop reasons, as `reason` stores them: RUNNING until a stop, then GATE, PATIENCE, SNR, MAX_STEPS or NONFINITE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .best import BestState, improved, margin_on, track_best
from .zo import finite_differences

RUNNING, GATE, PATIENCE, SNR, MAX_STEPS, NONFINITE = range(6)
REASONS = {GATE: "gate", PATIENCE: "patience", SNR: "snr", MAX_STEPS: "max_steps"}


@dataclass
class StepState:
    """Device tensors of one calibration (shapes for X [L, d]). X_next: the update's output, taken into X when the
    step's bookkeeping lets it. thresholds: tau, the SNR threshold, min_delta and min_delta_rel in float64, as the
    reference compares them; flags: the fused bookkeeping's two flags (f0 beat the best, X takes X_next)."""

    X: torch.Tensor  # [L, d] float32: the current X
    X0: torch.Tensor  # [L, d] float32: the start (the projection's anchor)
    X_next: torch.Tensor  # [L, d] float32
    best: BestState  # best X, best f0, (since best, best step, steps seen)
    step_t: torch.Tensor  # int64 [1]: the step index, read by the noise kernels
    steps_run: torch.Tensor  # int64 [1]
    reason: torch.Tensor  # int64 [1]: RUNNING until a stop
    low_snr: torch.Tensor  # int64 [1]: low-SNR steps in a row
    projections: torch.Tensor  # int64 [1]
    history: torch.Tensor  # [max_steps] float32: f0 of each step run (NaN after)
    minus_inf: torch.Tensor  # [1] float32
    anchor: torch.Tensor  # [1] float32: f0 of the last step that counted for patience (best.improved)
    thresholds: torch.Tensor  # [4] float64: tau, snr_threshold, min_delta, min_delta_rel
    flags: torch.Tensor  # [2] int32

    @classmethod
    def new(cls, X0: torch.Tensor, cfg) -> StepState:
        """The state of a new calibration from X0 [L, d] (copied, as float32 on its device) with the
        CalibrationConfig cfg (max_steps, tau, snr_threshold, min_delta, min_delta_rel)."""
        dev = X0.device
        X0 = X0.to(dev, torch.float32).contiguous().clone()
        i64 = dict(dtype=torch.int64, device=dev)
        return cls(X=X0.clone(), X0=X0, X_next=torch.empty_like(X0), best=BestState(X0),
                   step_t=torch.zeros(1, **i64), steps_run=torch.zeros(1, **i64), reason=torch.zeros(1, **i64),
                   low_snr=torch.zeros(1, **i64), projections=torch.zeros(1, **i64),
                   history=torch.full((cfg.max_steps,), math.nan, dtype=torch.float32, device=dev),
                   minus_inf=torch.full((1,), -math.inf, dtype=torch.float32, device=dev),
                   anchor=torch.full((1,), -math.inf, dtype=torch.float32, device=dev),
                   thresholds=torch.tensor([cfg.tau, cfg.snr_threshold, cfg.min_delta, cfg.min_delta_rel],
                                           dtype=torch.float64, device=dev),
                   flags=torch.zeros(2, dtype=torch.int32, device=dev))

    @property
    def counters(self) -> tuple:
        return self.step_t, self.steps_run, self.reason, self.low_snr, self.projections

    def reset(self, X0: torch.Tensor) -> None:
        """Start again from X0 [L, d], in place (every tensor keeps its address: a captured graph replays it)."""
        self.X0.copy_(X0)
        self.X.copy_(X0)
        self.best.best_X.copy_(X0)
        self.best.best_f.fill_(-math.inf)
        self.anchor.fill_(-math.inf)
        self.best.counters.zero_()
        for t in self.counters:
            t.zero_()
        self.history.fill_(math.nan)


def bookkeep_reference(st: StepState, f: torch.Tensor, fired: torch.Tensor, cfg) -> None:
    """The bookkeeping of one step on `st`, after the update wrote st.X_next with its projection flag `fired`
    (int32 [1]); f [B] the step's proxies, cfg its CalibrationConfig: the eager loop's decisions (gate, best X,
    patience (with min_delta: best.improved), SNR skip and stop, max_steps, a non-finite proxy) as masked
    updates, with no host read."""
    s = st.step_t
    active = st.reason == RUNNING  # [1] bool
    f0 = f[:1]
    finite = torch.isfinite(f0)
    ok = active & finite
    st.steps_run += active.long()
    st.history.index_copy_(0, s, torch.where(active, f0, st.history.index_select(0, s)))
    bad = active & ~finite
    gate = ok & (s == 0) & (f0.double() < cfg.tau)  # float64, as the eager loop compares python floats
    f0_ok = torch.where(ok, f0, st.minus_inf)
    since = st.best.counters[:1].clone() if margin_on(cfg) else None
    track_best(f0_ok, st.X, st.best)  # the best X; patience's counter as the paper's rule counts it
    if since is not None:  # min_delta: patience counts from the anchor instead (no ops at all without it)
        counted = improved(f0_ok, st.anchor, cfg.min_delta, cfg.min_delta_rel)
        st.anchor.copy_(torch.where(counted, f0_ok, st.anchor))
        st.best.counters[:1].copy_(torch.where(counted, torch.zeros_like(since), since + 1))
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


__all__ = ["StepState", "bookkeep_reference", "RUNNING", "GATE", "PATIENCE", "SNR", "MAX_STEPS", "NONFINITE", "REASONS"]
