"""CUDA graphs for the static step and the static-cache decode step, and the bounded per-shape caches that keep
them (the capture itself is CUDA only; the caches and the re-arming they rely on run, and are tested, anywhere).

    g = CapturedStep(step, keep)     warm the callable up on a side stream, capture it once; g() replays it
    g = captured(step, device, ...)  CapturedStep on CUDA, the callable itself elsewhere
    pool = shared_pool(device)       one memory pool for several graphs that never replay at once (None off CUDA)
    ShapeCache(capacity, budget)     at most `capacity` entries built per key (and `budget` bytes held), the least
                                     recently used dropped
    DecodeGraph(model, max_len)      one static KV cache and its decode step, captured on CUDA

A captured callable must keep its inputs and outputs in fixed tensors and read nothing back to the host
(sicl_fast.calibration.static.StaticStep does both); its first calls (the warm-up) make every lazily built buffer
(masks, rotary tables, the rows' K/V buffers, the noise kernels' step pointers) before the capture. A graph reads those
buffers by address, and the model and ops replace some of them later (a longer rotary table, another shape's
K/V buffers, a cleared mask cache): `keep` holds references to every one of them for as long as the graph lives
(Transformer.cached_tensors, StepOps.cached_tensors), so a later replacement never frees memory a graph reads.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from .knobs import check_range

GRAPH_MODES = ("auto", "on", "off")  # the run plan's choices (sicl_fast.run.plan.resolve_graphs)
DEFAULT_CAPACITY = 4  # graphs kept per cache without length buckets (each decode graph has a pool of its own)
# static steps kept with length buckets (sicl_fast.run.buckets): 4 sizes a doubling over 64 to 4096 tokens make 24, a
# mix of 200-600-token prompts 7; their graphs share one pool, so a kept bucket costs its step's buffers only
BUCKET_CAPACITY = 16


class CapturedStep:
    """fn captured in a CUDA graph after `warmup` calls on a side stream; calling it replays the graph. keep: a
    callable returning the tensors the graph reads by address but does not own (module docstring), called after
    the capture and held. pool: a memory pool shared with other graphs (shared_pool), or None (its own)."""

    def __init__(self, fn: Callable[[], None], warmup: int = 2, keep: Callable[[], list] | None = None,
                 pool=None) -> None:
        self.fn, self.pool = fn, pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()
        self.kept = keep() if keep is not None else []

    def __call__(self) -> None:
        self.graph.replay()


def captured(fn, device, warmup: int = 2, keep: Callable[[], list] | None = None, pool=None):
    """A CUDA graph of fn on CUDA devices; fn itself elsewhere."""
    return CapturedStep(fn, warmup, keep, pool) if torch.device(device).type == "cuda" else fn


def shared_pool(device):
    """A memory pool handle for graphs captured on `device` that replay one at a time and keep nothing they
    allocate past a replay (the static steps of several shapes: what one replay leaves in the pool the next
    overwrites, as SGLang's graph runner shares one pool over its batch sizes); None off CUDA."""
    return torch.cuda.graph_pool_handle() if torch.device(device).type == "cuda" else None


def model_refs(model, ops) -> Callable[[], list]:
    """The `keep` of a capture that runs `model` (a sicl_fast Transformer) with `ops`."""
    return lambda: model.cached_tensors() + ops.cached_tensors()


class ShapeCache:
    """At most `capacity` entries, built on demand per key; the least recently used goes first (with it, its
    graph's memory pool). budget: at most that many bytes held as well (None: no bound), an entry's bytes given
    when it is built as (kept, scratch): what it keeps, and the temporaries of one call, which the entries share
    (their graphs draw on one pool and replay one at a time: the largest entry's scratch is held once). stats:
    builds and hits; dropped: the entries dropped for room."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, budget: int | None = None) -> None:
        self.capacity = check_range("graph_cache", capacity, "ShapeCache", "capacity")
        self.budget = budget
        self.entries: OrderedDict = OrderedDict()
        self.sizes: dict = {}  # key -> (kept, scratch) bytes
        self.stats = {"builds": 0, "hits": 0}
        self.dropped = 0

    def held(self, size: tuple = (0, 0)) -> int:
        """The bytes the entries hold, with one more of `size` (kept, scratch) beside them."""
        sizes = [*self.sizes.values(), size]
        return sum(k for k, _ in sizes) + max(s for _, s in sizes)

    def get(self, key, build: Callable[[], object], size: tuple = (0, 0)) -> tuple[object, bool]:
        """(entry, hit): the cached entry of `key`, or build() cached under it, holding `size` bytes (kept,
        scratch); before the build, the least recently used entries go until it fits (count and budget; an entry
        larger than the budget alone is built all the same: the memory check refuses what cannot fit at all)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            self.stats["hits"] += 1
            return self.entries[key], True
        while self.entries and (len(self.entries) >= self.capacity
                                or self.budget is not None and self.held(size) > self.budget):
            old, _ = self.entries.popitem(last=False)  # before the build: the old graph's pool is freed first
            del self.sizes[old]
            self.dropped += 1
        entry = self.entries[key] = build()
        self.sizes[key] = tuple(size)
        self.stats["builds"] += 1
        return entry, False

    def __len__(self) -> int:
        return len(self.entries)


def cache_rows(n: int, bucket: int = 256) -> int:
    """A decode cache's length for n rows: rounded up to a multiple of `bucket`, so prompts of many lengths share
    one cache and one captured decode step (the masked attention reads the whole buffer whatever its fill)."""
    return -(-n // bucket) * bucket


class DecodeGraph:
    """A static KV cache of max_len rows (sicl_fast.models.transformer.StaticCache) and the decode step on it:
    step(token int64 [1]) -> next-token logits [V] (model dtype; one buffer, overwritten by the next call).
    On CUDA the step is a replayed graph: the token goes into a fixed input buffer, the position is the cache's
    device-held `pos`, so any fill of the cache replays the same graph. Reuse: the caller's prefill writes the
    cache's rows [0, L) and sets pos = L; rows past pos are masked, whatever an earlier answer left there."""

    def __init__(self, model, max_len: int, ops, device) -> None:
        self.model, self.max_len = model, max_len
        self.cache = model.new_cache(max_len)
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.logits = torch.empty(model.head.shape[0], dtype=model.dtype, device=model.device)
        # the warm-up decodes at positions 0, 1 (rows the next prefill overwrites)
        self._run = captured(self._decode, device, keep=model_refs(model, ops))

    def _decode(self) -> None:
        self.logits.copy_(self.model.decode_logits(self.token, self.cache))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token.view(1))
        self._run()
        return self.logits


__all__ = ["CapturedStep", "captured", "shared_pool", "model_refs", "ShapeCache", "DecodeGraph", "cache_rows",
           "GRAPH_MODES", "DEFAULT_CAPACITY", "BUCKET_CAPACITY"]
