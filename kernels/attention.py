"""Attention of a perturbation batch over a shared prefix, in one launch: no merge, no copy of the prefix.

    prefix_attention(q [B, T, H, hd], k, v [B, T, Hk, hd], prefix (kp, vp [1, a, Hk, hd]) or None, pos0,
                     window, scale, softcap) -> o [B, T, H, hd] in q's dtype

Query t of batch row b sits at position pos0 + t. It attends to the prefix keys 0 .. a-1 (a == pos0; one copy,
read by every batch row through a batch stride of 0) and to its own row's keys pos0 .. pos0 + t (causal); with a
window, only to keys at positions > its own - window (transformers' sliding window). Scores are q.k * scale,
then soft-capped (cap * tanh(s / cap)) when softcap is set. Softmax statistics and the output accumulator are
float32 (online softmax, as flash attention); in bf16 the probabilities are rounded to bf16 for the product with
v. GQA: head h reads K/V head h // (H / Hk). The last dimension of every input must be contiguous.

Reference: sicl_fast.models.attention (attend_math over the two key sets, merged by log-sum-exp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._math import tanh
from ._utils import interpreting, launch, next_pow2


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, n0, n_keys, k_pos0, q_pos, hd,
                  scale, cap, window, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of keys n0 .. n0 + BLOCK_N (of n_keys, at positions k_pos0 + n) folded into the running
    (acc [BM, BD], m_i [BM], l_i [BM]) of the queries at positions q_pos [BM]."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < n_keys) & (offs_d[None, :] < hd)
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        s = cap * tanh(s / cap)
    k_pos = k_pos0 + offs_n
    ok = offs_n[None, :] < n_keys
    if CAUSAL:
        ok = ok & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: keep it at zero
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, o_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skp_t, skp_h, svp_t, svp_h, so_b, so_t, so_h,
    T, a, H, G, hd, pos0, scale, cap, window,
    HAS_PREFIX: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    kh = h // G
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < hd)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = pos0 + offs_m
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_PREFIX:  # keys 0 .. a-1: all before every query; with a window, from pos0 + m0 - window + 1 on
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, pos0 + m0 - window + 1) // BLOCK_N * BLOCK_N
        for n0 in range(lo, a, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kp_ptr + kh * skp_h, vp_ptr + kh * svp_h, skp_t,
                                          svp_t, n0, a, 0, q_pos, hd, scale, cap, window, HAS_SOFTCAP,
                                          HAS_WINDOW, False, UPCAST, PRECISION, BLOCK_N, BLOCK_D)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, m0 - window + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(T, m0 + BLOCK_M)
    for n0 in range(lo, hi, BLOCK_N):  # the row's own keys, causal
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr + b * sk_b + kh * sk_h, v_ptr + b * sv_b + kh * sv_h,
                                      sk_t, sv_t, n0, T, pos0, q_pos, hd, scale, cap, window, HAS_SOFTCAP,
                                      HAS_WINDOW, True, UPCAST, PRECISION, BLOCK_N, BLOCK_D)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees its own key; padding rows stay 0
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=q_mask)


def prefix_attention(q, k, v, prefix, pos0: int, window: int | None, scale: float,
                     softcap: float | None, block: int | None = None) -> torch.Tensor:
    """o [B, T, H, hd] (module docstring). One launch. block: the query and key tile (default 64; the tests
    use 16 to cover the multi-block paths)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if prefix is not None:
        prefix = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in prefix)
    B, T, H, hd = q.shape
    Hk = k.shape[2]
    o = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    kp, vp = prefix if prefix is not None else (k, v)
    a = kp.shape[1] if prefix is not None else 0
    interp = interpreting()
    BM = BN = block or 64
    launch(
        _prefix_attention_kernel, (triton.cdiv(T, BM), B * H),
        q, k, v, kp, vp, o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kp.stride(1), kp.stride(2), vp.stride(1), vp.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, a, H, H // Hk, hd, pos0, float(scale), float(softcap or 1.0), int(window or 0),
        HAS_PREFIX=prefix is not None and a > 0, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        UPCAST=interp and q.dtype != torch.float32, PRECISION="ieee", BLOCK_M=BM, BLOCK_N=BN,
        BLOCK_D=max(16, next_pow2(hd)), device=q.device, num_warps=4,  # tiles of BM x BN scores: 4 warps
    )
    return o
