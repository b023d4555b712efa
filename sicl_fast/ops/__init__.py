"""The implementation layer: which code does the hot tensor work, chosen once.

    ops = make_ops(impl="auto" | "torch" | "cpp" | "triton", device)

`auto` follows the device of the model's tensors: Triton on CUDA, the C++ extension on the CPU when it is built,
torch otherwise. make_backend (and so Engine and Calibrator) calls this once and passes the object down; nothing
below decides again, and no environment variable is read. The protocol and the shapes: sicl_fast.ops.base.
"""
from __future__ import annotations

import torch

from ..errors import SiclError
from ..spec import check_choice
from . import cpp_ops
from .base import Ops
from .torch_ops import TorchOps

IMPLS = ("auto", "torch", "cpp", "triton")


def resolve_impl(impl: str, device) -> str:
    """The concrete implementation `impl` names on `device` ('auto' resolved; see module docstring)."""
    check_choice(impl, IMPLS, "impl", "ops")
    if impl != "auto":
        return impl
    dev = torch.device(device)
    if dev.type == "cuda":
        return "triton"
    return "cpp" if dev.type == "cpu" and cpp_ops.available() else "torch"


def make_ops(impl: str = "auto", device="cpu") -> Ops:
    """The Ops object for tensors on `device` (module docstring). A SiclError says why an impl cannot run."""
    name = resolve_impl(impl, device)
    if name == "torch":
        return TorchOps()
    if name == "cpp":
        if torch.device(device).type != "cpu":
            raise SiclError(f"impl 'cpp' runs on the CPU; the model is on {device} (use 'triton' or 'torch')")
        return cpp_ops.CppOps()
    from .triton_ops import TritonOps

    return TritonOps(device)


__all__ = ["IMPLS", "Ops", "TorchOps", "make_ops", "resolve_impl"]
