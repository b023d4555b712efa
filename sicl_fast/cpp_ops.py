"""The C++ CPU path (extension `sicl_fast._C`, csrc/): proxy, perturbation batch and ascent step on float32 tensors.

Same functions as the torch reference (sicl_fast.proxy.proxy, sicl_fast.zo.perturb / update) and the same
noise as sicl_fast.rng bit for bit (so a seeded run perturbs identically on the CPU and, through the Triton
kernels, on a GPU). The directions U are regenerated inside the ops, never stored. Multithreaded with OpenMP;
results do not depend on the thread count.

Build: `pip install -e .` or `python setup.py build_ext --inplace`. Without the extension this module still
imports; `available()` is False and the ops raise a SiclError saying how to build it.

Public API:
    available() -> bool                        the extension is importable
    randn(seed, step, num, rows, d) -> U [num, rows, d] float32   (= sicl_fast.rng.directions)
    perturb(X, seed, step, N, mu, a, b, estimator="forward") -> batch [B, b, d]
    update(X, X0, f, seed, step, N, a, b, mu, eta, kappa, estimator, grad_mode, clip_norm, projection_scope)
        -> (X_new [L, d], fired)
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q) -> ProxyOut
    CppOps                                     step ops for Calibrator (interface of sicl_fast.zo.TorchOps)
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import NumericalError, SiclError
from .proxy import ProxyOut, check_offsets
from .rng import check_counter_range, step_seed
from .zo import GRAD_MODES, PROJECTION_SCOPES, batch_size

try:  # the extension is optional
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built
    _C = None
    _IMPORT_ERROR = exc

BUILD_HINT = "build it with `pip install -e .` or `python setup.py build_ext --inplace` (needs a C++17 compiler)"


def available() -> bool:
    return _C is not None


def _ext():
    if _C is None:
        raise SiclError(f"the C++ extension sicl_fast._C is not built ({_IMPORT_ERROR}); {BUILD_HINT}")
    return _C


def num_threads() -> int:
    return int(_ext().num_threads())


def set_num_threads(n: int) -> None:
    _ext().set_num_threads(int(n))


def _f32(x: float) -> float:
    return float(np.float32(x))


def _cpu_f32(t: torch.Tensor, name: str, op: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SiclError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise SiclError(f"{op}: the C++ path runs on the CPU; {name} is on {t.device}")
    if t.dtype != torch.float32:
        raise SiclError(f"{op}: {name} must be float32, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != dims:
        raise SiclError(f"{op}: {name} must have {dims} dims, got shape {list(t.shape)}")
    return t.detach().contiguous()


def _check_block(N: int, a: int, b: int, L: int, d: int, op: str) -> None:
    if N < 1:
        raise SiclError(f"{op}: N must be >= 1, got {N}")
    if not 0 <= a < b <= L:
        raise SiclError(f"{op}: perturbed rows [a, b) = [{a}, {b}) must satisfy 0 <= a < b <= L = {L}")
    check_counter_range(N, b - a, d)


def randn(seed: int, step: int, num: int, rows: int, d: int) -> torch.Tensor:
    """U [num, rows, d] float32, bit-identical to sicl_fast.rng.directions(seed, step, num, rows, d)."""
    check_counter_range(num, rows, d)
    out = torch.empty(num, rows, d, dtype=torch.float32)
    if out.numel():
        _ext().randn(out.view(-1).numpy(), step_seed(seed, step))
    return out


def perturb(X: torch.Tensor, seed: int, step: int, N: int, mu: float, a: int, b: int,
            estimator: str = "forward") -> torch.Tensor:
    """The perturbation batch [B, b, d] of sicl_fast.zo.perturb with U = rng.directions(seed, step, N, b-a, d)."""
    op = "cpp perturb"
    X = _cpu_f32(X, "X", op, 2)
    L, d = X.shape
    _check_block(N, a, b, L, d, op)
    B = batch_size(N, estimator)
    out = torch.empty(B, b, d, dtype=torch.float32)
    _ext().perturb(X.numpy(), out.numpy(), step_seed(seed, step), N, a, b, _f32(mu), estimator == "central")
    return out


def update(X: torch.Tensor, X0: torch.Tensor, f: torch.Tensor, seed: int, step: int, N: int, a: int, b: int,
           mu: float, eta: float, kappa: float, estimator: str = "forward", grad_mode: str = "clip",
           clip_norm: float = 1.0, projection_scope: str = "prompt") -> tuple[torch.Tensor, bool]:
    """One ascent step (sicl_fast.zo.update's function); U regenerated from (seed, step). X is not modified."""
    op = "cpp update"
    if grad_mode not in GRAD_MODES:
        raise SiclError(f"unknown grad_mode {grad_mode!r}; choose one of {GRAD_MODES}")
    if projection_scope not in PROJECTION_SCOPES:
        raise SiclError(f"unknown projection_scope {projection_scope!r}; choose one of {PROJECTION_SCOPES}")
    X = _cpu_f32(X, "X", op, 2)
    X0 = _cpu_f32(X0, "X0", op, 2)
    L, d = X.shape
    if X0.shape != X.shape:
        raise SiclError(f"{op}: X0 must have X's shape {list(X.shape)}, got {list(X0.shape)}")
    _check_block(N, a, b, L, d, op)
    B = batch_size(N, estimator)
    f = _cpu_f32(f.reshape(-1).float() if isinstance(f, torch.Tensor) else f, "f", op, 1)
    if f.shape[0] != B:
        raise SiclError(f"{op}: f must have B = {B} entries for N = {N} ({estimator}), got {f.shape[0]}")
    out = torch.empty_like(X)
    fired = _ext().update(
        X.numpy(), X0.numpy(), f.numpy(), out.numpy(), step_seed(seed, step), N, a, b, _f32(mu), _f32(eta),
        float(kappa), estimator == "central", grad_mode == "normalize", _f32(clip_norm), projection_scope == "demos",
    )
    return out, bool(fired)


def proxy(logprobs: torch.Tensor, offsets: torch.Tensor, alpha: float = 0.6, beta: float = 0.3,
          gamma: float = 0.1, q: float = 0.1) -> ProxyOut:
    """sicl_fast.proxy.proxy on float32 CPU log-probs [B, P]."""
    op = "cpp proxy"
    if not 0.0 <= q <= 1.0:
        raise SiclError(f"q must be in [0, 1], got {q}")
    lp = _cpu_f32(logprobs, "logprobs", op, 2)
    B, P = lp.shape
    offsets = torch.as_tensor(offsets, dtype=torch.int64).cpu().contiguous()
    check_offsets(offsets, P)
    if bool(torch.isnan(lp).any()) or bool((lp == float("inf")).any()):
        raise NumericalError("span log-probabilities contain NaN or +inf")
    T = offsets.numel() - 1
    f, C, R, G = (torch.empty(B, dtype=torch.float32) for _ in range(4))
    c = torch.empty(B, T, dtype=torch.float32)
    _ext().proxy(lp.numpy(), offsets.numpy(), float(alpha), float(beta), float(gamma), float(q),
                 f.numpy(), C.numpy(), R.numpy(), G.numpy(), c.numpy())
    return ProxyOut(f=f, C=C, R=R, G=G, c=c)


class CppOps:
    """Step ops on the C++ extension (interface of sicl_fast.zo.TorchOps): float32 CPU tensors."""

    name = "cpp"

    def __init__(self) -> None:
        _ext()

    def perturb(self, X, step: int, cfg, a: int, b: int) -> torch.Tensor:
        return perturb(X, cfg.seed, step, cfg.N, cfg.mu_eff, a, b, cfg.estimator)

    def update(self, X, X0, f, step: int, cfg, a: int, b: int) -> tuple[torch.Tensor, bool]:
        return update(X, X0, f, cfg.seed, step, cfg.N, a, b, cfg.mu_eff, cfg.eta_eff, cfg.kappa, cfg.estimator,
                      cfg.grad_mode, cfg.clip_norm, cfg.projection_scope)


__all__ = ["available", "num_threads", "set_num_threads", "randn", "perturb", "update", "proxy", "CppOps",
           "BUILD_HINT"]
