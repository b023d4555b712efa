"""Backends: `hf` (any transformers causal LM), `naive` (the reference's form), `fast` (own forward: Llama, Qwen3,
Gemma 2, Gemma 3, with prefix KV reuse and, for float32 models, bf16 difference products), `fast-fp32` (the fast
backend with every product in float32: a run plan, not a class of its own). `auto` picks `fast` where the fast
decoder's config builds from the model's whole config, `hf` on any refusal (sicl_fast.run.plan resolves the name,
with every other mode of the run)."""
from __future__ import annotations

from ..run.plan import RunPlan, make_plan
from ..run.threads import apply_threads
from .base import Backend
from .fast import SUPPORTED_FAMILIES as FAST_FAMILIES
from .fast import FastBackend
from .hf import HFBackend
from .naive import NaiveBackend

CLASSES: dict[str, type[Backend]] = {"hf": HFBackend, "naive": NaiveBackend, "fast": FastBackend}


def build_backend(plan: RunPlan, lm) -> Backend:
    """The backend the run plan names, on the loaded model it was made for; it decides nothing of its own. The plan's
    thread count is applied here, the one place (torch's and the C++ ops'; process-wide, as both are)."""
    apply_threads(plan.threads, cpp=plan.impl == "cpp")
    return CLASSES[plan.kind.cls](lm, plan)


def make_backend(name: str, lm, **choices) -> Backend:
    """Backend by name ('auto', 'fast', 'fast-fp32', 'hf', 'naive') with the other choices of
    sicl_fast.run.plan.make_plan (diff_matmul, impl, attn, grad, ...: 'auto' unless given): build_backend(make_plan(lm,
    backend=name, ...)). impl 'auto' picks the hot ops for the device of the model's tensors; grad=True: the backend
    will run the exact-gradient ascent, and ops, backend and model must be differentiable."""
    return build_backend(make_plan(lm, backend=name, **choices), lm)


__all__ = ["Backend", "CLASSES", "FAST_FAMILIES", "FastBackend", "HFBackend", "NaiveBackend", "build_backend",
           "make_backend"]
