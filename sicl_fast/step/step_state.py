"""The static step's state: one prompt's calibration held in device tensors, and the torch reference of its
bookkeeping. It sits below the ops and the kernels (which take a StepState, as Liger's launchers take plain
tensors) and below sicl_fast.calibration.static (which owns one and runs its step).

    state = StepState.new(X0, cfg)                                every tensor allocated once, on X0's device
    bookkeep_reference(state, f, fired, cfg)                      one step's bookkeeping, in place (TorchStepOps;
                                                                  kernels/bookkeep.py fuses it)

Stop reasons, as `reason` stores them: RUNNING until a stop, then GATE, PATIENCE, SNR, MAX_STEPS or NONFINITE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .best import BestState, keep_best
from .stop_rule import DEVICE, decide
from .zo import snr_of

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
    anchor: torch.Tensor  # [1] float32: f0 of the last step that counted for patience (stop_rule.improves)
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

    def tensors(self) -> list:
        """Every tensor of the state (the best state's too), in one order: what a step may write."""
        best = self.best
        return [self.X, self.X0, self.X_next, best.best_X, best.best_f, best.counters, *self.counters, self.history,
                self.minus_inf, self.anchor, self.thresholds, self.flags]

    def copy_(self, other: StepState) -> None:
        """Take another state of the same shapes, in place."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)

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
    (int32 [1]); f [B] the step's proxies, cfg its CalibrationConfig: the stopping rule's decisions
    (stop_rule.decide: gate, best X, patience, SNR skip and stop, max_steps) and a non-finite proxy's stop as masked
    updates, with no host read. A stopped state stays as it is (only the best state's counters go on counting)."""
    s = st.step_t
    active = st.reason == RUNNING  # [1] bool
    f0 = f[:1]
    finite = torch.isfinite(f0)
    ok = active & finite
    st.steps_run += active.long()
    st.history.index_copy_(0, s, torch.where(active, f0, st.history.index_select(0, s)))
    bad = active & ~finite
    snr = snr_of(f, cfg.mu_eff, cfg.estimator) if cfg.snr_threshold > 0 else None
    d = decide(DEVICE, s, torch.where(ok, f0, st.minus_inf), ok, st.best.best_f, st.anchor, st.best.counters[:1],
               st.low_snr, snr, cfg)
    keep_best(st.best, d.better, d.best_f, d.since, st.X)
    if d.anchor is not st.anchor:  # kept only with a margin (stop_rule.best_and_patience)
        st.anchor.copy_(d.anchor)
    st.low_snr.copy_(d.low_snr)
    st.X.copy_(torch.where(d.update.view(1, 1), st.X_next, st.X))
    st.projections += (d.update & (fired != 0)).long()
    reason = (bad.long() * NONFINITE + d.gate.long() * GATE + d.patience.long() * PATIENCE
              + d.snr_stop.long() * SNR + d.last.long() * MAX_STEPS)  # at most one is set
    st.reason.copy_(torch.where(active, reason, st.reason))
    s.copy_(torch.where(active & (reason == RUNNING), s + 1, s))


__all__ = ["StepState", "bookkeep_reference", "RUNNING", "GATE", "PATIENCE", "SNR", "MAX_STEPS", "NONFINITE", "REASONS"]
