"""TorchOps: the reference implementation of every op of the `Ops` protocol, in plain torch (any device).

It materialises the directions U with the counter-based RNG (sicl_fast.rng) and calls the reference functions:
sicl_fast.zo (step), sicl_fast.proxy, sicl_fast.logprobs (span head), sicl_fast.models.diff (difference
epilogues), sicl_fast.best (best-X tracking), sicl_fast.models.elementwise (the decoder's norms, rotary,
activation, soft-cap). It never calls C++ or Triton code.
"""
from __future__ import annotations

import torch

from .. import best, zo
from ..logprobs import vocab_chunked_logprobs
from ..models import diff
from ..models import elementwise as ew
from ..proxy import ProxyOut, ProxyPlan, checked_proxy, proxy_planned
from ..spec import StepSpec
from .base import fired_tensor


class TorchOps:
    """The reference ops (module docstring). CppOps and TritonOps subclass it for the ops they lack."""

    name = "torch"
    kv_in_place = False  # qk_rope's k_out / v_out cost a copy here: the decoder passes none

    def cached_tensors(self) -> list:
        return []  # the reference caches nothing on the device

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out=None) -> torch.Tensor:
        spec.check_X(X, "X", f"{self.name} perturb")
        batch = zo.perturb(X, zo.step_directions(step, spec, device=X.device), spec)
        return batch if out is None else out.copy_(batch)

    def update(self, X, X0, f, step, spec: StepSpec, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        op = f"{self.name} update"
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        spec.check_f(f, op)
        U = zo.step_directions(step, spec, device=X.device)
        on_device = isinstance(step, torch.Tensor)  # device-resident state: decide the projection there too
        X_new, fired = zo.update(X, X0, f.reshape(-1), U, spec, on_device=on_device)
        if not on_device:
            fired = fired_tensor(fired, X.device)
        return (X_new, fired) if out is None else (out.copy_(X_new), fired)

    def ascend(self, X, X0, g, spec: StepSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from a given gradient g [R, d] (the exact one, sicl_fast.grad): clip / normalise, eta,
        projection (zo.ascend, the same function the zeroth-order update ends in)."""
        op = f"{self.name} ascend"
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        X_new, fired = zo.ascend(X, X0, g, spec)
        return X_new, fired_tensor(fired, X.device)

    def proxy(self, logprobs, offsets, alpha=0.6, beta=0.3, gamma=0.1, q=0.1, check_values=True) -> ProxyOut:
        return checked_proxy(self.proxy_planned, logprobs, offsets, alpha, beta, gamma, q, check_values)

    def proxy_planned(self, logprobs, plan: ProxyPlan) -> ProxyOut:
        return proxy_planned(logprobs, plan)

    def span_head(self, hidden, weight, targets, softcap=None) -> torch.Tensor:
        return vocab_chunked_logprobs(hidden, weight, targets, softcap=softcap)

    def diff_rows(self, x):
        return diff.diff_rows_reference(x)

    def add_rows(self, y0, yd):
        return diff.add_rows_reference(y0, yd)

    def gated_diff(self, y0, yd, act, act_name: str):
        return diff.gated_diff_reference(y0, yd, act)

    def track_best(self, f, X, state: best.BestState) -> best.BestState:
        return best.track_best(f, X, state)

    def advance(self, st, f, fired, cfg) -> None:
        from ..static import advance_reference  # static builds on the ops: imported when first used

        advance_reference(st, f, fired, cfg)

    # the decoder's elementwise work (sicl_fast.models.elementwise): out of place, differentiable

    def residual_norm(self, x, y, post_w, w, eps: float, gemma: bool):
        if y is None:
            return x, ew.rms_norm(x, w, eps, gemma)
        return ew.residual_norm(x, y, post_w, w, eps, gemma)

    def qk_rope(self, q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None, v_out=None):
        q, k = ew.qk_rope(q, k, cos, sin, q_norm, k_norm, eps, gemma)
        if k_out is not None:
            k, v = k_out.copy_(k), v_out.copy_(v)
        return q, k, v

    def gated(self, gate, up, act_name: str):
        return ew.gated(gate, up, act_name)

    def softcap_(self, x, cap: float):
        return ew.softcap(x, cap)


__all__ = ["TorchOps"]
