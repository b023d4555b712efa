"""StepSpec: the arguments of one ascent step, built once and checked once.

Every implementation of the step ops (torch reference, C++, Triton; sicl_fast.ops) takes the same object in the
same place, `perturb(X, step, spec)` and `update(X, X0, f, step, spec)`, and trusts it: the checks below are the
only ones (the C++ extension keeps its own buffer-bounds guards, which protect raw pointers, not users).

Shapes: X, X0 [L, d] float32; rows [a, b) are perturbed (R = b - a); the batch has B rows of the first b
prompt rows (B = N + 1 forward, 2N + 1 central; layout in sicl_fast.step.zo). The "grad" estimator runs no
perturbation batch: one forward and one backward of row 0 (B = 1) give the exact gradient
(sicl_fast.calibration.grad); N is unused then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import SiclError
from .rng import check_counter_range

ESTIMATORS = ("forward", "central", "grad")  # grad: the exact gradient by autograd (sicl_fast.calibration.grad)
GRAD_MODES = ("clip", "normalize")
PROJECTION_SCOPES = ("prompt", "demos")
# the categorical knobs of a step, in one table: each one's choices (check_choices)
CHOICES = {"estimator": ESTIMATORS, "grad_mode": GRAD_MODES, "projection_scope": PROJECTION_SCOPES}


def check_choice(value, choices: tuple, name: str, where: str) -> None:
    """The one check of a categorical knob."""
    if value not in choices:
        raise SiclError(f"{where}: unknown {name} {value!r}; choose one of {choices}")


def check_choices(where: str, **knobs) -> None:
    """check_choice of each categorical knob name=value of a step against its choices (CHOICES), in order."""
    for name, value in knobs.items():
        check_choice(value, CHOICES[name], name, where)


def batch_size(N: int, estimator: str) -> int:
    """Rows of one step's forward: N + 1 (forward), 2N + 1 (central) or 1 (grad: row 0 only, then a backward)."""
    check_choice(estimator, ESTIMATORS, "estimator", "batch_size")
    if estimator == "grad":
        return 1
    return 2 * N + 1 if estimator == "central" else N + 1


def block_end(cfg, prompt, bucket=None) -> int:
    """b, the end of `prompt`'s perturbed block under the CalibrationConfig cfg: the last output span's end, or the
    prompt's (perturb_query); with a length bucket (sicl_fast.run.buckets), the padded step's: its rows, or its
    length (perturb_query)."""
    if bucket is not None:
        return bucket.length if cfg.perturb_query else bucket.rows
    return prompt.length if cfg.perturb_query else prompt.demo_end


def prefix_policy(kappa: float, scope: str) -> str:
    """How a step's forward treats rows [0, a), which no step perturbs: 'kept' when nothing rescales them during a
    run (the projection covers rows [a, b) only, or is off: kappa <= 0), else 'pass' (the whole-matrix projection
    may rescale them: they run in every step's pass). See sicl_fast.backends.step_forward."""
    return "kept" if not kappa > 0 or scope == "demos" else "pass"


def f32(x: float) -> float:
    """x rounded to float32 (as a python float), so every implementation converts the same value exactly."""
    return float(np.float32(x))


