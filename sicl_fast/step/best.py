"""Best-so-far bookkeeping of the ascent kept on the device, torch reference (for a loop with no host sync).

State (`BestState`, device tensors):
    best_X [L, d] float32      the X with the highest f0 seen
    best_f [1] float32         its f0 (starts at -inf)
    counters [3] int32         (steps without improvement, step of best_X, steps seen)

`track_best(f, X, state)` applies one step of Algorithm 1's bookkeeping, with no host synchronisation:
    if f[0] > best_f:  best_f = f[0];  best_X = X;  since = 0;  best_step = seen
    else:              since += 1
    seen += 1
NaN f[0] counts as no improvement. The rule is stop_rule.best_and_patience's (the paper's: no margin); the Triton
kernel `sicl_fast.kernels.track_best` is tested against this form. `keep_best` writes a step's outcome into the
state, here and in the static step's bookkeeping (step_state.bookkeep_reference).
"""
from __future__ import annotations

import torch

from ..errors import SiclError
from .stop_rule import DEVICE, best_and_patience


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


def keep_best(state: BestState, better: torch.Tensor, best_f: torch.Tensor, since: torch.Tensor,
              X: torch.Tensor) -> None:
    """Write a step's outcome into `state`, in place: better bool [1] (X [L, d] becomes the best X), the new best_f
    [1] and patience counter since int32 [1]; the best step is the steps seen where better, and one more step
    is seen."""
    best_step, seen = state.counters[1:2], state.counters[2:3]
    state.best_X.copy_(torch.where(better.view(1, 1), X, state.best_X))
    state.best_f.copy_(best_f)
    state.counters.copy_(torch.cat([since, torch.where(better, seen, best_step), seen + 1]))


def track_best(f: torch.Tensor, X: torch.Tensor, state: BestState) -> BestState:
    """One bookkeeping step in torch ops only (no .item()). f: [B] (f[0] is X's proxy); X: [L, d] float32."""
    check_best_args(f, X, state, "torch track_best")
    f0 = f.reshape(-1)[:1].float()
    better, best_f, _, since = best_and_patience(DEVICE, f0, state.best_f, None, state.counters[0:1])
    keep_best(state, better, best_f, since, X)
    return state


__all__ = ["BestState", "track_best", "keep_best", "check_best_args"]
