"""cuBLAS's reduced-precision reductions off for the products whose precision the calibration reads.

torch lets cuBLAS reduce a bf16 / fp16 product's split-K partial sums in bf16 / fp16
(`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` and the fp16 one, both on by default): one more
bf16 rounding of a difference product (sicl_fast.models.projections' RowsDense, bf16 out) or of a bf16 weight's
float32 product from bf16 pieces (sicl_fast.models.reference), the rounding that the difference form exists to keep
out of the perturbation's way. Those products run inside

    with full_reductions():     both settings off (split-K itself still allowed), the caller's restored on leaving

per pass (the difference form's layers, the reference pass, the reference head), not for the process: a user's own
setting holds everywhere else. Nested and concurrent scopes share one switch (a count under a lock: the first to
enter turns the reductions off, the last to leave restores what the first found). The settings are read by torch
when a product is launched (and, in a captured CUDA graph, when it is captured): a host-side switch, no device work.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

KINDS = ("bf16", "fp16")
_lock = threading.Lock()
_depth = 0
_saved: dict = {}


def _attr(kind: str) -> str:
    return f"allow_{kind}_reduced_precision_reduction"


def settings() -> dict:
    """{kind: (reduced precision allowed, split-K allowed)} as torch holds them now."""
    m = torch.backends.cuda.matmul
    return {kind: (bool(getattr(m, _attr(kind))), bool(getattr(m, _attr(kind) + "_split_k", True))) for kind in KINDS}


def _set(values: dict) -> None:
    m = torch.backends.cuda.matmul
    for kind, (allow, split_k) in values.items():
        try:
            setattr(m, _attr(kind), (allow, split_k))
        except TypeError:  # a torch whose setting is one bool (no split-K part)
            setattr(m, _attr(kind), allow)


@contextmanager
def full_reductions():
    """Within the block, cuBLAS reduces bf16 and fp16 products in float32 (module docstring)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = settings()
            _set({kind: (False, split_k) for kind, (_, split_k) in _saved.items()})
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set(_saved)


__all__ = ["full_reductions", "settings", "KINDS"]
