"""The decoder's elementwise work, as plain torch: the reference of the fused kernels (kernels/rms_norm.py,
rope.py, gated.py, softcap.py) and what TorchDecoderOps runs. Out of place and differentiable. Numerics follow
transformers 5.17 step by step: norm statistics in float32, every other intermediate rounded to the model dtype
where transformers rounds it.

    rms_norm(x [..., d], w [d], eps, gemma) -> [..., d] in x's dtype
        gemma: (x / rms(x)) * w in float32 (w float32: Gemma's 1 + weight, OLMo 2's weight), then the model dtype;
        else:  w * (x / rms(x) in the model dtype)
    residual_norm(x [..., d], y [..., d], post_w, w, eps, gemma, y_scale=None) -> (x + y', rms_norm(x + y', w))
        y' = rms_norm(y, post_w) (Gemma's and OLMo 2's post-attention / post-MLP norms) or y, times y_scale
        (Granite's residual multiplier) when given; the sum in the model dtype; w None: (x + y', x + y') (OLMo 2:
        no norm before the next block)
    rope(x [B, T, heads, hd], cos, sin [T, 1, rot]) -> x's first rot elements of each head rotated,
        x cos + rotate_half(x) sin, the others as they are (rot < hd: partial rotary, Phi-3)
    qk_rope(q [B, T, H, hd], k [B, T, Hk, hd], cos, sin, q_norm, k_norm, eps, gemma) -> (q', k')
        q' = rope(rms_norm(q, q_norm)): per head with q_norm [hd] (Qwen3 / Gemma 3), over the whole projection
        with q_norm [H hd] (OLMo 2); no norm when q_norm is None
    gated(gate [..., I], up [..., I], act_name) -> act(gate) * up          (SwiGLU / GeGLU)
    softcap(x, cap) -> cap * tanh(x / cap)                                  (Gemma 2 logit soft-caps)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # (x * (1 + w)) in float32, then the model dtype
        return (xf * w).type_as(x)
    return w * xf.to(x.dtype)  # Llama / Qwen: cast, then multiply


def residual_norm(x: torch.Tensor, y: torch.Tensor, post_w: torch.Tensor | None, w: torch.Tensor | None,
                  eps: float, gemma: bool, y_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if post_w is not None:
        y = rms_norm(y, post_w, eps, gemma)
    if y_scale is not None:
        y = y * y_scale
    x = x + y
    return x, (x if w is None else rms_norm(x, w, eps, gemma))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]  # partial rotary, as transformers' apply_rotary_pos_emb
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def head_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """rms_norm of x [..., heads, hd] per head (w [hd]) or over all its heads together (w [heads hd]: OLMo 2's q / k
    norms, over the whole projection)."""
    if w.numel() == x.shape[-1]:
        return rms_norm(x, w, eps, gemma)
    return rms_norm(x.flatten(-2), w, eps, gemma).view(x.shape)


def qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
            k_norm: torch.Tensor | None, eps: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm is not None:
        q, k = head_norm(q, q_norm, eps, gemma), head_norm(k, k_norm, eps, gemma)
    return rope(q, cos, sin), rope(k, cos, sin)


def gated(gate: torch.Tensor, up: torch.Tensor, act_name: str) -> torch.Tensor:
    return ACTIVATIONS[act_name](gate) * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


__all__ = ["ACTIVATIONS", "rms_norm", "residual_norm", "rotate_half", "rope", "head_norm", "qk_rope", "gated",
           "softcap"]
