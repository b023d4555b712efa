"""Best-so-far bookkeeping of the ascent kept on the device, torch reference (for a loop with no host sync).

State (`BestState`, device tensors):
    best_X [L, d] float32      the X with the highest f0 seen
    best_f [1] float32         its f0 (starts at -inf)
    counters [3] int32         (steps without improvement, step of best_X, steps seen)

`track_best(f, X, state)` applies one step of Algorithm 1's bookkeeping, with no host synchronisation:
    if f[0] > best_f:  best_f = f[0];  best_X = X;  since = 0;  best_step = seen
    else:              since += 1
    seen += 1
NaN f[0] counts as no improvement. The Triton kernel `sicl_fast.kernels.track_best` is tested against it.

What counts as an improvement for patience (CalibrationConfig.min_delta, min_delta_rel), one rule in two forms:
    improves(f0, anchor, min_delta, min_delta_rel)        python floats (the eager loop, Calibrator.run)
    improved(f0, anchor, min_delta, min_delta_rel)        device tensors, no host read (the static step's reference)
anchor: the f0 of the last counted improvement (-inf before the first). f0 counts when it beats the anchor by more
than max(min_delta, min_delta_rel * |anchor|), in float64; it then becomes the anchor. With both 0 that is
f0 > anchor and the anchor is the best f0 at every step: the paper's rule, patience as `track_best` counts it.
"""
from __future__ import annotations

import math

import torch

from ...errors import SiclError


class BestState:
    """Device-resident best-so-far state for an [L, d] float32 X (see module docstring)."""

    def __init__(self, X: torch.Tensor) -> None:
        self.best_X = X.detach().clone().contiguous().float()
        self.best_f = torch.full((1,), float("-inf"), dtype=torch.float32, device=X.device)
        self.counters = torch.zeros(3, dtype=torch.int32, device=X.device)

    # host reads (each one synchronises)
    @property
    def since_best(self) -> int:
        return int(self.counters[0])

    @property
    def best_step(self) -> int:
        return int(self.counters[1])

    @property
    def steps(self) -> int:
        return int(self.counters[2])


def check_best_args(f: torch.Tensor, X: torch.Tensor, state: BestState, op: str) -> None:
    """The checks every track_best implementation shares."""
    if X.dtype != torch.float32:
        raise SiclError(f"{op}: X must be float32, got {str(X.dtype).replace('torch.', '')}")
    if X.shape != state.best_X.shape:
        raise SiclError(f"{op}: X must have shape {list(state.best_X.shape)}, got {list(X.shape)}")
    if f.numel() < 1:
        raise SiclError(f"{op}: f is empty")


def track_best(f: torch.Tensor, X: torch.Tensor, state: BestState) -> BestState:
    """One bookkeeping step in torch ops only (no .item()). f: [B] (f[0] is X's proxy); X: [L, d] float32."""
    check_best_args(f, X, state, "torch track_best")
    f0 = f.reshape(-1)[:1].float()
    better = f0 > state.best_f  # [1]; False for NaN
    state.best_X.copy_(torch.where(better.view(1, 1), X, state.best_X))
    state.best_f.copy_(torch.where(better, f0, state.best_f))
    since, best_step, seen = state.counters[0:1], state.counters[1:2], state.counters[2:3]
    zero = torch.zeros_like(since)
    state.counters.copy_(torch.cat([torch.where(better, zero, since + 1), torch.where(better, seen, best_step),
                                    seen + 1]))
    return state


def margin_on(cfg) -> bool:
    """Does `cfg` ask more of an improvement than the paper's rule (min_delta or min_delta_rel > 0)?"""
    return cfg.min_delta > 0 or cfg.min_delta_rel > 0


def improves(f0: float, anchor: float, min_delta: float, min_delta_rel: float) -> bool:
    """Does f0 count as an improvement over `anchor` (module docstring)? Python floats; False for NaN."""
    if not f0 > anchor:
        return False
    return anchor == -math.inf or f0 - anchor > max(min_delta, min_delta_rel * abs(anchor))


def improved(f0: torch.Tensor, anchor: torch.Tensor, min_delta: float, min_delta_rel: float) -> torch.Tensor:
    """improves() on device tensors: f0, anchor [1] float32 -> bool [1] (in float64, as the python floats)."""
    first = anchor == -math.inf  # nothing counted yet: any finite f0 counts
    f, a = f0.double(), torch.where(first, 0.0, anchor).double()
    return (f0 > anchor) & (first | (f - a > torch.clamp(min_delta_rel * a.abs(), min=min_delta)))


__all__ = ["BestState", "track_best", "check_best_args", "margin_on", "improves", "improved"]
