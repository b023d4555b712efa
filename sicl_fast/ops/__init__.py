"""The implementation layer: which code does the hot tensor work, chosen once.

    ops = make_ops(impl="auto" | "torch" | "cpp" | "triton", device)

`auto` follows the device of the model's tensors: Triton on CUDA, the C++ extension on the CPU when it is built,
torch otherwise. With grad=True (the engine will run the exact-gradient ascent, estimator "grad") only a
differentiable implementation will do: the C++ and Triton ops are forward-only (no backward), so `auto` picks
torch and an explicit 'cpp' or 'triton' is refused. make_backend (and so Engine and Calibrator) calls this once and
passes the object down; nothing below decides again, and no environment variable is read. The protocol and the
shapes: sicl_fast.ops.base.
"""
from __future__ import annotations

import torch

from ..errors import SiclError
from ..spec import check_choice
from . import cpp_ops
from .base import Ops
from .torch_ops import TorchOps

IMPLS = ("auto", "torch", "cpp", "triton")
DIFFERENTIABLE_IMPLS = ("torch",)  # autograd can run through these (the others have no backward)


def check_differentiable_impl(name: str) -> None:
    """The one check that an implementation can carry a backward (estimator 'grad')."""
    if name not in DIFFERENTIABLE_IMPLS:
        raise SiclError(f"estimator 'grad' needs differentiable ops, and impl {name!r} is forward-only (the C++ and "
                        f"Triton ops have no backward); use impl 'torch' or 'auto' (--impl torch)")


def resolve_impl(impl: str, device, grad: bool = False) -> str:
    """The concrete implementation `impl` names on `device` ('auto' resolved; see module docstring)."""
    check_choice(impl, IMPLS, "impl", "ops")
    if grad:
        if impl != "auto":
            check_differentiable_impl(impl)
        return "torch"
    if impl != "auto":
        return impl
    dev = torch.device(device)
    if dev.type == "cuda":
        return "triton"
    return "cpp" if dev.type == "cpu" and cpp_ops.available() else "torch"


def make_ops(impl: str = "auto", device="cpu", grad: bool = False) -> Ops:
    """The Ops object for tensors on `device` (module docstring); grad: it must be differentiable. A SiclError says
    why an impl cannot run."""
    name = resolve_impl(impl, device, grad)
    if name == "torch":
        return TorchOps()
    if name == "cpp":
        if torch.device(device).type != "cpu":
            raise SiclError(f"impl 'cpp' runs on the CPU; the model is on {device} (use 'triton' or 'torch')")
        return cpp_ops.CppOps()
    from .triton_ops import TritonOps

    return TritonOps(device)


__all__ = ["IMPLS", "DIFFERENTIABLE_IMPLS", "Ops", "TorchOps", "check_differentiable_impl", "make_ops", "resolve_impl"]
