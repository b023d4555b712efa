"""The one stopping rule of the ascent: what a step's f0 and the SNR of its estimate decide. It is written once, over
an arithmetic `a`, so that the eager loop (Calibrator.run) runs it on python numbers (HOST) and the static and packed
steps' bookkeeping (step_state.bookkeep_reference) on [1] device tensors with no host read (DEVICE):

    d = decide(a, s, f0, ok, best_f, anchor, since, low_snr, snr, cfg)
        s        the step index                        f0       the step's proxy at X (f[0]; -inf where not ok)
        ok       f0 is finite (on the device: and the run has not stopped)
        best_f   the best f0 so far (-inf before)      anchor   f0 of the last counted improvement (-inf before)
        since    steps since the last counted improvement
        low_snr  low-SNR steps in a row                snr      zo.snr of the step's f (read with snr_threshold > 0)
    -> Decision: better (f0 beat best_f: X becomes the best X), the state after the step (best_f, anchor, since,
       low_snr), the stops (gate, patience, snr_stop, last: the step was the last one) and whether the update is
       skipped for a low SNR (low) or taken (update)

Algorithm 1 with its knobs (CalibrationConfig): step 0 below tau stops at once (the gate); the best X is the X with
the highest f0; patience counts the steps since f0 last counted as an improvement: beating the anchor by more than
max(min_delta, min_delta_rel * |anchor|) (improves; with both 0, any better f0: the paper's rule, the anchor is then
best_f and is not kept); a step whose estimate has SNR < snr_threshold skips its update, and `max(patience, 1)` such
steps in a row stop the run; the step max_steps - 1 is the last. The comparisons the eager loop makes on python
floats (float64) run in float64 on the device, so both forms decide alike (tests/test_ascent.py). The fused forms,
C++ (csrc/step_state.cpp) and Triton (kernels/bookkeep.py), are this rule in their languages, tested against its
device form (tests/test_ops.py).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


class Host:
    """Python numbers: bool, int, float (a float32 proxy read back is exact in a python float)."""

    @staticmethod
    def where(c, x, y):
        return x if c else y

    @staticmethod
    def not_(c):
        return not c

    @staticmethod
    def f64(x):
        return float(x)

    @staticmethod
    def at_least(x, lo):
        return max(lo, x)

    @staticmethod
    def false(like):
        return False


class Device:
    """[1] tensors on any device: bool masks, the counters' integers, float32 proxies compared in float64."""

    where = staticmethod(torch.where)
    not_ = staticmethod(torch.logical_not)
    false = staticmethod(torch.zeros_like)

    @staticmethod
    def f64(x):
        return x.double()

    @staticmethod
    def at_least(x, lo):
        return torch.clamp(x, min=lo)


HOST, DEVICE = Host(), Device()


class Decision(NamedTuple):
    better: Any
    best_f: Any
    anchor: Any
    since: Any
    low_snr: Any
    gate: Any
    patience: Any
    low: Any
    snr_stop: Any
    last: Any
    update: Any


def margin_on(cfg) -> bool:
    """Does `cfg` ask more of an improvement than the paper's rule (min_delta or min_delta_rel > 0)?"""
    return cfg.min_delta > 0 or cfg.min_delta_rel > 0


def improves(a, f0, anchor, min_delta: float, min_delta_rel: float):
    """Does f0 count as an improvement over `anchor` (module docstring)? False for NaN; anything finite beats an
    anchor of -inf. The margin in float64."""
    first = anchor == -math.inf
    base = a.f64(a.where(first, 0.0, anchor))
    return (f0 > anchor) & (first | (a.f64(f0) - base > a.at_least(min_delta_rel * abs(base), min_delta)))


def best_and_patience(a, f0, best_f, anchor, since, min_delta: float = 0.0, min_delta_rel: float = 0.0) -> tuple:
    """(better, best_f, anchor, since) after a step with proxy f0: the best f0, and the patience counter counted
    from the anchor (from best_f with no margin: the anchor is then returned as given)."""
    better = f0 > best_f
    if min_delta > 0 or min_delta_rel > 0:
        counted = improves(a, f0, anchor, min_delta, min_delta_rel)
        anchor = a.where(counted, f0, anchor)
    else:
        counted = better
    return better, a.where(better, f0, best_f), anchor, a.where(counted, 0, since + 1)


def decide(a, s, f0, ok, best_f, anchor, since, low_snr, snr, cfg) -> Decision:
    """One step's decisions (module docstring); cfg: the CalibrationConfig."""
    gate = ok & (s == 0) & (a.f64(f0) < cfg.tau)
    better, best_f, anchor, since = best_and_patience(a, f0, best_f, anchor, since, cfg.min_delta,
                                                      cfg.min_delta_rel)
    patience = ok & a.not_(gate) & (since >= cfg.patience) if cfg.patience else a.false(ok)
    go = ok & a.not_(gate) & a.not_(patience)  # past the stops the proxy itself decides
    if cfg.snr_threshold > 0:
        low = go & (a.f64(snr) < cfg.snr_threshold)
        low_snr = a.where(low, low_snr + 1, a.where(go, 0, low_snr))
        snr_stop = low & (low_snr >= max(cfg.patience, 1))
    else:
        low = snr_stop = a.false(ok)
    last = go & a.not_(snr_stop) & (s == cfg.max_steps - 1)
    update = go & a.not_(low) & a.not_(last)
    return Decision(better, best_f, anchor, since, low_snr, gate, patience, low, snr_stop, last, update)


__all__ = ["HOST", "DEVICE", "Decision", "margin_on", "improves", "best_and_patience", "decide"]
