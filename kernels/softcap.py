"""Logit soft-capping in place: x <- cap * tanh(x / cap) (Gemma 2's attention and final logits), one launch.

    softcap_(x (any float dtype, contiguous), cap > 0) -> x

Computed in float32 and rounded once to x's dtype (the reference, sicl_fast.models.elementwise.softcap, rounds
after the division and the tanh too in bf16: the two agree to a bf16 ulp, exactly in float32 but for tanh's
last bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._math import tanh
from ._utils import launch, launch_config


@triton.jit
def _softcap_kernel(x_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(x_ptr + offs, (cap * tanh(x / cap)).to(x_ptr.dtype.element_ty), mask=m)


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    if not x.is_contiguous():
        raise SiclError(f"triton softcap_: x is written in place and must be contiguous (strides {x.stride()})")
    n = x.numel()
    cfg = softcap_config()
    launch(_softcap_kernel, (triton.cdiv(n, cfg["BLOCK"]),), x, n, float(cap), device=x.device, **cfg)
    return x


def softcap_config(interp: bool | None = None) -> dict:
    """BLOCK (elements a program) and num_warps of a launch (_utils.launch_config)."""
    return launch_config("triton softcap_", interp, block=1024, BLOCK=1024)
