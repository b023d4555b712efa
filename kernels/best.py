"""Best-so-far bookkeeping of the ascent on the device (for a loop with no host sync, e.g. a CUDA graph).

State: sicl_fast.step.best.BestState (device tensors); the torch reference is
sicl_fast.step.best.track_best. `track_best(f, X, state)` applies one step of Algorithm 1's bookkeeping:
    if f[0] > best_f:  best_f = f[0];  best_X = X;  since = 0;  best_step = seen
    else:              since += 1
    seen += 1
NaN f[0] counts as no improvement. Two launches (copy, then state) so no program reads best_f after another
wrote it; both are capturable in a CUDA graph (no host values change between steps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.step.best import BestState, check_best_args

from ._utils import check_device, launch, launch_config


@triton.jit
def _best_copy_kernel(f_ptr, best_f_ptr, x_ptr, best_x_ptr, n, BLOCK: tl.constexpr):
    f0 = tl.load(f_ptr).to(tl.float32)
    best = tl.load(best_f_ptr)
    if f0 > best:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(best_x_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _best_state_kernel(f_ptr, best_f_ptr, counters_ptr):
    f0 = tl.load(f_ptr).to(tl.float32)
    best = tl.load(best_f_ptr)
    since = tl.load(counters_ptr)
    best_step = tl.load(counters_ptr + 1)
    seen = tl.load(counters_ptr + 2)
    better = f0 > best
    tl.store(best_f_ptr, tl.where(better, f0, best))
    tl.store(counters_ptr, tl.where(better, 0, since + 1))
    tl.store(counters_ptr + 1, tl.where(better, seen, best_step))
    tl.store(counters_ptr + 2, seen + 1)


def track_best(f: torch.Tensor, X: torch.Tensor, state: BestState) -> BestState:
    """One bookkeeping step on the device (module docstring). f: [B] (f[0] is X's proxy); X: [L, d] float32."""
    op = "triton track_best"
    check_device(f, X, state.best_X, op=op)
    check_best_args(f, X, state, op)
    X = X.contiguous()
    f = f.reshape(-1)
    n = X.numel()
    cfg = copy_config()
    launch(_best_copy_kernel, (triton.cdiv(n, cfg["BLOCK"]),), f, state.best_f, X, state.best_X, n, device=X.device,
           **cfg)
    launch(_best_state_kernel, (1,), f, state.best_f, state.counters, device=X.device, **best_state_config())
    return state


def copy_config(interp: bool | None = None) -> dict:
    """BLOCK (2048 elements a program; 65536 under the interpreter) and num_warps of a launch of the best-X copies
    (_best_copy_kernel, and bookkeep's _bookkeep_copy_kernel) (_utils.launch_config)."""
    return launch_config("triton copy", interp, block=2048, BLOCK=2048, interpreter={"BLOCK": 1 << 16})


def best_state_config(interp: bool | None = None) -> dict:
    """num_warps of the one-program state update."""
    return launch_config("triton track_best", interp)
