"""TritonOps: the Ops protocol on the Triton kernels (`sicl_fast.kernels`): perturb, update, proxy, span head and
best tracking with the noise regenerated in the kernels (bit-identical to sicl_fast.rng's), the decoder's fused
elementwise kernels (norm + residual, rotary, gated activation, soft-cap) and the difference products'
epilogues. The fused attention kernel is chosen by the decoder's Attention (impl 'triton').

The kernels run on CUDA, or on the CPU through Triton's interpreter when TRITON_INTERPRET=1 was set before
triton was first imported (slow: for tests). Nothing here synchronises with the host except the proxy's
optional value check (check_values=True).
"""
from __future__ import annotations

import torch

from ..errors import SiclError
from ..proxy import ProxyOut, ProxyPlan
from ..spec import StepSpec
from .torch_ops import TorchOps


def load_kernels(device=None, what: str = "impl 'triton'", instead: str = "impl 'torch' / 'cpp'"):
    """The installed `sicl_fast.kernels` package; a SiclError that says what to do when triton is missing, or
    when `device` (if given) is neither CUDA nor the CPU under Triton's interpreter (`what` needs the kernels;
    `instead` names what to use otherwise)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise SiclError(f"{what} needs the `triton` package (pip install triton==3.6.0): {exc}") from None
    from .. import kernels

    if device is not None and torch.device(device).type != "cuda" and not kernels.interpreting():
        raise SiclError(f"{what} runs on CUDA; for {torch.device(device)} tensors set TRITON_INTERPRET=1 before "
                        f"triton is imported (Triton's interpreter, slow) or use {instead}")
    return kernels


class TritonOps(TorchOps):
    """The Ops protocol on the Triton kernels (module docstring). device: where the tensors will live."""

    name = "triton"
    kv_in_place = True  # qk_rope writes K / V straight into the decoder's buffers

    def __init__(self, device="cuda") -> None:
        self.K = load_kernels(device)

    def cached_tensors(self) -> list:
        return self.K.cached_tensors()

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out=None) -> torch.Tensor:
        return self.K.perturb(X.float(), step, spec, out=out)

    def update(self, X, X0, f, step, spec: StepSpec, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.K.zo_update(X.float(), X0.float(), f, step, spec, out=out)

    def proxy_planned(self, logprobs, plan: ProxyPlan) -> ProxyOut:
        return self.K.proxy_planned(logprobs, plan)

    def span_head(self, hidden, weight, targets, softcap=None) -> torch.Tensor:
        # a prompt's targets: checked once by sicl_fast.checks.check_tokens, never read back per step
        return self.K.span_logprobs(hidden, weight, targets, softcap=softcap, check_targets=False)

    def track_best(self, f, X, state):
        return self.K.track_best(f, X, state)

    def diff_rows(self, x):
        return self.K.diff_rows(x)

    def add_rows(self, y0, yd):
        return self.K.add_rows(y0, yd)

    def gated_diff(self, y0, yd, act, act_name: str):
        return self.K.gated_diff(y0, yd, act_name)

    def advance(self, st, f, fired, cfg) -> None:
        self.K.advance(st, f, fired, cfg)

    def residual_norm(self, x, y, post_w, w, eps: float, gemma: bool):
        return self.K.residual_norm(x, y, post_w, w, eps, gemma)

    def qk_rope(self, q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None, v_out=None):
        return self.K.qk_rope(q, k, v, cos, sin, q_norm, k_norm, eps, gemma, k_out, v_out)

    def gated(self, gate, up, act_name: str):
        return self.K.gated(gate, up, act_name)

    def softcap_(self, x, cap: float):
        return self.K.softcap_(x, cap)


__all__ = ["TritonOps", "load_kernels"]
