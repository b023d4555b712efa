"""TorchOps: the reference implementation of every op of the `Ops` protocol, in plain torch (any device).

It materialises the directions U with the counter-based RNG (sicl_fast.rng) and calls the reference functions:
sicl_fast.zo (step), sicl_fast.proxy, sicl_fast.logprobs (span head), sicl_fast.models.diff (difference
epilogues), sicl_fast.best (best-X tracking). It never calls C++ or Triton code.
"""
from __future__ import annotations

import torch

from .. import best, zo
from ..logprobs import vocab_chunked_logprobs
from ..models import diff
from ..proxy import ProxyOut
from ..proxy import proxy as reference_proxy
from ..spec import StepSpec
from .base import fired_tensor


class TorchOps:
    """The reference ops (module docstring). CppOps and TritonOps subclass it for the ops they lack."""

    name = "torch"

    def perturb(self, X: torch.Tensor, step: int, spec: StepSpec) -> torch.Tensor:
        spec.check_X(X, "X", f"{self.name} perturb")
        return zo.perturb(X, zo.step_directions(step, spec, device=X.device), spec)

    def update(self, X, X0, f, step: int, spec: StepSpec) -> tuple[torch.Tensor, torch.Tensor]:
        op = f"{self.name} update"
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        spec.check_f(f, op)
        X_new, fired = zo.update(X, X0, f.reshape(-1), zo.step_directions(step, spec, device=X.device), spec)
        return X_new, fired_tensor(fired, X.device)

    def proxy(self, logprobs, offsets, alpha=0.6, beta=0.3, gamma=0.1, q=0.1, check_values=True) -> ProxyOut:
        return reference_proxy(logprobs, offsets, alpha, beta, gamma, q, check_values=check_values)

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


__all__ = ["TorchOps"]
