"""RMSNorm fused with the residual add: the decoder's norms in one launch per use.

    residual_norm(x [M.., d], y [M.., d] or None, post_w [d] or None, w [d], eps, gemma)
        y given:  x' = x + (rms_norm(y, post_w) if post_w is not None else y);  returns (x', rms_norm(x', w))
        y None:   returns (x, rms_norm(x, w))   (the first layer's input norm)

x, y: float32 / bfloat16 / float16, contiguous, same dtype; w, post_w: x's dtype (Llama / Qwen) or float32
(Gemma's 1 + weight). One program per row; the statistics are float32 in registers and every intermediate is
rounded to the model dtype where the reference (sicl_fast.models.elementwise) rounds it, so bf16 results match
it to the last bit but for the reduction order. Reference: elementwise.residual_norm / rms_norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import launch, launch_config, next_pow2


@triton.jit
def _normed(xf, w_ptr, cols, mask, d, eps, DT: tl.constexpr, GEMMA: tl.constexpr):
    """rms_norm of one float32 row (already in the model dtype's values) -> float32 values of the DT result."""
    ms = tl.sum(xf * xf, axis=0) / d
    xn = xf * tl.math.rsqrt(ms + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # (x * (1 + w)) in float32, then the model dtype
        return (xn * w).to(DT).to(tl.float32)
    return (w * xn.to(DT).to(tl.float32)).to(DT).to(tl.float32)  # cast, then multiply in the model dtype


@triton.jit
def _residual_norm_kernel(x_ptr, y_ptr, post_w_ptr, w_ptr, x_out_ptr, h_ptr, d, eps,
                          HAS_Y: tl.constexpr, HAS_POST: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    DT = x_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_Y:
        yf = tl.load(y_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_POST:
            yf = _normed(yf, post_w_ptr, cols, mask, d, eps, DT, GEMMA)
        xf = (xf + yf).to(DT).to(tl.float32)
        tl.store(x_out_ptr + row * d + cols, xf.to(DT), mask=mask)
    h = _normed(xf, w_ptr, cols, mask, d, eps, DT, GEMMA)
    tl.store(h_ptr + row * d + cols, h.to(DT), mask=mask)


def residual_norm(x: torch.Tensor, y: torch.Tensor | None, post_w: torch.Tensor | None, w: torch.Tensor,
                  eps: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h) as the module docstring says; x' is x itself when y is None. One launch."""
    x = x.contiguous()
    d = x.shape[-1]
    M = x.numel() // d
    h = torch.empty_like(x)
    x_out = torch.empty_like(x) if y is not None else x
    y_arg = y.contiguous() if y is not None else x
    launch(_residual_norm_kernel, (M,), x, y_arg, post_w if post_w is not None else w, w, x_out, h, d, float(eps),
           device=x.device, HAS_Y=y is not None, HAS_POST=post_w is not None, GEMMA=bool(gemma),
           **residual_norm_config(d))
    return x_out, h


def residual_norm_config(d: int, interp: bool | None = None) -> dict:
    """BLOCK (the whole row of d) and num_warps of a launch (_utils.launch_config): one row a program."""
    return launch_config("triton residual_norm", interp, block=next_pow2(d), BLOCK=next_pow2(d))
