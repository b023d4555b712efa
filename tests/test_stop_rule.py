"""The one stopping rule (sicl_fast.step.stop_rule): its python form (the eager loop) and its device
form (the static and packed steps' bookkeeping) decide alike on every case, ties at the margin and the thresholds
included; tests/test_ops.py holds the fused C++ and Triton bookkeeping to the device form, tests/test_ascent.py the
two loops to each other."""
import itertools
import math

import pytest
import torch

from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.step.stop_rule import DEVICE, HOST, decide, improves



def f32(x: float) -> float:
    """x rounded to float32: the proxies are float32 on both sides."""
    return float(torch.tensor(x, dtype=torch.float32))


F0S = [f32(x) for x in (0.25, 0.5, 0.5 + 2 ** -24, 0.51, 0.7, math.nan)]  # a float32 ulp above 0.5, a tie, NaN
CONFIGS = [dict(), dict(patience=2), dict(patience=1, min_delta=0.01), dict(patience=2, min_delta_rel=0.02),
           dict(snr_threshold=1.0, patience=2), dict(tau=0.5), dict(snr_threshold=1.0)]


def host_and_device(cfg, s, f0, best_f, anchor, since, low_snr, snr):
    h = decide(HOST, s, f0, not math.isnan(f0), best_f, anchor, since, low_snr, snr, cfg)
    t = lambda x, dt=torch.float32: torch.tensor([x], dtype=dt)  # noqa: E731
    ok = torch.tensor([not math.isnan(f0)])
    f0_dev = torch.where(ok, t(f0), t(-math.inf))
    d = decide(DEVICE, t(s, torch.int64), f0_dev, ok, t(best_f), t(anchor), t(since, torch.int32),
               t(low_snr, torch.int64), t(snr), cfg)
    return h, d


@pytest.mark.parametrize("kw", CONFIGS)
def test_host_and_device_decide_alike(kw):
    cfg = CalibrationConfig(**{"N": 4, "mu": 0.01, "tau": 0.0, "patience": 0, "max_steps": 3, "scale": 1.0, **kw})
    cases = itertools.product([0, 1, 2], F0S, [-math.inf, 0.5], [-math.inf, 0.5, f32(0.505)], [0, 1], [0, 1],
                              [0.5, 1.0, f32(1.0 + 2 ** -20)])
    seen = set()
    for s, f0, best_f, anchor, since, low_snr, snr in cases:
        h, d = host_and_device(cfg, s, f0, best_f, anchor, since, low_snr, snr)
        for name, hv, dv in zip(h._fields, h, d):
            if name in ("best_f", "anchor"):
                assert float(dv) == hv, (name, hv, dv)
            else:
                assert int(dv) == int(hv), (name, s, f0, best_f, anchor, since, low_snr, snr, hv, dv)
        seen.add((bool(h.gate), bool(h.patience), bool(h.snr_stop), bool(h.last), bool(h.update)))
    assert len(seen) >= 3  # the grid reaches several outcomes under every configuration


def test_the_margin_is_strict_and_in_float64():
    """f0 counts only when it beats the anchor by more than the margin; anything finite beats -inf, NaN nothing."""
    for a in (HOST, DEVICE):
        t = (lambda x: x) if a is HOST else (lambda x: torch.tensor([x], dtype=torch.float32))
        assert bool(improves(a, t(0.3), t(-math.inf), 1.0, 0.0))
        assert not bool(improves(a, t(0.75), t(0.5), 0.25, 0.0))  # a gain of exactly the margin
        assert bool(improves(a, t(0.75), t(0.5), 0.2499, 0.0))
        assert not bool(improves(a, t(0.6), t(0.5), 0.0, 0.25))  # the relative margin: 0.125
        assert not bool(improves(a, t(math.nan), t(0.5), 0.0, 0.0))
