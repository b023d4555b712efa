"""The ICL confidence proxy f(X): the torch reference, single source of truth for the math.

From the log-probabilities l_t of the demonstrated output tokens (teacher forcing):

    c_i = exp(mean_{t in Y_i} l_t)                  per-demonstration confidence, i = 1..T
    C   = mean_i c_i                                 mean confidence
    R   = quantile_q({exp(l_t) : all t})             pooled robustness (linear interpolation, as torch.quantile)
    G   = mean_{i>=2} max(0, c_i - c_{i-1})          information gain (0 when T = 1)
    f   = alpha * C + beta * R + gamma * G

Every fast path (Triton kernel, C++ extension) is tested against `proxy` below.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NumericalError, SiclError
from .logprobs import accumulation_dtype


@dataclass
class ProxyOut:
    """Proxy value and its parts, one entry per batch row. All float32 tensors.

    f, C, R, G: [B];  c: [B, T] per-demonstration confidences.
    """

    f: torch.Tensor
    C: torch.Tensor
    R: torch.Tensor
    G: torch.Tensor
    c: torch.Tensor


def check_offsets(offsets: torch.Tensor, num_positions: int) -> None:
    """Raise unless offsets is [T+1], starts at 0, ends at P, and every span has >= 1 token."""
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise SiclError(f"span offsets must be a 1-D tensor [T+1] with T >= 1, got shape {tuple(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_positions:
        raise SiclError(
            f"span offsets must run from 0 to P={num_positions}, got {int(offsets[0])}..{int(offsets[-1])}"
        )
    lengths = offsets[1:] - offsets[:-1]
    if bool((lengths <= 0).any()):
        bad = int(torch.nonzero(lengths <= 0)[0])
        raise SiclError(f"output span {bad} has no tokens (offsets {offsets.tolist()})")


def check_logprobs(logprobs: torch.Tensor, check_values: bool = True) -> None:
    """logprobs must be [B, P]; with check_values, NaN or +inf log-probs raise (-inf, probability 0, is legal).
    The value check reads the device (one host sync); a loop that must not synchronise passes
    check_values=False and checks the proxy values it reads back instead."""
    if logprobs.dim() != 2:
        raise SiclError(f"logprobs must be [B, P], got shape {tuple(logprobs.shape)}")
    if check_values and bool((torch.isnan(logprobs) | (logprobs == float("inf"))).any()):
        # NaN or +inf means the forward pass broke upstream
        raise NumericalError("span log-probabilities contain NaN or +inf")


@dataclass(frozen=True)
class ProxyPlan:
    """One prompt's span layout and the proxy's weights, checked once and laid out on a device, so that computing
    the proxy reads nothing back to the host: offsets [T+1] int64 (on the CPU and on the device), seg [W] int64 (the
    span of each position; T for a padding position), lengths [T] float32 and count [1] int64 on the device, the
    spans' positions P. The plan reads log-probs [B, W]: W = P, or a length bucket's width (sicl_fast.run.buckets),
    whose positions [P, W) are padding that no part of the proxy reads. The quantile's rank q (count - 1) is
    computed on the device from count, in the log-probs' dtype, as torch.quantile computes it; a graph captured on a
    plan replays another plan of the same W and T copied into it (copy_)."""

    offsets: torch.Tensor  # [T+1] int64, CPU
    offsets_dev: torch.Tensor  # [T+1] int64, device
    seg: torch.Tensor  # [W] int64, device
    lengths: torch.Tensor  # [T] float32, device
    count: torch.Tensor  # [1] int64, device: P
    W: int
    T: int
    alpha: float
    beta: float
    gamma: float
    q: float

    @classmethod
    def build(cls, offsets, P: int, device, alpha=0.6, beta=0.3, gamma=0.1, q=0.1, width: int | None = None
              ) -> ProxyPlan:
        if not 0.0 <= q <= 1.0:
            raise SiclError(f"q must be in [0, 1], got {q}")
        offsets = torch.as_tensor(offsets, dtype=torch.int64).cpu().clone()  # its own: copy_ writes into it
        check_offsets(offsets, P)
        W = P if width is None else width
        if W < P:
            raise SiclError(f"a proxy plan of width {W} cannot hold the spans' {P} positions")
        T = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        seg = torch.cat([torch.repeat_interleave(torch.arange(T), lengths), torch.full((W - P,), T)])
        return cls(offsets=offsets, offsets_dev=offsets.to(device), seg=seg.to(device),
                   lengths=lengths.float().to(device), count=torch.tensor([P], device=device), W=W, T=T, alpha=alpha,
                   beta=beta, gamma=gamma, q=q)

    def copy_(self, other: ProxyPlan) -> None:
        """Take `other`'s spans (same W and T), in place: every tensor keeps its address."""
        for mine, new in ((self.offsets, other.offsets), (self.offsets_dev, other.offsets_dev), (self.seg, other.seg),
                          (self.lengths, other.lengths), (self.count, other.count)):
            mine.copy_(new)