@dataclass(frozen=True)
class StepSpec:
    """One prompt's ascent step: X is [L, d]; rows [a, b) are perturbed by N directions of radius mu; the update
    moves them by eta (effective units, already scaled), clips (or normalises) per row to clip_norm, and projects
    onto cos(X, X0) >= kappa over the whole matrix ("prompt") or rows [a, b) ("demos"); kappa <= 0: no
    projection. The noise of step s is keyed by (seed, s)."""

    L: int
    d: int
    a: int
    b: int
    N: int
    mu: float
    eta: float
    kappa: float
    seed: int = 0
    estimator: str = "forward"
    grad_mode: str = "clip"
    clip_norm: float = 1.0
    scope: str = "prompt"
    # worked out once from the fields above (__post_init__), read by the plan and by every step's ops: B, the batch
    # rows (batch_size); rows, R = b - a; central, grad (the exact-gradient step: no directions, no perturbation
    # batch) and project (kappa > 0), the estimator's and the projection's switches; prefix_policy, how a step's
    # forward treats rows [0, a) (prefix_policy); project_rows, the rows [lo, hi) the cosine projection covers
    B: int = field(init=False, repr=False, compare=False)
    rows: int = field(init=False, repr=False, compare=False)
    central: bool = field(init=False, repr=False, compare=False)
    grad: bool = field(init=False, repr=False, compare=False)
    project: bool = field(init=False, repr=False, compare=False)
    prefix_policy: str = field(init=False, repr=False, compare=False)
    project_rows: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = "step"
        for name in ("L", "d", "a", "b", "N", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SiclError(f"{where}: {name} must be an int, got {v!r}")
        if self.N < 1:
            raise SiclError(f"{where}: N must be >= 1, got {self.N}")
        if not 0 <= self.a < self.b <= self.L:
            raise SiclError(f"{where}: perturbed rows [a, b) = [{self.a}, {self.b}) must satisfy "
                            f"0 <= a < b <= L = {self.L}")
        if not 0 <= self.seed < 2**32:
            raise SiclError(f"{where}: seed must be in [0, 2**32), got {self.seed}")
        check_choices(where, estimator=self.estimator, grad_mode=self.grad_mode, projection_scope=self.scope)
        check_counter_range(self.N, self.b - self.a, self.d)
        derived = dict(B=batch_size(self.N, self.estimator), rows=self.b - self.a, central=self.estimator == "central",
                       grad=self.estimator == "grad", project=self.kappa > 0,
                       prefix_policy=prefix_policy(self.kappa, self.scope),
                       project_rows=(self.a, self.b) if self.scope == "demos" else (0, self.L))
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def build(cls, cfg, L: int, d: int, a: int, b: int) -> StepSpec:
        """From a CalibrationConfig (its effective mu / eta) for an [L, d] X with perturbed rows [a, b)."""
        return cls(L=L, d=d, a=a, b=b, N=cfg.N, mu=cfg.mu_eff, eta=cfg.eta_eff, kappa=cfg.kappa, seed=cfg.seed,
                   estimator=cfg.estimator, grad_mode=cfg.grad_mode, clip_norm=cfg.clip_norm,
                   scope=cfg.projection_scope)

    @classmethod
    def for_prompt(cls, cfg, prompt, X0, bucket=None) -> StepSpec:
        """The step of `prompt` (a Prompt) from X0 [L, d] (cfg with its scale resolved:
        CalibrationConfig.resolve_scale): perturbed rows [a, b) = [first demonstration token, end of the last output
        span) (block_end), or [a, L) with perturb_query; the forward always reads rows [0, demo_end) only. What every
        loop (eager, static, packed) steps with. bucket: a length bucket (sicl_fast.run.buckets), whose padded step
        has L = bucket.length and b = bucket.rows (or bucket.length with perturb_query; the block's own end then
        travels as the ops' rows_end, sicl_fast.step.zo)."""
        L = X0.shape[0] if bucket is None else bucket.length
        return cls.build(cfg, L, X0.shape[1], prompt.demo_start, block_end(cfg, prompt, bucket))

    def check_X(self, X, name: str, op: str) -> None:
        """X must be an [L, d] tensor of this spec."""
        if tuple(X.shape) != (self.L, self.d):
            raise SiclError(f"{op}: {name} must have shape [{self.L}, {self.d}], got {list(X.shape)}")

    def check_f(self, f, op: str) -> None:
        """f must hold the B proxy values of a perturbation batch."""
        if f.numel() != self.B:
            raise SiclError(f"{op}: f must have B = {self.B} entries for N = {self.N} ({self.estimator}), "
                            f"got {f.numel()}")


__all__ = ["StepSpec", "CHOICES", "ESTIMATORS", "GRAD_MODES", "PROJECTION_SCOPES", "batch_size", "block_end",
           "check_choice", "check_choices", "f32", "prefix_policy"]
