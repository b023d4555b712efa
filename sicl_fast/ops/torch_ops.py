"""The reference implementation of both ops protocols (sicl_fast.ops.base), in plain torch (any device).

TorchStepOps materialises the directions U with the counter-based RNG (sicl_fast.step.rng) and calls the
reference functions: sicl_fast.step.zo (step), sicl_fast.step.proxy,
sicl_fast.step.logprobs (span heads), sicl_fast.step.best (best-X tracking),
sicl_fast.step.step_state (the static step's bookkeeping). TorchDecoderOps calls
sicl_fast.models.elementwise (the decoder's norms, rotary, activation, soft-cap) and sicl_fast.models.rows (the
difference form's row epilogues). Neither ever calls C++ or Triton code. The C++ and Triton implementations subclass
them for the ops they lack.
"""
from __future__ import annotations

import torch

from ..step import best, zo
from ..step.logprobs import rows_logprobs, vocab_chunked_logprobs
from ..models import elementwise as ew
from ..models import rows
from ..models.reference import split_bf16_reference

from ..models.weights import fp8_rows
from ..step.proxy import ProxyOut, checked_proxy, proxy_planned
from ..step.spec import StepSpec
from ..step.step_state import bookkeep_reference
from .base import fired_tensor


class TorchStepOps:
    """The reference step ops (module docstring)."""

    name = "torch"
    proxy_planned = staticmethod(proxy_planned)
    span_head = staticmethod(vocab_chunked_logprobs)
    span_head_rows = staticmethod(rows_logprobs)
    track_best = staticmethod(best.track_best)
    bookkeep = staticmethod(bookkeep_reference)

    def cached_tensors(self) -> list:
        return []  # the reference caches nothing on the device

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out=None, rows_end=None) -> torch.Tensor:
        spec.check_X(X, "X", f"{self.name} perturb")
        batch = zo.perturb(X, zo.step_directions(step, spec, X.device, rows_end), spec)
        return batch if out is None else out.copy_(batch)

    def update(self, X, X0, f, step, spec: StepSpec, out=None, rows_end=None) -> tuple[torch.Tensor, torch.Tensor]:
        op = f"{self.name} update"
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        spec.check_f(f, op)
        U = zo.step_directions(step, spec, X.device, rows_end)
        on_device = isinstance(step, torch.Tensor)  # device-resident state: decide the projection there too
        X_new, fired = zo.update(X, X0, f.reshape(-1), U, spec, on_device=on_device, rows_end=rows_end)
        if not on_device:
            fired = fired_tensor(fired, X.device)
        return (X_new, fired) if out is None else (out.copy_(X_new), fired)

    def ascend(self, X, X0, g, spec: StepSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The step from a given gradient g [R, d] (the exact one, sicl_fast.calibration.grad): clip / normalise, eta,
        projection (zo.ascend, the same function the zeroth-order update ends in)."""
        op = f"{self.name} ascend"
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        X_new, fired = zo.ascend(X, X0, g, spec)
        return X_new, fired_tensor(fired, X.device)

    def proxy(self, logprobs, offsets, alpha=0.6, beta=0.3, gamma=0.1, q=0.1, check_values=True) -> ProxyOut:
        return checked_proxy(self.proxy_planned, logprobs, offsets, alpha, beta, gamma, q, check_values)


class TorchDecoderOps:
    """The reference decoder ops (module docstring): out of place, differentiable."""

    name = "torch"
    kv_in_place = False  # qk_rope's k_out / v_out cost a copy here: the decoder passes none
    gated = staticmethod(ew.gated)
    softcap_ = staticmethod(ew.softcap)
    norm_rows = staticmethod(rows.norm_rows_reference)
    rope_rows = staticmethod(rows.rope_rows_reference)
    gated_rows = staticmethod(rows.gated_rows_reference)
    split_bf16 = staticmethod(split_bf16_reference)

    fp8_rows = staticmethod(fp8_rows)

    def residual_norm(self, x, y, post_w, w, eps: float, gemma: bool):
        if y is None:
            return x, ew.rms_norm(x, w, eps, gemma)
        return ew.residual_norm(x, y, post_w, w, eps, gemma)

    def qk_rope(self, q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None, v_out=None):
        q, k = ew.qk_rope(q, k, cos, sin, q_norm, k_norm, eps, gemma)
        if k_out is not None:
            k, v = k_out.copy_(k), v_out.copy_(v)
        return q, k, v


__all__ = ["TorchStepOps", "TorchDecoderOps"]
