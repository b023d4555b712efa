"""Counting the kernels a piece of work launches, the same way on any device (a CPU run counts what a GPU
would launch): dispatched torch ops that launch a kernel + Triton launches + C++ extension calls + CUDA graph
replays (one launch a graph).

    count_kernels(fn) -> int            any device
    cuda_kernel_events(fn) -> int       CUDA: the profiler's kernel events, the count that matters there

Self-contained (torch, and triton / the C++ extension when present): bench/kernel_count.py loads this file by
its path into another checkout's process, so both sides of a before / after are counted by the same rules.
"""
from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch no kernel: allocations from the caching allocator, and aliases the dispatcher does not flag
NO_KERNEL = frozenset({"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                       "aten.new_empty.default", "aten.new_empty_strided.default", "aten._unsafe_view.default",
                       "aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"})


class OpCounter(TorchDispatchMode):
    """Counts the dispatched torch operations that launch a kernel: not views, not allocations (NO_KERNEL); a
    CPU-side count of what a GPU would launch. Ops a compiled call makes inside itself (the Triton
    interpreter's own tensor traffic) are not counted: the call is one launch, counted by
    count_compiled_calls. names: the count per op, for finding what to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False) and not _inside[0] and str(func) not in NO_KERNEL:
            self.count += 1
            self.names[str(func)] = self.names.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


_inside = [0]  # > 0 while a counted compiled call runs


def _counted(fn, counter: list):
    def call(*a, **k):
        counter[0] += 1
        _inside[0] += 1
        try:
            return fn(*a, **k)
        finally:
            _inside[0] -= 1
    return call


@contextlib.contextmanager
def count_compiled_calls(counter: list):
    """Counts Triton launches, C++ extension calls (they bypass torch's dispatcher) and CUDA graph replays (one
    launch each, whatever the graph holds) into counter[0]."""
    import torch

    import sicl_fast.ops.cpp_ops as cpp_ops  # absolute: bench/kernel_count.py loads this file by its path

    patches = []  # (object, attribute, original value)
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None and "replay" in vars(graph):
        patches.append((graph, "replay", vars(graph)["replay"]))
        graph.replay = _counted(vars(graph)["replay"], counter)
    ext = cpp_ops._C
    if ext is not None:
        class Counted:
            def __getattr__(self, name):
                return _counted(getattr(ext, name), counter)
        patches.append((cpp_ops, "_C", ext))
        cpp_ops._C = Counted()
    try:  # a kernel launch is kernel[grid](...): count the calls of what __getitem__ returns
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit

        for cls in (jit.KernelInterface, getattr(interpreter, "InterpretedFunction", None)):
            if cls is not None and "__getitem__" in vars(cls):
                orig = vars(cls)["__getitem__"]
                patches.append((cls, "__getitem__", orig))
                cls.__getitem__ = lambda self, grid, _o=orig: _counted(_o(self, grid), counter)
    except ImportError:
        pass
    try:
        yield
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)


def count_kernels(fn) -> int:
    """Kernels one fn() call launches (module docstring)."""
    compiled = [0]
    with count_compiled_calls(compiled), OpCounter() as c:
        fn()
    return c.count + compiled[0]


def cuda_kernel_events(fn) -> int:
    """CUDA kernels one fn() call ran, from the profiler's kernel events (what a GPU really launched; CUDA only)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


__all__ = ["count_kernels", "cuda_kernel_events", "OpCounter", "count_compiled_calls", "NO_KERNEL"]
