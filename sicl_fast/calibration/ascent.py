"""Algorithm 1: gated zeroth-order ascent on the demonstration embeddings, keeping the best X by proxy.

    f0 = f(X0); if f0 < tau: return X0                       (the gate, on the first step's row 0)
    repeat up to max_steps:
        f = f([X, X + mu U_1, ..., X + mu U_N])              (one batched forward)
        if f[0] > best: best, X_best = f[0], X
        if f[0] improves on the last counted f[0] (by more than min_delta; stop_rule.improves): counter = 0
        else: patience counter += 1
        stop when the counter reaches `patience` (or when the caller's hook / time budget says so)
        X <- X + eta * clip(g(f, U));  cosine projection onto cos(X, X0) >= kappa

estimator "grad" replaces the batched forward and g(f, U) by one forward of X and one backward (the exact
gradient, sicl_fast.calibration.grad); the gate, best X, patience, clip / normalise, eta and projection are the same.

mu and eta are given in units of the model's embedding scale s = mean row norm / sqrt(d) (the paper scales its
grids per model this way); `scale` overrides s (scale=1 gives absolute units).

The loop's decisions (gate, best X, patience, SNR skip and stop, max_steps) are step.stop_rule.decide's, the rule
the static and packed steps' bookkeeping runs on the device.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from ..step.stop_rule import HOST, decide
from ..run.checks import calibration_inputs
from ..errors import NumericalError, SiclError
from .grad import proxy_gradient
from ..run.knobs import F32_MAX, F32_TINY, check_mu, check_range
from ..run.run_args import BestAt, check_budget, stop_check
from ..formats.spans import Prompt
from ..step.spec import StepSpec, batch_size, check_choices
from ..step.zo import cosine, snr


MAX_STEP_SIZE = 1e3  # mu, eta: a perturbation or step a thousand times the embedding scale is no longer meaningful


@dataclass(frozen=True)
class CalibrationConfig:
    """Every knob of the ascent. Defaults are the paper's settings (N=16; 8 for models under 1B parameters)."""

    mu: float = 0.004  # smoothing radius, in units of `scale`
    N: int = 16  # Gaussian directions per step
    eta: float = 0.05  # step size, in units of `scale`
    kappa: float = 0.2  # cosine floor to X0; <= 0 turns the projection off
    tau: float = 0.05  # gate: no ascent when f(X0) < tau
    patience: int = 5  # steps without an improvement of f0 before stopping; 0 turns early stopping off
    max_steps: int = 250  # K
    alpha: float = 0.6
    beta: float = 0.3
    gamma: float = 0.1
    q: float = 0.1
    seed: int = 0
    estimator: str = "forward"  # or "central" (pairs X +/- mu U), or "grad" (the exact gradient; N, mu unused)
    grad_mode: str = "clip"  # or "normalize" (per-token unit norm)
    clip_norm: float = 1.0
    snr_threshold: float = 0.0  # > 0: skip the update when |mean|/std of the differences is below it
    projection_scope: str = "prompt"  # "prompt": the whole matrix, as the reference; "demos": rows [a, b) only
    perturb_query: bool = False  # ablation: perturb rows [a, L) (the query too) instead of [a, b)
    scale: float | None = None  # None: the model's embedding scale
    checkpoint: bool = False  # estimator "grad": recompute each layer in the backward (memory of one layer)
    # patience counts a step as an improvement only when f0 beats the last counted one by more than
    # max(min_delta, min_delta_rel * |that f0|) (stop_rule.improves); both 0: any better f0, the paper's rule
    min_delta: float = 0.0
    min_delta_rel: float = 0.0

    def __post_init__(self) -> None:
        for name in ("N", "patience", "max_steps", "seed"):  # their ranges: sicl_fast.run.knobs, one table
            v = check_range(name, getattr(self, name), "CalibrationConfig")
            object.__setattr__(self, name, int(v))  # numpy integers become Python ints for the C++ / Triton ops
        for name in ("min_delta", "min_delta_rel"):
            object.__setattr__(self, name, float(check_range(name, getattr(self, name), "CalibrationConfig")))
        for name in ("mu", "eta", "kappa", "tau", "alpha", "beta", "gamma", "q", "snr_threshold", "clip_norm", "scale"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Real) or isinstance(v, bool)):
                raise SiclError(f"CalibrationConfig: {name} must be a number, got {v!r}")
        for name in ("perturb_query", "checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise SiclError(f"CalibrationConfig: {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("estimator", "grad_mode", "projection_scope"):
            if not isinstance(getattr(self, name), str):
                raise SiclError(f"CalibrationConfig: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("mu", "eta", "kappa", "tau", "alpha", "beta", "gamma", "q", "snr_threshold", "clip_norm", "scale"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise SiclError(f"CalibrationConfig: {name} must be finite, got {v}")
        check_mu(self.mu, "CalibrationConfig")
        checks = [
            (self.eta >= 0, "eta must be >= 0"),
            (self.kappa < 1, "kappa must be < 1"),
            (0.0 <= self.q <= 1.0, "q must be in [0, 1]"),
            (self.clip_norm > 0, "clip_norm must be > 0"),
            (self.scale is None or self.scale > 0, "scale must be > 0"),
            (min(self.alpha, self.beta, self.gamma) >= 0, "alpha, beta and gamma must be >= 0 (weights of the proxy)"),
            (self.alpha + self.beta + self.gamma > 0,
             "alpha, beta and gamma sum to 0: the proxy would be 0 for every X, with nothing to climb"),
            (self.mu <= MAX_STEP_SIZE and self.eta <= MAX_STEP_SIZE,
             f"mu and eta must be <= {MAX_STEP_SIZE:g} (in units of the embedding scale; the paper uses 0.004 "
             "and 0.05)"),
        ]
        if self.scale is not None and self.mu > 0:  # the effective mu and eta are float32 numbers
            checks += [(self.mu * self.scale >= F32_TINY,
                        f"mu * scale = {self.mu * self.scale:.3g} is below float32's smallest normal number "
                        f"({F32_TINY:.3g}): the perturbation would be 0 or denormal (scale is the embedding scale mu "
                        "is measured in; 1.0 gives absolute units)"),
                       (max(self.mu, self.eta) * self.scale <= F32_MAX,
                        f"mu * scale and eta * scale must be <= {F32_MAX:.3g}, the largest float32 number")]
        check_choices("CalibrationConfig", estimator=self.estimator, grad_mode=self.grad_mode,
                      projection_scope=self.projection_scope)
        checks += [
            (not self.checkpoint or self.estimator == "grad",
             "checkpoint applies to estimator 'grad' only (the zeroth-order forwards keep no activations)"),
            (self.snr_threshold <= 0 or self.estimator != "grad",
             "snr_threshold gates the zeroth-order estimate's finite differences; estimator 'grad' has none"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SiclError(f"CalibrationConfig: {msg}")

    @property
    def mu_eff(self) -> float:
        return self.mu * (1.0 if self.scale is None else self.scale)

    @property
    def eta_eff(self) -> float:
        return self.eta * (1.0 if self.scale is None else self.scale)

    @property
    def batch(self) -> int:
        return batch_size(self.N, self.estimator)

    def resolve_scale(self, lm) -> CalibrationConfig:
        """This config in the units every loop steps in: its own scale, or the model's embedding scale
        (lm.embedding_scale) where it has none (mu and eta are given in units of it)."""
        return self if self.scale is not None else self.replace(scale=lm.embedding_scale)

    def replace(self, **kw) -> CalibrationConfig:
        return dataclasses.replace(self, **kw)

    def with_overrides(self, **overrides) -> CalibrationConfig:
        """This config with `overrides`, None values ignored (a flag or field left unset keeps the preset's); this
        config itself where none is left (checked when it was made)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return self.replace(**given) if given else self

    @classmethod
    def for_model(cls, lm, **overrides) -> CalibrationConfig:
        """The preset of the loaded model (preset), then `overrides` (None values ignored)."""
        return cls.preset(lm.family, sum(p.numel() for p in lm.model.parameters()), **overrides)

    @classmethod
    def preset(cls, family: str, n_params: int, **overrides) -> CalibrationConfig:
        """The preset of a model `family`, N=8 under 1B parameters, then `overrides` (None values ignored)."""
        base = dict(PRESETS[preset_name(family)])
        if n_params < 1e9:
            base["N"] = 8
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


# The paper's settings for its three models. It reports one shared setting, with the mu / eta grids scaled per
# model by the embedding scale (applied at run time through `scale`), so the presets hold the same numbers.
_PAPER = dict(mu=0.004, N=16, eta=0.05, kappa=0.2, tau=0.05, patience=5, max_steps=250)
PRESETS: dict[str, dict] = {"llama": dict(_PAPER), "qwen3": dict(_PAPER), "gemma2": dict(_PAPER)}
_FAMILY_PRESET = {"llama": "llama", "qwen2": "qwen3", "qwen3": "qwen3", "gemma": "gemma2", "gemma2": "gemma2",
                  "gemma3": "gemma2", "gemma3_text": "gemma2"}


def preset_name(family: str) -> str:
    """Model family (config.model_type) -> preset; Llama's for anything else."""
    return _FAMILY_PRESET.get(family, "llama")


@dataclass
class CalibrationResult:
    """What one calibration returns. embeddings: [L, d] float32, the best X found (X0 when gated)."""

    embeddings: torch.Tensor
    initial_proxy: float
    best_proxy: float
    steps: int  # batched forwards run
    best_step: int  # 0-based step whose X is returned
    gated: bool
    # "gate", "patience", "max_steps", "snr", "time_budget", or what `should_stop` returned (e.g. "deadline")
    stop_reason: str
    history: list[float] = field(default_factory=list)  # f0 at every step
    seconds: float = 0.0
    projections: int = 0  # how often the cosine projection fired
    config: CalibrationConfig | None = None
    impl: str = ""  # which implementation of the hot ops ran: "torch", "cpp" or "triton" (sicl_fast.ops)
    # steps run -> (best step, best X [L, d]) after that many steps, for the counts asked (run argument best_at)
    best_at: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"initial_proxy": self.initial_proxy, "best_proxy": self.best_proxy, "steps": self.steps,
                "best_step": self.best_step, "gated": self.gated, "stop_reason": self.stop_reason,
                "seconds": round(self.seconds, 4), "projections": self.projections, "impl": self.impl}


class Calibrator:
    """Runs Algorithm 1 for a prompt on a backend. The tensor work of a step runs on the backend's own StepOps
    (`backend.ops`, of its run plan's `impl`)."""

    def __init__(self, backend, config: CalibrationConfig) -> None:
        self.backend = backend
        self.ops = backend.ops
        self.config = config.resolve_scale(backend.lm)

    def initial_embeddings(self, prompt: Prompt, X0: torch.Tensor | None = None, kept: int = 0) -> torch.Tensor:
        """X0 [L, d] float32: the prompt's input embeddings, or the given ones, checked with the prompt and the
        memory of one step with `kept` copies of X (sicl_fast.run.checks.calibration_inputs)."""
        return calibration_inputs(self.backend, prompt, self.config, X0, kept)

    def step_spec(self, prompt: Prompt, X0: torch.Tensor) -> StepSpec:
        """The step's arguments for this prompt (StepSpec.for_prompt)."""
        return StepSpec.for_prompt(self.config, prompt, X0)

    def forward(self, prompt: Prompt, spec: StepSpec, X0: torch.Tensor):
        """The backend's forward of this prompt's perturbation batches (Backend.step_forward), made once a run: it
        keeps what does not change from step to step (the prefix's K/V where nothing rescales them)."""
        return self.backend.step_forward(prompt, spec.prefix_policy, spec.B, X0)

    def evaluate(self, X: torch.Tensor, prompt: Prompt, spec: StepSpec, step: int, forward=None):
        """The measuring half of a step at X [L, d]: (f [B], g). Zeroth order: f of the perturbation batch
        (row 0 = X) through `forward` (self.forward's; None: one made for this call from X), g None (the update
        estimates it from f); grad: f [1] of X and its exact gradient g [R, d]."""
        if spec.grad:
            out, g = proxy_gradient(self.backend, prompt, X, self.config, spec)
            return out.f, g
        batch = self.ops.perturb(X, step, spec)  # [B, b, d]
        lp = (forward or self.forward(prompt, spec, X))(batch)
        cfg = self.config
        return self.ops.proxy(lp, prompt.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q).f, None

    def move(self, X: torch.Tensor, X0: torch.Tensor, f: torch.Tensor, g: torch.Tensor | None, spec: StepSpec,
                step: int):
        """The moving half: (X_new [L, d], fired int32 [1]). One rule after the gradient for every estimator
        (zo.ascend): clip or normalise, eta, cosine projection."""
        if spec.grad:
            return self.ops.ascend(X, X0, g, spec)
        return self.ops.update(X, X0, f, step, spec)

    def proxy_of(self, batch: torch.Tensor, prompt: Prompt, near_row0: bool = False):
        """f and its parts for a batch [B, n, d] of embeddings. near_row0: rows 1.. are perturbations of row 0
        (the perturbation batch; lets the backend use difference products)."""
        cfg = self.config
        lp = self.backend.span_logprobs(batch, prompt, near_row0=near_row0)
        return self.ops.proxy(lp, prompt.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q)

    def run(
        self,
        prompt: Prompt,
        X0: torch.Tensor | None = None,
        on_step: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
        on_update: Callable[[torch.Tensor], None] | None = None,
        time_budget_s: float | None = None,
        best_at: BestAt | None = None,
    ) -> CalibrationResult:
        """Calibrate one prompt. X0 [L, d] defaults to the prompt's input embeddings (float32).
        should_stop: checked once per step after the best X is updated; a returned string (e.g. "deadline")
        ends the run with that stop_reason and the best X so far. time_budget_s: the same with stop_reason
        "time_budget" once that many seconds have passed since the run began (sicl_fast.run.run_args). best_at: keeps
        the best X after its step counts (in the result's best_at). on_update(X): called with X [L, d] after each
        update (sicl_fast.answering.reuse watches the whole-matrix cosine there)."""
        cfg = self.config
        t0 = time.perf_counter()
        should_stop = stop_check(should_stop, check_budget(time_budget_s, "Calibrator.run"), t0)
        best_at = best_at if best_at is not None else BestAt()
        X0 = self.initial_embeddings(prompt, X0, best_at.copies(cfg.max_steps))
        spec = self.step_spec(prompt, X0)
        if spec.grad:
            self.backend.plan.check_grad()
        forward = None if spec.grad else self.forward(prompt, spec, X0)
        X = X0.clone()
        best_X, best_f, best_step = X0, -math.inf, 0
        anchor = -math.inf  # f0 of the last step that counted as an improvement (stop_rule.improves)
        history: list[float] = []
        since_best = low_snr = projections = 0
        initial = math.nan
        stop = "max_steps"
        steps = 0
        for step in range(cfg.max_steps):
            if forward is not None and forward.refresh_every and step and step % forward.refresh_every == 0:
                forward.refresh(X)  # what the forward keeps of X (the fast backend's value-row reference)
            f, g = self.evaluate(X, prompt, spec, step, forward)  # f [B]; g: the exact gradient (grad) or None
            steps += 1
            f0 = float(f[0])
            if not math.isfinite(f0):
                raise NumericalError(f"request {prompt.id!r}: the proxy is {f0} at step {step}")
            history.append(f0)
            if on_step is not None:
                on_step(step, f0)
            if step == 0:
                initial = f0
            s = snr(f, cfg.mu_eff, cfg.estimator) if cfg.snr_threshold > 0 else None
            d = decide(HOST, step, f0, True, best_f, anchor, since_best, low_snr, s, cfg)
            best_f, anchor, since_best, low_snr = d.best_f, d.anchor, d.since, d.low_snr
            if d.better:
                best_X, best_step = X, step
            if d.gate:
                stop = "gate"
                break
            best_at.keep(steps, best_step, best_X)
            if d.patience:
                stop = "patience"
                break
            if should_stop is not None and (reason := should_stop()):
                stop = reason
                break
            if d.snr_stop:
                stop = "snr"
                break
            if d.low:
                continue  # noise-dominated estimate: skip the update
            if d.last:
                break  # the next X would never be evaluated
            X, fired = self.move(X, X0, f, g, spec, step)
            projections += int(fired)
            if on_update is not None:
                on_update(X)
        return CalibrationResult(
            embeddings=best_X.clone(),
            initial_proxy=initial,
            best_proxy=best_f,
            steps=steps,
            best_step=best_step,
            gated=stop == "gate",
            stop_reason=stop,
            history=history,
            seconds=time.perf_counter() - t0,
            projections=projections,
            config=cfg,
            impl=self.ops.name,
            best_at=best_at.kept,
        )


__all__ = ["CalibrationConfig", "CalibrationResult", "Calibrator", "PRESETS", "preset_name", "cosine"]