def quantile_ranks(q: float, count: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(rank [1] in dtype, below, above [1] int64): torch.quantile's rank q (n - 1) for the linear interpolation
    between the sorted values below and above it, of n = count (an int64 [1] tensor; no host read)."""
    rank = torch.full((1,), q, dtype=dtype, device=count.device) * (count - 1).to(dtype)
    below = rank.to(torch.int64)
    above = torch.minimum(below + (rank > below.to(dtype)).to(torch.int64), count - 1)
    return rank, below, above


def proxy_planned(logprobs: torch.Tensor, plan: ProxyPlan) -> ProxyOut:
    """The reference proxy of logprobs [B, W] (any float dtype; computed in float32, float64 kept as float64) for a
    checked plan: no checks, no host reads (what a loop without host synchronisation calls). R is torch.quantile's
    linear interpolation, taken over the plan's count positions (the padding sorted after them as +inf)."""
    B = logprobs.shape[0]
    lp = logprobs.to(accumulation_dtype(logprobs.dtype))  # float32 (float64 stays float64)
    sums = torch.zeros(B, plan.T + 1, dtype=lp.dtype, device=lp.device).index_add_(1, plan.seg, lp)[:, :plan.T]
    c = torch.exp(sums / plan.lengths.to(lp.dtype))  # [B, T]
    C = c.mean(dim=1)
    p = torch.exp(lp)
    real = torch.arange(plan.W, device=lp.device) < plan.count
    srt = torch.sort(torch.where(real, p, torch.inf), dim=1).values
    rank, below, above = quantile_ranks(plan.q, plan.count, lp.dtype)
    lo, hi = srt.index_select(1, below), srt.index_select(1, above)
    R = torch.lerp(lo, hi, rank - below.to(lp.dtype)).squeeze(1)
    R = torch.where((torch.isnan(p) & real).any(dim=1), torch.nan, R)  # as torch.quantile: a NaN gives NaN
    if plan.T >= 2:
        G = torch.clamp(c[:, 1:] - c[:, :-1], min=0.0).mean(dim=1)
    else:
        G = torch.zeros(B, dtype=lp.dtype, device=lp.device)
    f = plan.alpha * C + plan.beta * R + plan.gamma * G
    return ProxyOut(f=f, C=C, R=R, G=G, c=c)


def checked_proxy(planned, logprobs, offsets, alpha, beta, gamma, q, check_values=True) -> ProxyOut:
    """Every implementation's proxy(): check the inputs, build the plan, call the implementation's planned form."""
    check_logprobs(logprobs, check_values)
    return planned(logprobs, ProxyPlan.build(offsets, logprobs.shape[1], logprobs.device, alpha, beta, gamma, q))


def proxy(
    logprobs: torch.Tensor,
    offsets: torch.Tensor,
    alpha: float = 0.6,
    beta: float = 0.3,
    gamma: float = 0.1,
    q: float = 0.1,
    check_values: bool = True,
) -> ProxyOut:
    """Reference proxy.

    logprobs: [B, P] log p(target) at the P pooled span positions (any float dtype; computed in float32).
    offsets:  [T+1] int64, span i owns positions offsets[i]:offsets[i+1].
    check_values: see check_logprobs.
    Returns a ProxyOut of float32 tensors.
    """
    return checked_proxy(proxy_planned, logprobs, offsets, alpha, beta, gamma, q, check_values)
