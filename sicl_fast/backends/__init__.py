"""Backends: `hf` (any transformers causal LM), `naive` (the reference's form), `fast` (own forward: Llama, Qwen3,
Gemma 2, Gemma 3, with prefix KV reuse and, for float32 models, bf16 difference products), `fast-fp32` (fast
with every product in float32). `auto` picks `fast` for the families it supports, `hf` otherwise."""
from __future__ import annotations

from ..errors import SiclError
from ..ops import make_ops
from .base import Backend
from .fast import SUPPORTED_FAMILIES as FAST_FAMILIES
from .fast import FastBackend
from .hf import HFBackend
from .naive import NaiveBackend

BACKENDS: dict[str, type[Backend]] = {"hf": HFBackend, "naive": NaiveBackend, "fast": FastBackend,
                                      "fast-fp32": FastBackend}


def make_backend(name: str, lm, diff_matmul: str = "auto", impl: str = "auto", grad: bool = False) -> Backend:
    """Backend by name. 'auto' picks the best available backend for the model. diff_matmul is the fast
    backend's difference-product setting (auto, off, bf16); 'fast-fp32' is fast with it off. impl chooses, once,
    the implementation of the hot ops (sicl_fast.ops.make_ops: auto, torch, cpp, triton) for the device of the
    model's tensors; the backend and every calibration on it use that one object. grad: the backend will run the
    exact-gradient ascent (estimator 'grad'): the ops must be differentiable (make_ops picks torch for 'auto' and
    refuses 'cpp' / 'triton') and so must the backend and the model (sicl_fast.grad.check_differentiable)."""
    if name == "auto":
        name = "fast" if lm.family in FAST_FAMILIES else "hf"
    if name not in BACKENDS:
        raise SiclError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    ops = make_ops(impl, lm.device, grad=grad)
    if name == "fast":
        be = FastBackend(lm, diff_matmul=diff_matmul, ops=ops)
    elif name == "fast-fp32":
        be = FastBackend(lm, diff_matmul="off", ops=ops)
        be.name = "fast-fp32"
    else:
        be = BACKENDS[name](lm, ops=ops)
    if grad:
        from ..grad import check_differentiable

        check_differentiable(be)
    return be


__all__ = ["Backend", "BACKENDS", "FAST_FAMILIES", "FastBackend", "HFBackend", "NaiveBackend", "make_backend"]
