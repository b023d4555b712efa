"""The ICL confidence proxy, one program per batch row (sicl_fast.step.proxy.proxy's function).

    proxy(logprobs [B, P] float (computed in float32), offsets [T+1] int64, alpha, beta, gamma, q)
        -> ProxyOut(f [B], C [B], R [B], G [B], c [B, T])  float32

    c_t = exp(mean of logprobs over span t)      C = mean_t c_t      G = mean_{t>=2} max(0, c_t - c_{t-1})
    R   = q-quantile of exp(logprobs) over the P positions, linear interpolation exactly as torch.quantile
          (rank = q * (P - 1) in float32, then torch.lerp's formula); the row is sorted with tl.sort after
          padding to a power of two with +inf. P is the plan's count, read on the device: a length bucket's
          log-probs [B, W] hold padding after it (sicl_fast.step.proxy.ProxyPlan)
    f   = alpha C + beta R + gamma G
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.step.proxy import ProxyOut, ProxyPlan, checked_proxy
from sicl_fast.step.spec import f32

from ._utils import FLOAT_DTYPES, check_device, check_dtype, launch, launch_config, next_pow2


@triton.jit(do_not_specialize=["T"])
def _proxy_kernel(
    lp_ptr, stride_b,  # [B, W] log-probs (any float dtype), row stride
    off_ptr,  # [T+1] int64 on the device
    count_ptr,  # [1] int64 on the device: P, the positions read (W - P padding after them)
    f_ptr, C_ptr, R_ptr, G_ptr, c_ptr,  # outputs, float32: [B] x 4 and [B, T]
    T,
    alpha, beta, gamma, q,  # float32
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCK_P)
    P = tl.load(count_ptr).to(tl.int32)
    pm = idx < P
    lp = tl.load(lp_ptr + row.to(tl.int64) * stride_b + idx, mask=pm, other=0.0).to(tl.float32)
    # per-span confidences, C and G
    c_sum = 0.0
    g_sum = 0.0
    c_prev = 0.0
    for t in range(0, T):
        s = tl.load(off_ptr + t).to(tl.int32)
        e = tl.load(off_ptr + t + 1).to(tl.int32)
        span = tl.sum(tl.where((idx >= s) & (idx < e), lp, 0.0), axis=0)
        ct = tl.exp(span / (e - s).to(tl.float32))
        tl.store(c_ptr + row.to(tl.int64) * T + t, ct)
        c_sum += ct
        g_sum += tl.where(t > 0, tl.maximum(ct - c_prev, 0.0), 0.0)
        c_prev = ct
    C = c_sum / T.to(tl.float32)
    G = tl.where(T >= 2, g_sum / tl.maximum(T - 1, 1).to(tl.float32), 0.0)
    # R: the q-quantile of the pooled probabilities (rank, floor and ceiling as torch.quantile takes them)
    rank = q * (P - 1).to(tl.float32)
    below = rank.to(tl.int32)
    above = tl.minimum(below + (rank > below.to(tl.float32)).to(tl.int32), P - 1)
    p = tl.where(pm, tl.exp(lp), float("inf"))
    srt = tl.sort(p, 0)
    v_lo = tl.sum(tl.where(idx == below, srt, 0.0), axis=0)
    v_hi = tl.sum(tl.where(idx == above, srt, 0.0), axis=0)
    w = rank - below.to(tl.float32)
    R = tl.where(w < 0.5, v_lo + w * (v_hi - v_lo), v_hi - (v_hi - v_lo) * (1.0 - w))
    tl.store(C_ptr + row, C)
    tl.store(R_ptr + row, R)
    tl.store(G_ptr + row, G)
    tl.store(f_ptr + row, alpha * C + beta * R + gamma * G)


def proxy(logprobs: torch.Tensor, offsets: torch.Tensor, alpha: float = 0.6, beta: float = 0.3,
          gamma: float = 0.1, q: float = 0.1, check_values: bool = True) -> ProxyOut:
    """The proxy of every batch row (module docstring). logprobs on CUDA (or the CPU under TRITON_INTERPRET=1).

    check_values: raise NumericalError on NaN / +inf log-probs as the reference does (one host sync);
    False skips the check (for a loop that must not synchronise; sicl_fast.step.proxy.check_logprobs).
    """
    return checked_proxy(proxy_planned, logprobs, offsets, alpha, beta, gamma, q, check_values)


def proxy_planned(logprobs: torch.Tensor, plan: ProxyPlan) -> ProxyOut:
    """The proxy for a checked plan (calibration.proxy.ProxyPlan, on logprobs' device): one launch, no host read."""
    op = "triton proxy"
    check_device(logprobs, plan.offsets_dev, op=op)
    check_dtype(logprobs, FLOAT_DTYPES, "logprobs", op)
    B, W = logprobs.shape
    dev = logprobs.device
    if logprobs.stride(1) != 1:
        logprobs = logprobs.contiguous()
    f, C, R, G = (torch.empty(B, dtype=torch.float32, device=dev) for _ in range(4))
    c = torch.empty(B, plan.T, dtype=torch.float32, device=dev)
    launch(
        _proxy_kernel, (B,),
        logprobs, logprobs.stride(0), plan.offsets_dev, plan.count, f, C, R, G, c, plan.T, f32(plan.alpha),
        f32(plan.beta), f32(plan.gamma), f32(plan.q), device=dev, **proxy_config(W),
    )
    return ProxyOut(f=f, C=C, R=R, G=G, c=c)


def proxy_config(W: int, interp: bool | None = None) -> dict:
    """BLOCK_P (a row's W span positions in one tile: the quantile sorts them) and num_warps of a launch, one
    program a batch row (_utils.launch_config)."""
    return launch_config("triton proxy", interp, block=max(next_pow2(W), 2), BLOCK_P=max(next_pow2(W), 2))
