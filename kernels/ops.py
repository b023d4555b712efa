"""TritonOps: the ascent's step ops on the Triton kernels (interface of sicl_fast.zo.TorchOps)."""
from __future__ import annotations

import torch

from .perturb import perturb
from .zo_update import zo_update


class TritonOps:
    """perturb / update with the noise regenerated in the kernels (bit-identical to sicl_fast.rng's).

    `update` returns (X_new, fired) with fired a python bool, which reads one int32 from the device; use
    `update_async` in a loop that must not synchronise (fired stays an int32 [1] device tensor).
    """

    name = "triton"

    def perturb(self, X: torch.Tensor, step: int, cfg, a: int, b: int) -> torch.Tensor:
        return perturb(X.float(), cfg.seed, step, cfg.N, cfg.mu_eff, a, b, cfg.estimator)

    def update_async(self, X, X0, f, step: int, cfg, a: int, b: int):
        return zo_update(
            X.float(), X0.float(), f, cfg.seed, step, cfg.N, a, b, cfg.mu_eff, cfg.eta_eff, cfg.kappa, cfg.estimator,
            cfg.grad_mode, cfg.clip_norm, cfg.projection_scope,
        )

    def update(self, X, X0, f, step: int, cfg, a: int, b: int) -> tuple[torch.Tensor, bool]:
        X_new, fired = self.update_async(X, X0, f, step, cfg, a, b)
        return X_new, bool(fired.item())
