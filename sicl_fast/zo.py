"""Zeroth-order ascent step, torch reference: perturbation batch, gradient estimate, clip, step, projection.

Shapes: X, X0 [L, d] float32 (the whole prompt); rows [a, b) are the perturbed demonstration block, R = b - a;
U [N, R, d] float32 directions from `sicl_fast.rng.directions(seed, step, N, R, d)`.

Batch layout (B rows, each the first b prompt rows, since nothing after b changes the proxy):
    forward estimator:  row 0 = X,  row 1 + i = X + mu U_i                       (B = N + 1)
    central estimator:  row 0 = X,  row 1 + 2i = X + mu U_i, row 2 + 2i = X - mu U_i   (B = 2N + 1)

The fused kernels (sicl_fast.kernels, sicl_fast._C) implement `perturb` and `update` below without storing U and
are tested against these functions.
"""
from __future__ import annotations

import torch

from .errors import SiclError
from .rng import directions

ESTIMATORS = ("forward", "central")
GRAD_MODES = ("clip", "normalize")
PROJECTION_SCOPES = ("prompt", "demos")


def batch_size(N: int, estimator: str) -> int:
    if estimator not in ESTIMATORS:
        raise SiclError(f"unknown estimator {estimator!r}; choose one of {ESTIMATORS}")
    return 2 * N + 1 if estimator == "central" else N + 1


def perturb(X: torch.Tensor, U: torch.Tensor, mu: float, a: int, b: int, estimator: str = "forward") -> torch.Tensor:
    """The perturbation batch [B, b, d] (layout in the module docstring). X [L, d], U [N, R=b-a, d]."""
    N = U.shape[0]
    B = batch_size(N, estimator)
    base = X[:b]
    out = base.unsqueeze(0).repeat(B, 1, 1)
    if estimator == "forward":
        out[1:, a:b] += mu * U
    else:
        out[1::2, a:b] += mu * U
        out[2::2, a:b] -= mu * U
    return out


def estimate_gradient(f: torch.Tensor, U: torch.Tensor, mu: float, estimator: str = "forward") -> torch.Tensor:
    """g [R, d] from proxy values f [B] (batch layout above) and the same directions U [N, R, d].

    forward: g = mean_i (f_i - f_0) / mu * U_i;   central: g = mean_i (f_i^+ - f_i^-) / (2 mu) * U_i
    """
    w = finite_differences(f, mu, estimator)  # [N]
    return torch.einsum("n,nrd->rd", w.to(U.dtype), U) / U.shape[0]


def finite_differences(f: torch.Tensor, mu: float, estimator: str = "forward") -> torch.Tensor:
    """The N directional-derivative estimates [N] that weight the directions."""
    f = f.float()
    if estimator == "forward":
        return (f[1:] - f[0]) / mu
    return (f[1::2] - f[2::2]) / (2.0 * mu)


def snr(f: torch.Tensor, mu: float, estimator: str = "forward") -> float:
    """|mean| / std of the finite differences: below ~1 the gradient estimate is mostly noise (0 for N < 2)."""
    diffs = finite_differences(f, mu, estimator)
    if diffs.numel() < 2:
        return 0.0
    return float(diffs.mean().abs() / (diffs.std() + 1e-12))


def clip_rows(g: torch.Tensor, max_norm: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """Scale each token row of g [R, d] down to L2 norm <= max_norm (rows below it pass unchanged)."""
    norms = g.norm(dim=-1, keepdim=True)
    return g * torch.clamp(max_norm / (norms + eps), max=1.0)


def normalize_rows(g: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Scale each token row of g [R, d] to unit L2 norm (every token moves by eta)."""
    return g / (g.norm(dim=-1, keepdim=True) + eps)


def cosine(X: torch.Tensor, X0: torch.Tensor) -> float:
    """cos(X, X0) over the flattened matrices, in float64 for a stable comparison with kappa."""
    x, x0 = X.double().flatten(), X0.double().flatten()
    return float(torch.dot(x, x0) / (x.norm() * x0.norm()))


def project_cosine(X: torch.Tensor, X0: torch.Tensor, kappa: float) -> tuple[torch.Tensor, bool]:
    """If cos(X, X0) < kappa, move X onto cos = kappa keeping its norm; returns (X', fired).

    X' = |X| (kappa * x0_hat + sqrt(1 - kappa^2) * perp_hat), perp = the part of X orthogonal to X0.
    (The reference's x_par + alpha x_perp rescaled to |X| is the same point when X . X0 > 0; this form also
    handles X . X0 <= 0.) Computed in float64, returned in X's dtype.
    """
    if cosine(X, X0) >= kappa:
        return X, False
    x, x0 = X.double(), X0.double()
    x0_hat = x0 / x0.norm()
    perp = x - (x * x0_hat).sum() * x0_hat
    pn = perp.norm()
    if float(pn) <= 1e-12:
        out = x.norm() * x0_hat  # X is antiparallel to X0: any orthogonal direction would do; stay on the axis
    else:
        out = x.norm() * (kappa * x0_hat + (1.0 - kappa**2) ** 0.5 * perp / pn)
    return out.to(X.dtype), True


def update(
    X: torch.Tensor,
    X0: torch.Tensor,
    f: torch.Tensor,
    U: torch.Tensor,
    a: int,
    b: int,
    mu: float,
    eta: float,
    kappa: float,
    estimator: str = "forward",
    grad_mode: str = "clip",
    clip_norm: float = 1.0,
    projection_scope: str = "prompt",
) -> tuple[torch.Tensor, bool]:
    """One ascent step: g from f and U, clip (or normalise) per row, X[a:b] += eta g, cosine projection.

    Returns (X_new [L, d], projection_fired). X is not modified in place.
    """
    if grad_mode not in GRAD_MODES:
        raise SiclError(f"unknown grad_mode {grad_mode!r}; choose one of {GRAD_MODES}")
    if projection_scope not in PROJECTION_SCOPES:
        raise SiclError(f"unknown projection_scope {projection_scope!r}; choose one of {PROJECTION_SCOPES}")
    g = estimate_gradient(f, U, mu, estimator)
    g = clip_rows(g, clip_norm) if grad_mode == "clip" else normalize_rows(g)
    X = X.clone()
    X[a:b] += eta * g
    if kappa <= 0:
        return X, False
    if projection_scope == "prompt":
        return project_cosine(X, X0, kappa)
    block, fired = project_cosine(X[a:b], X0[a:b], kappa)
    X[a:b] = block
    return X, fired


class TorchOps:
    """Reference step ops: materialise U with the counter-based RNG, then the functions above.

    The fused ops (Triton, C++) have the same two methods and regenerate U instead of storing it.
    """

    name = "torch"

    def perturb(self, X, step: int, cfg, a: int, b: int) -> torch.Tensor:
        U = directions(cfg.seed, step, cfg.N, b - a, X.shape[1], device=X.device)
        return perturb(X, U, cfg.mu_eff, a, b, cfg.estimator)

    def update(self, X, X0, f, step: int, cfg, a: int, b: int) -> tuple[torch.Tensor, bool]:
        U = directions(cfg.seed, step, cfg.N, b - a, X.shape[1], device=X.device)
        return update(
            X, X0, f, U, a, b, cfg.mu_eff, cfg.eta_eff, cfg.kappa, cfg.estimator, cfg.grad_mode, cfg.clip_norm,
            cfg.projection_scope,
        )
