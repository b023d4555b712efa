"""CUDA graphs for the static step and the static-cache decode step (CUDA only; nothing here runs on the CPU).

    g = CapturedStep(step)      warm the callable up on a side stream, capture it once; g() replays it
    g = captured(step, device)  CapturedStep on CUDA, the callable itself elsewhere

A captured callable must keep its inputs and outputs in fixed tensors and read nothing back to the host
(sicl_fast.static.StaticStep does both); its first calls (the warm-up) make every lazily built buffer (masks,
rotary tables, the noise kernels' step pointers) before the capture.
"""
from __future__ import annotations

import torch


class CapturedStep:
    """fn captured in a CUDA graph after `warmup` calls on a side stream; calling it replays the graph."""

    def __init__(self, fn, warmup: int = 2) -> None:
        self.fn = fn
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def __call__(self) -> None:
        self.graph.replay()


def captured(fn, device, warmup: int = 2):
    """A CUDA graph of fn on CUDA devices; fn itself elsewhere."""
    return CapturedStep(fn, warmup) if torch.device(device).type == "cuda" else fn


__all__ = ["CapturedStep", "captured"]
