"""The static step's bookkeeping (step.step_state.bookkeep_reference) in two launches instead of ~45 small ops:

    bookkeep(st, f [B] float32, fired int32 [1], cfg)   after ops.update wrote st.X_next

    1. one program: the gate, the best-so-far state (st.best: best_f, counters), patience (with min_delta: from
       st.anchor, stop_rule.improves; compiled out without it), the SNR skip / stop,
       max_steps, the non-finite stop, the history entry, the counters (steps_run, low_snr, projections),
       the stop reason and the step index; it leaves two flags: better (f0 beat best_f) and update (take X_next)
    2. over X: best_X <- X where better, then X <- X_next where update

st: a sicl_fast.step.step_state.StepState (its tensors X, X_next, best, step_t, steps_run, reason, low_snr,
projections, history, anchor, thresholds, flags). cfg: its CalibrationConfig. The comparisons with tau,
snr_threshold and the min_delta margin are in float64, as the reference's; the SNR's mean and standard deviation
are float32 reductions in another order than torch's (differences of an ulp, which can only matter for an SNR
within an ulp of the threshold).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.step.stop_rule import margin_on
from sicl_fast.step.step_state import GATE, MAX_STEPS, NONFINITE, PATIENCE, SNR

from ._utils import launch, launch_config, next_pow2
from .best import copy_config

# the stop reasons as the state stores them (step.step_state), as compile-time constants of the kernel
NONFINITE_C = tl.constexpr(NONFINITE)
GATE_C = tl.constexpr(GATE)
PATIENCE_C = tl.constexpr(PATIENCE)
SNR_C = tl.constexpr(SNR)
MAX_STEPS_C = tl.constexpr(MAX_STEPS)


@triton.jit
def _bookkeep_state_kernel(f_ptr, params_ptr, s_ptr, steps_run_ptr, reason_ptr, low_snr_ptr, proj_ptr, hist_ptr,
                          best_f_ptr, counters_ptr, anchor_ptr, fired_ptr, flags_ptr, N, mu, patience, max_steps,
                          CENTRAL: tl.constexpr, HAS_SNR: tl.constexpr, HAS_PATIENCE: tl.constexpr,
                          HAS_MARGIN: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.load(s_ptr)
    reason = tl.load(reason_ptr)
    active = reason == 0
    f0 = tl.load(f_ptr)
    finite = (f0 == f0) & (tl.abs(f0) < float("inf"))
    ok = active & finite
    tl.store(steps_run_ptr, tl.load(steps_run_ptr) + active.to(tl.int64))
    tl.store(hist_ptr + s, f0, mask=active)
    bad = active & (finite == 0)
    tau = tl.load(params_ptr)
    gate = ok & (s == 0) & (f0.to(tl.float64) < tau)
    # track_best with f0 masked to -inf when not ok (sicl_fast.step.best.track_best)
    fm = tl.where(ok, f0, float("-inf"))
    best = tl.load(best_f_ptr)
    since = tl.load(counters_ptr)
    seen = tl.load(counters_ptr + 2)
    better = fm > best
    tl.store(best_f_ptr, tl.where(better, fm, best))
    if HAS_MARGIN:  # patience counts from the anchor (stop_rule.improves), in float64
        anchor = tl.load(anchor_ptr)
        first = anchor == float("-inf")  # nothing counted yet: any finite f0 counts
        a = tl.where(first, 0.0, anchor).to(tl.float64)
        margin = tl.maximum(tl.load(params_ptr + 3) * tl.abs(a), tl.load(params_ptr + 2))
        counted = (fm > anchor) & (first | (fm.to(tl.float64) - a > margin))
        tl.store(anchor_ptr, tl.where(counted, fm, anchor))
        since = tl.where(counted, 0, since + 1)
    else:
        since = tl.where(better, 0, since + 1)
    tl.store(counters_ptr, since)
    tl.store(counters_ptr + 1, tl.where(better, seen, tl.load(counters_ptr + 1)))
    tl.store(counters_ptr + 2, seen + 1)
    never = ok & (ok == 0)
    stop_patience = never
    if HAS_PATIENCE:
        stop_patience = ok & (gate == 0) & (since >= patience)
    go = ok & (gate == 0) & (stop_patience == 0)
    low = never
    snr_stop = never
    if HAS_SNR:
        i = tl.arange(0, BLOCK_N)
        m = i < N
        if CENTRAL:
            d = (tl.load(f_ptr + 1 + 2 * i, mask=m, other=0.0) - tl.load(f_ptr + 2 + 2 * i, mask=m, other=0.0)) \
                / (2.0 * mu)
        else:
            d = (tl.load(f_ptr + 1 + i, mask=m, other=0.0) - f0) / mu
        d = tl.where(m, d, 0.0)
        mean = tl.sum(d, axis=0) / N
        dev = tl.where(m, d - mean, 0.0)
        std = tl.sqrt(tl.sum(dev * dev, axis=0) / tl.maximum(N - 1, 1))
        snr = tl.where(N >= 2, tl.abs(mean) / (std + 1e-12), 0.0)
        low = go & (snr.to(tl.float64) < tl.load(params_ptr + 1))
        low_snr = tl.load(low_snr_ptr)
        low_snr = tl.where(low, low_snr + 1, tl.where(go, 0, low_snr))
        tl.store(low_snr_ptr, low_snr)
        snr_stop = low & (low_snr >= tl.maximum(patience, 1))
    last = go & (snr_stop == 0) & (s == max_steps - 1)
    update = go & (low == 0) & (last == 0)
    fired = tl.load(fired_ptr)
    tl.store(proj_ptr, tl.load(proj_ptr) + (update & (fired != 0)).to(tl.int64))
    new_reason = (bad.to(tl.int64) * NONFINITE_C + gate.to(tl.int64) * GATE_C + stop_patience.to(tl.int64) * PATIENCE_C
                  + snr_stop.to(tl.int64) * SNR_C + last.to(tl.int64) * MAX_STEPS_C)
    tl.store(reason_ptr, tl.where(active, new_reason, reason))
    tl.store(s_ptr, tl.where(active & (new_reason == 0), s + 1, s))
    tl.store(flags_ptr, better.to(tl.int32))
    tl.store(flags_ptr + 1, update.to(tl.int32))


@triton.jit
def _bookkeep_copy_kernel(flags_ptr, x_ptr, x_next_ptr, best_x_ptr, n, BLOCK: tl.constexpr):
    better = tl.load(flags_ptr)
    update = tl.load(flags_ptr + 1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(best_x_ptr + offs, x, mask=m & (better != 0))
    tl.store(x_ptr + offs, tl.load(x_next_ptr + offs, mask=m), mask=m & (update != 0))


def bookkeep(st, f: torch.Tensor, fired: torch.Tensor, cfg) -> None:
    """The bookkeeping of one step on the device (module docstring); two launches, no host read."""
    N = (f.numel() - 1) // 2 if cfg.estimator == "central" else f.numel() - 1
    dev = st.X.device
    launch(_bookkeep_state_kernel, (1,),
           f, st.thresholds, st.step_t, st.steps_run, st.reason, st.low_snr, st.projections, st.history,
           st.best.best_f, st.best.counters, st.anchor, fired, st.flags, N, float(cfg.mu_eff), int(cfg.patience),
           int(cfg.max_steps), device=dev, CENTRAL=cfg.estimator == "central", HAS_SNR=cfg.snr_threshold > 0,
           HAS_PATIENCE=bool(cfg.patience), HAS_MARGIN=margin_on(cfg), **bookkeep_state_config(N))
    n = st.X.numel()
    copy = copy_config()
    launch(_bookkeep_copy_kernel, (triton.cdiv(n, copy["BLOCK"]),), st.flags, st.X, st.X_next, st.best.best_X, n,
           device=dev, **copy)


def bookkeep_state_config(N: int, interp: bool | None = None) -> dict:
    """BLOCK_N (the N directions' proxies in one tile) and num_warps of the one-program state launch."""
    return launch_config("triton bookkeep", interp, block=next_pow2(N), BLOCK_N=next_pow2(N))
