"""Zeroth-order ascent step, torch reference: perturbation batch, gradient estimate, clip, step, projection.

Shapes: X, X0 [L, d] float32 (the whole prompt); rows [a, b) are the perturbed demonstration block, R = b - a;
U [N, R, d] float32 directions from `sicl_fast.step.rng.directions(seed, step, N, R, d)`. The step's
arguments travel as one `sicl_fast.step.spec.StepSpec`.

Batch layout (B rows, each the first b prompt rows, since nothing after b changes the proxy):
    forward estimator:  row 0 = X,  row 1 + i = X + mu U_i                       (B = N + 1)
    central estimator:  row 0 = X,  row 1 + 2i = X + mu U_i, row 2 + 2i = X - mu U_i   (B = 2N + 1)

The C++ and Triton step ops (sicl_fast.ops) compute `perturb` and `update` below without storing U and are
tested against these functions.

A length bucket (sicl_fast.run.buckets) runs a prompt padded: spec.b is the bucket's rows, and `rows_end`, an int64
[1] tensor on X's device, is where the prompt's own block ends. The directions are then those of the block
[a, rows_end) (zero after it), and the "demos" projection covers [a, rows_end): rows [rows_end, b) never move, and
the step is the unpadded prompt's.
"""
from __future__ import annotations

import torch

from .rng import directions
from .spec import StepSpec, batch_size


def step_directions(step: int, spec: StepSpec, device=None, rows_end=None) -> torch.Tensor:
    """U [N, R, d] float32 of one step: the noise every implementation draws (or regenerates) for it. rows_end: the
    real block's end (module docstring), or None (b)."""
    live = None if rows_end is None else rows_end - spec.a
    return directions(spec.seed, step, spec.N, spec.rows, spec.d, device=device, live=live)


def perturb(X: torch.Tensor, U: torch.Tensor, spec: StepSpec) -> torch.Tensor:
    """The perturbation batch [B, b, d] (layout in the module docstring). X [L, d], U [N, R, d]."""
    a, b = spec.a, spec.b
    out = X[:b].unsqueeze(0).repeat(spec.B, 1, 1)
    if spec.central:
        out[1::2, a:b] += spec.mu * U
        out[2::2, a:b] -= spec.mu * U
    else:
        out[1:, a:b] += spec.mu * U
    return out


def finite_differences(f: torch.Tensor, mu: float, estimator: str = "forward") -> torch.Tensor:
    """The N directional-derivative estimates [N] that weight the directions."""
    f = f.float()
    if estimator == "forward":
        return (f[1:] - f[0]) / mu
    return (f[1::2] - f[2::2]) / (2.0 * mu)


def estimate_gradient(f: torch.Tensor, U: torch.Tensor, mu: float, estimator: str = "forward") -> torch.Tensor:
    """g [R, d] from proxy values f [B] (batch layout above) and the same directions U [N, R, d].

    forward: g = mean_i (f_i - f_0) / mu * U_i;   central: g = mean_i (f_i^+ - f_i^-) / (2 mu) * U_i
    """
    w = finite_differences(f, mu, estimator)  # [N]
    return torch.einsum("n,nrd->rd", w.to(U.dtype), U) / U.shape[0]


def snr_of(f: torch.Tensor, mu: float, estimator: str = "forward") -> torch.Tensor:
    """|mean| / std of the finite differences, [1] float32 on f's device (no host read): below ~1 the gradient
    estimate is mostly noise (0 for N < 2)."""
    diffs = finite_differences(f, mu, estimator)
    if diffs.numel() < 2:
        return torch.zeros(1, dtype=torch.float32, device=f.device)
    return (diffs.mean().abs() / (diffs.std() + 1e-12)).reshape(1)


def snr(f: torch.Tensor, mu: float, estimator: str = "forward") -> float:
    """snr_of read back: a python float (the eager loop)."""
    return float(snr_of(f, mu, estimator))


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


def project_cosine_on_device(X: torch.Tensor, X0: torch.Tensor, kappa: float) -> tuple[torch.Tensor, torch.Tensor]:
    """project_cosine with the decision kept on the device: the same float64 operations, then a select, so no
    host read; returns (X', fired int32 [1]). Bit for bit project_cosine's X' when it fires, X when not."""
    x, x0 = X.double(), X0.double()
    xn = x.norm()
    fire = torch.dot(x.flatten(), x0.flatten()) / (xn * x0.norm()) < kappa
    x0_hat = x0 / x0.norm()
    perp = x - (x * x0_hat).sum() * x0_hat
    pn = perp.norm()
    axis = pn <= 1e-12
    on_cone = xn * (kappa * x0_hat + (1.0 - kappa**2) ** 0.5 * perp / torch.where(axis, torch.ones_like(pn), pn))
    out = torch.where(axis, xn * x0_hat, on_cone)
    return torch.where(fire, out.to(X.dtype), X), fire.to(torch.int32).reshape(1)


def update(X: torch.Tensor, X0: torch.Tensor, f: torch.Tensor, U: torch.Tensor, spec: StepSpec,
           on_device: bool = False, rows_end=None):
    """One zeroth-order ascent step: g from f and U (estimate_gradient), then `ascend`.

    Returns (X_new [L, d], projection_fired) as `ascend` does. X is not modified in place.
    """
    return ascend(X, X0, estimate_gradient(f, U, spec.mu, spec.estimator), spec, on_device, rows_end)


def ascend(X: torch.Tensor, X0: torch.Tensor, g: torch.Tensor, spec: StepSpec, on_device: bool = False,
           rows_end=None):
    """The step shared by every estimator: clip (or normalise) g [R, d] per row, X[a:b] += eta g, cosine projection.
    g is a zeroth-order estimate (`update`) or the exact gradient (sicl_fast.calibration.grad); both go through this one
    function so the two ascents are comparable step for step.

    Returns (X_new [L, d], projection_fired): a bool, or with on_device an int32 [1] tensor decided without a
    host read (project_cosine_on_device). X is not modified in place. rows_end: a padded block's end (module
    docstring; g is zero after it).
    """
    a, b = spec.a, spec.b
    g = clip_rows(g, spec.clip_norm) if spec.grad_mode == "clip" else normalize_rows(g)
    X = X.clone()
    X[a:b] += spec.eta * g.to(X.dtype)
    project = project_cosine_on_device if on_device else project_cosine
    if not spec.project:
        return X, (torch.zeros(1, dtype=torch.int32, device=X.device) if on_device else False)
    if spec.scope == "prompt":
        return project(X, X0, spec.kappa)
    if rows_end is None:
        block, fired = project(X[a:b], X0[a:b], spec.kappa)
    else:  # the padding's rows out of the sums and left as they are
        own = (torch.arange(a, b, device=X.device) < rows_end).view(-1, 1)
        block, fired = project(X[a:b] * own, X0[a:b] * own, spec.kappa)
        block = torch.where(own, block, X[a:b])
    X[a:b] = block
    return X, fired


__all__ = ["step_directions", "perturb", "finite_differences", "estimate_gradient", "snr_of", "snr", "clip_rows",
           "normalize_rows", "cosine", "project_cosine", "project_cosine_on_device", "update", "ascend", "batch_size"]
