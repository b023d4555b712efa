"""The implementation layer: which code does the hot tensor work, chosen once.

    ops = make_ops(impl, device)        impl: 'torch', 'cpp' or 'triton', as the run plan resolved it
    ops.step                            StepOps: the ascent's step (the backend's `ops`)
    ops.decoder                         DecoderOps: the fast decoder's elementwise work (the model's `ops`)
    attention_kernels(attention)        the fused attention kernels the run plan's attention 'cpp' or 'triton'
                                        runs (the model's Attention is handed them)

Which implementation runs ('auto' follows the device; the exact gradient needs a differentiable one; 'cpp' runs on
the CPU) is a rule of the run plan (sicl_fast.run.plan.resolve_impl); make_ops builds what the plan chose and decides
nothing. No environment variable is read. The protocols and the shapes: sicl_fast.ops.base. The C++ extension is
built here, as sicl_fast.ops._C (setup.py, csrc/), below every floor that uses it.
"""
from __future__ import annotations

from ..step.spec import check_choice
from . import cpp_ops
from .base import DecoderOps, Ops, StepOps
from .torch_ops import TorchDecoderOps, TorchStepOps
from .triton_ops import TritonDecoderOps, TritonStepOps

IMPLS = ("auto", "torch", "cpp", "triton")
DIFFERENTIABLE_IMPLS = ("torch",)  # autograd can run through these (the others have no backward)


def make_ops(impl: str, device="cpu") -> Ops:
    """The step and decoder ops of the implementation `impl` ('torch', 'cpp' or 'triton') for tensors on `device`.
    A SiclError says why an implementation cannot run here (the extension not built, Triton missing or no CUDA)."""
    check_choice(impl, IMPLS[1:], "impl", "ops")
    if impl == "torch":
        return Ops(TorchStepOps(), TorchDecoderOps())
    if impl == "cpp":
        return Ops(cpp_ops.CppStepOps(), cpp_ops.CppDecoderOps())
    return Ops(TritonStepOps(device), TritonDecoderOps(device))


def attention_kernels(attention: str):
    """The fused kernels of the attention `attention` (the run plan's): for 'cpp' the C++ extension's attention and
    attention_rows (sicl_fast.ops.cpp_ops; a SiclError when it is not built), for 'triton' the Triton kernels'
    prefix_attention and attention_rows; None for 'math', 'sdpa' and 'flash', which need none."""
    if attention == "cpp":
        cpp_ops.require()
        return cpp_ops
    if attention == "triton":
        from .triton_ops import load_kernels

        return load_kernels()
    return None


__all__ = ["IMPLS", "DIFFERENTIABLE_IMPLS", "Ops", "StepOps", "DecoderOps", "TorchStepOps", "TorchDecoderOps",
           "make_ops", "attention_kernels"]
