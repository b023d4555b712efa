"""CUDA graph capture on the CPU, for the tests: torch.cuda's graph API (Stream, stream, current_stream, CUDAGraph,
graph, graph_pool_handle) replaced by a recorder of the torch ops a capture runs, and sicl_fast.run.graphs.capturable
true for the CPU, so that the product's capture path (sicl_fast.run.graphs) runs unchanged on a CPU model.

    fake = FakeCuda(monkeypatch)        installed until the test ends
    fake.graphs, fake.destroyed         every graph made (weak references), and how many were destroyed
    fake.replays, fake.captures         the replays and the captures so far
    fake.hazards                        replays of a graph after another graph captured on its stream was destroyed
                                        (torch 2.11-2.12 frees the cuBLAS workspace such a graph still uses:
                                        pytorch/pytorch#193402)
    fake.fault = fn                     a faulty capture: the k-th capture (from 0) replays fn(ops, k) of the ops it
                                        recorded (ops[:-1]: its last op left out)

As a real capture: the ops run once while recorded (their outputs are the graph's buffers) and every tensor they write
that existed before is put back afterwards, so the capture moves no state; a replay runs the recorded ops again on
the same tensors (a new tensor an op made is written in place, as a graph rewrites its buffers); a host read
inside a capture (.item(), float(), bool() of a tensor) raises, as cudaStreamCaptureModeGlobal does. Only what goes
through torch's dispatcher is recorded: run the captured code with impl 'torch' (a Triton launch or a C++ call inside
a capture raises here instead of being silently left out of the replays).
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sicl_fast.diagnostics.kernel_count import NO_KERNEL, count_compiled_calls
from sicl_fast.run import graphs

POOLED = 32  # torch hands out streams round robin from a pool of 32 a device (c10::cuda::getStreamFromPool)


class FakeStream:
    ids = itertools.count()

    def __init__(self, device=None, priority=0, cuda_stream=None) -> None:
        self.cuda_stream = cuda_stream if cuda_stream is not None else 1 + next(FakeStream.ids) % POOLED

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return self.cuda_stream


class Recorder(TorchDispatchMode):
    """Records each dispatched op (func, args, kwargs, out) and what it writes of tensors made before."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.saved: list = []  # (tensor, its values before the op wrote it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("host read inside a CUDA graph capture (the fake's: .item(), float(), bool())")
        schema = func._schema.arguments
        for i, a in enumerate(schema):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                self.saved += [(t, t.clone()) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if not func.is_view and str(func) not in NO_KERNEL:
            outs = out if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out)
                                                               if isinstance(t, torch.Tensor)]
            self.ops.append((func, args, kwargs, outs))
        return out

    def restore(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)
        self.saved = []


class FakeCuda:
    """The fake graph API, installed with monkeypatch (module docstring)."""

    def __init__(self, monkeypatch) -> None:
        self.graphs: list = []
        self.destroyed = 0
        self.hazards: list = []
        self.replays = 0
        self.captures = 0
        self.fault = None
        self.clock = itertools.count()
        self.deaths: dict = {}  # stream id -> the clock of each destruction of a graph captured on it
        self.current = FakeStream(cuda_stream=0)
        fake = self

        class CUDAGraph:
            def __init__(self, *a, **k) -> None:
                self.ops, self.stream, self.t = None, None, None
                fake.graphs.append(weakref.ref(self))

            def replay(self) -> None:
                fake.replays += 1
                if any(t > self.t for t in fake.deaths.get(self.stream, [])):  # another graph of its stream died
                    fake.hazards.append((self.stream, self.t))
                for func, args, kwargs, outs in self.ops:
                    new = func(*args, **kwargs)
                    if isinstance(outs, torch.Tensor):  # one output (most ops): written where the capture's was
                        if new.data_ptr() != outs.data_ptr():
                            outs.copy_(new)
                        continue
                    for r, o in zip([t for t in tree_leaves(new) if isinstance(t, torch.Tensor)], outs):
                        if r.data_ptr() != o.data_ptr():
                            o.copy_(r)

            def reset(self) -> None:
                if self.ops is not None:
                    fake.deaths.setdefault(self.stream, []).append(next(fake.clock))
                    fake.destroyed += 1
                self.ops = None

            def __del__(self) -> None:
                self.reset()

        class graph:
            default_capture_stream = None

            def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", **kw) -> None:
                if stream is None:
                    if graph.default_capture_stream is None:
                        graph.default_capture_stream = FakeStream()
                    stream = graph.default_capture_stream
                self.g, self.stream, self.rec = cuda_graph, stream, Recorder()
                self.calls = [0]
                self.counting = count_compiled_calls(self.calls)

            def __enter__(self):
                self.counting.__enter__()
                self.rec.__enter__()
                return self

            def __exit__(self, *exc):
                self.rec.__exit__(*exc)
                self.counting.__exit__(*exc)
                self.rec.restore()
                if exc[0] is None and self.calls[0]:
                    raise RuntimeError("the fake capture records torch ops only: a Triton launch or a C++ call ran "
                                       "inside it (use impl 'torch')")
                g, ops = self.g, self.rec.ops
                if fake.fault is not None:
                    ops = fake.fault(ops, fake.captures)
                fake.captures += 1
                g.ops, g.stream, g.t = ops, self.stream.cuda_stream, next(fake.clock)
                return False

        class stream_ctx:
            def __init__(self, s) -> None:
                self.s, self.before = s, None

            def __enter__(self):
                self.before, fake.current = fake.current, self.s if self.s is not None else fake.current

            def __exit__(self, *exc):
                fake.current = self.before

        for name, value in (("Stream", FakeStream), ("CUDAGraph", CUDAGraph), ("graph", graph),
                            ("stream", stream_ctx), ("current_stream", lambda device=None: fake.current),
                            ("graph_pool_handle", lambda: object()), ("synchronize", lambda device=None: None)):
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(graphs, "capturable", lambda device: True)  # the CPU captures, through the fake

    @property
    def live(self) -> list:
        """The graphs not destroyed yet."""
        return [g for g in (r() for r in self.graphs) if g is not None and g.ops is not None]
