"""The gated MLP activation: act(gate) * up (SwiGLU for Llama / Qwen3, GeGLU for Gemma), one launch.

    gated(gate [..., I], up [..., I], act_name) -> [..., I] in gate's dtype
        act_name: silu / swish, gelu_pytorch_tanh / gelu_tanh, gelu (erf)

gate, up: the same float dtype, any layout whose last dimension is contiguous with rows of equal stride (the
two halves of one fused product are fine). The activation is computed in float32 and rounded to the model dtype
before the product, as torch's kernels do. Reference: sicl_fast.models.elementwise.gated.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._math import gated_act
from ._utils import EXACT, launch, launch_config

ACT_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "gelu": 2}


@triton.jit
def _gated_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, ACT: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    DT = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    out = gated_act(g, ACT).to(DT).to(tl.float32) * u
    tl.store(out_ptr + row * n_cols + cols, out.to(DT), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [M, n] rows with a unit column stride (a view when its layout allows, else a copy)."""
    n = t.shape[-1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.contiguous().view(-1, n)


def gated(gate: torch.Tensor, up: torch.Tensor, act_name: str) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    M, n = g.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    cfg = gated_config(n)
    launch(_gated_kernel, (M, triton.cdiv(n, cfg["BLOCK"])), g, u, out, n, g.stride(0), u.stride(0),
           device=out.device, ACT=ACT_CODES[act_name], **cfg)
    return out


def gated_config(n: int, interp: bool | None = None) -> dict:
    """BLOCK (a row's column tile, at most 1024), num_warps and the exact float32 options (torch's roundings:
    kernels._math.gated_act) of a launch over rows of n (_utils.launch_config)."""
    BLOCK = min(1024, triton.next_power_of_2(n))
    return launch_config("triton gated", interp, block=BLOCK, BLOCK=BLOCK, **EXACT)
