"""Rotary embedding of q and k (with the per-head q / k norms of Qwen3 and Gemma 3), written where attention
reads them: q in place, k and v into the given buffers (the per-layer K/V buffers of the fast decoder).

    qk_rope(q [B, T, H, hd], k [B, T, Hk, hd], v [B, T, Hk, hd], cos, sin [T, 1, hd] (or [T, hd]),
            q_norm [hd] or None, k_norm, eps, gemma, k_out=None, v_out=None) -> (q, k_out, v_out)

q, k, v: the same float dtype; the last two dimensions contiguous (views of one fused product are fine); q is
overwritten. k_out / v_out: [B, T, Hk, hd] (fresh contiguous tensors when None). One launch: a program rotates
all the q and k heads of its (b, t) rows as [rows, heads, hd] tiles (one row on a GPU, 64 under the
interpreter, which pays per program) and copies their v. Every intermediate is rounded to the model dtype
where the reference (sicl_fast.models.elementwise.qk_rope) rounds it; no FMA contraction, so float32 results are
the reference's but for the norm's reduction order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._utils import EXACT, launch, launch_config, next_pow2


@triton.jit
def _rope_heads(src, dst, rows, rmask, stride_src, stride_dst, n_heads, w_ptr, cs_off, cos_ptr, sin_ptr, hd, eps,
                HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate the n_heads heads (head h at + h * hd) of the rows `rows` [R, 1, 1] (row r at src + r * stride_src)
    into dst: an [R, BLOCK_H, BLOCK_D] tile; cs_off [R, 1, 1]: each row's offset into the cos / sin tables."""
    DT = src.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_D)[None, None, :]
    m = rmask & (h < n_heads) & (i < hd)
    half = hd // 2
    j = tl.where(i < half, i + half, i - half)  # rotate_half's source of element i
    x = tl.load(src + rows * stride_src + h * hd + i, mask=m, other=0.0).to(tl.float32)
    xr = tl.load(src + rows * stride_src + h * hd + j, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.math.rsqrt(tl.sum(x * x, axis=2) / hd + eps)[:, :, None]  # one statistic per head, both loads
        wi = tl.load(w_ptr + i, mask=i < hd, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + j, mask=i < hd, other=0.0).to(tl.float32)
        if GEMMA:
            x = (x * r * wi).to(DT).to(tl.float32)
            xr = (xr * r * wj).to(DT).to(tl.float32)
        else:
            x = (wi * (x * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
            xr = (wj * (xr * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    xr = tl.where(i < half, -xr, xr)
    cm = rmask & (i < hd)
    c = tl.load(cos_ptr + cs_off + i, mask=cm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off + i, mask=cm, other=0.0).to(tl.float32)
    out = (x * c).to(DT).to(tl.float32) + (xr * s).to(DT).to(tl.float32)
    tl.store(dst + rows * stride_dst + h * hd + i, out.to(DT), mask=m)


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, v_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                    stride_q, stride_k, stride_v, stride_ko, stride_vo, stride_cs, n_rows, T, H, Hk, hd, eps,
                    HAS_NORM: tl.constexpr, GEMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    # BLOCK_R (b, t) rows per program, every q and k head of each; the k part also copies v
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None, None]
    rmask = rows < n_rows
    cs_off = (rows % T) * stride_cs
    _rope_heads(q_ptr, q_ptr, rows, rmask, stride_q, stride_q, H, qn_ptr, cs_off, cos_ptr, sin_ptr, hd, eps,
                HAS_NORM, GEMMA, BLOCK_H, BLOCK_D)
    _rope_heads(k_ptr, k_out_ptr, rows, rmask, stride_k, stride_ko, Hk, kn_ptr, cs_off, cos_ptr, sin_ptr, hd, eps,
                HAS_NORM, GEMMA, BLOCK_HK, BLOCK_D)
    h = tl.arange(0, BLOCK_HK)[None, :, None]
    i = tl.arange(0, BLOCK_D)[None, None, :]
    m = rmask & (h < Hk) & (i < hd)
    tl.store(v_out_ptr + rows * stride_vo + h * hd + i, tl.load(v_ptr + rows * stride_v + h * hd + i, mask=m),
             mask=m)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [B, T, heads, hd] -> (t or a contiguous copy, the stride between consecutive (b, t) rows)."""
    B, T, n, hd = t.shape
    if t.stride(3) != 1 or t.stride(2) != hd or (B > 1 and t.stride(0) != T * t.stride(1)):
        t = t.contiguous()
    return t, t.stride(1)


def qk_rope(q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None, v_out=None):
    """(q rotated in place, k_out, v_out) as the module docstring says. One launch."""
    B, T, H, hd = q.shape
    Hk = k.shape[2]
    q, sq = _rows(q)
    k, sk = _rows(k)
    v, sv = _rows(v)
    k_out = torch.empty(B, T, Hk, hd, dtype=k.dtype, device=k.device) if k_out is None else k_out
    v_out = torch.empty(B, T, Hk, hd, dtype=v.dtype, device=v.device) if v_out is None else v_out
    for name, t in (("k_out", k_out), ("v_out", v_out)):  # written in place: they must have the row layout
        if _rows(t)[0] is not t:
            raise SiclError(f"triton qk_rope: {name} must have contiguous heads and rows, got strides {t.stride()}")
    sko, svo = k_out.stride(1), v_out.stride(1)
    cos2, sin2 = cos.reshape(-1, hd), sin.reshape(-1, hd)
    w = q_norm if q_norm is not None else cos2
    cfg = qk_rope_config(H, Hk, hd)
    launch(
        _qk_rope_kernel, (triton.cdiv(B * T, cfg["BLOCK_R"]),),
        q, k, v, k_out, v_out, cos2, sin2, w, k_norm if k_norm is not None else w, sq, sk, sv, sko, svo,
        cos2.stride(0), B * T, T, H, Hk, hd, float(eps), device=q.device, HAS_NORM=q_norm is not None,
        GEMMA=bool(gemma), **cfg)
    return q, k_out, v_out  # q: the input itself, or its rotated contiguous copy when it had another layout


def qk_rope_config(H: int, Hk: int, hd: int, interp: bool | None = None) -> dict:
    """BLOCK_R (rows a program: 1 on a GPU, 64 under the interpreter, which pays per program), BLOCK_H / BLOCK_HK /
    BLOCK_D (the heads' tiles), num_warps and the exact float32 options of a launch (_utils.launch_config)."""
    BH, BD = next_pow2(H), next_pow2(hd)
    return launch_config("triton qk_rope", interp, block=BH * BD, BLOCK_R=1, BLOCK_H=BH, BLOCK_HK=next_pow2(Hk),
                         BLOCK_D=BD, **EXACT, interpreter={"BLOCK_R": 64})
