"""StepPlan: one prompt's static step, planned once before anything is built, and handed on.

    plan, X0 = plan_step(backend, config, prompt, X0, buckets, kept, use_prefix, reclaimable)
        the entry checks (sicl_fast.run.checks.check_inputs), the plan, and the memory check on the plan's bytes
    plan = StepPlan.of(backend, config, prompt, X0, bucket, use_prefix, kept)
        the plan alone (config with its scale resolved; nothing checked)

What the plan works out, each once: the config in the units the step runs in (its scale resolved), the length bucket
the step runs padded to (sicl_fast.run.buckets), the StepSpec, the forward's prefix policy and shape
(sicl_fast.backends.step_forward), the bytes the step holds (sicl_fast.run.memory.step_bytes, the run's copies of X
among them), the proxy plan on the device and the perturbed block's own end. run_static, the StepCache and the
packed run (sicl_fast.calibration.static, .packed) take a plan and work none of it out again: the cache keys a step
by the plan's shape and counts it by the plan's bytes, a StaticStep is built from the plan (StaticStep.planned) or
re-armed from it (StaticStep.load).
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from ..backends.step_forward import StepForward
from ..formats.spans import Prompt
from ..run.buckets import Bucket
from ..run.checks import check_inputs, check_step_memory
from ..run.memory import StepBytes, form_of, step_bytes
from ..step.proxy import ProxyPlan
from ..step.spec import StepSpec, block_end
from .ascent import CalibrationConfig


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One prompt's static step (module docstring). config: its scale resolved; bucket: the length bucket it runs
    padded to, or None; spec: its StepSpec (L: the bucket's length where there is one); policy: the prefix policy of
    its forward ('kept', 'pass', 'none': sicl_fast.backends.step_forward), for this prompt; forward: the forward's
    shape (StepForward.shape); bytes: what the step holds and needs (StepBytes, with the run's copies of X);
    proxy: the proxy plan on the backend's device (its width the bucket's positions); rows_end: the perturbed
    block's own end where a bucket pads it (None: the spec's b); shape: what the step's buffers and kernel launches
    depend on, the key a StepCache keeps the step by: prompts of one shape can share one StaticStep, and its captured
    graph (StaticStep.load): their spans may differ in place, not in count or length, and their texts in everything;
    with a bucket, their lengths and span lengths too, within the bucket's sizes. It holds the config's, the spec's
    and the bucket's values (dataclasses.astuple), the span count and the forward's shape: plain values, which a
    lookup hashes and compares without calling back into their classes (a dataclass's __hash__ and __eq__)."""

    prompt: Prompt
    config: CalibrationConfig
    bucket: Bucket | None
    spec: StepSpec
    policy: str
    forward: tuple
    bytes: StepBytes
    proxy: ProxyPlan
    rows_end: int | None
    shape: tuple

    @classmethod
    def of(cls, backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor, bucket: Bucket | None = None,
           use_prefix: bool = True, kept: int = 0) -> StepPlan:
        """The plan of `prompt`'s step on `backend` from X0 [L, d] (config with its scale resolved:
        CalibrationConfig.resolve_scale), padded to `bucket` where given. use_prefix=False: the forward runs the full
        rows [0, b) (the packed step's slots; a backend made without the prefix cache runs them so too); kept: the
        copies of X the run keeps along the way (BestAt), counted in its bytes."""
        spec = StepSpec.for_prompt(config, prompt, X0, bucket)
        prefix = use_prefix and getattr(backend, "prefix_cache", True)  # a fast backend made without it: none
        forward = StepForward.shape(prompt, spec.prefix_policy if prefix else "none", spec.B, bucket)
        policy = forward[0]  # the policy this prompt runs (resolve_policy: 'none' where it has no prefix rows)
        return cls(prompt=prompt, config=config, bucket=bucket, spec=spec, policy=policy, forward=forward,
                   bytes=step_bytes(backend.lm, prompt, config, kept, bucket, form_of(backend.plan), policy=policy,
                                    spec=spec),
                   proxy=ProxyPlan.build(prompt.offsets, int(prompt.positions.numel()), backend.device, config.alpha,
                                         config.beta, config.gamma, config.q,
                                         width=None if bucket is None else bucket.positions),
                   rows_end=None if bucket is None else block_end(config, prompt),
                   shape=(astuple(config), astuple(spec), len(prompt.token_spans), forward,
                          None if bucket is None else astuple(bucket)))


def plan_step(backend, config: CalibrationConfig, prompt: Prompt, X0: torch.Tensor | None = None,
              buckets: int | None = None, kept: int = 0, use_prefix: bool = True, reclaimable: int = 0
              ) -> tuple[StepPlan, torch.Tensor]:
    """(the StepPlan of `prompt`'s step, X0 [L, d] float32 checked): the entry checks of a calibration (the prompt,
    X0, default the prompt's own embeddings, and the perturbation: sicl_fast.run.checks.check_inputs), the plan
    (StepPlan.of; buckets: the length buckets a doubling, or None) and the memory check on its bytes (reclaimable:
    what a step cache would give back for it)."""
    lm = backend.lm
    config = config.resolve_scale(lm)
    X0 = check_inputs(backend, prompt, config, X0)
    bucket = None if buckets is None else Bucket.of(prompt, buckets, lm.max_context)
    plan = StepPlan.of(backend, config, prompt, X0, bucket, use_prefix, kept)
    check_step_memory(lm, prompt, config, bucket=bucket, reclaimable=reclaimable, size=plan.bytes)
    return plan, X0


__all__ = ["StepPlan", "plan_step"]
