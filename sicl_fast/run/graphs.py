"""CUDA graphs for the static step and the static-cache decode step, and the bounded per-shape caches that keep
them (the capture itself is CUDA only; the caches and the re-arming they rely on run, and are tested, anywhere).

    caps = Captures(device)          one owner's graphs (a step cache, the decode caches, a packed step): a capture
                                     stream of their own, one memory pool, and the graphs they dropped
    g = caps.capture(fn, keep=...)   warm fn up on that stream, capture it once: g() replays it (fn itself off CUDA)
    caps.drop(g)                     a graph its owner no longer replays: destroyed, or retired (below)
    weakly(obj.method, *args)        a callable of obj's method that does not keep obj alive
    ShapeCache(capacity, budget)     at most `capacity` entries built per key (and `budget` bytes held), the least
                                     recently used dropped
    DecodeGraph(model, max_len, ...) one static KV cache and its decode step, captured where its Captures capture

A captured callable must keep its inputs and outputs in fixed tensors and read nothing back to the host
(sicl_fast.calibration.static.StaticStep does both); its first calls (the warm-up) make every lazily built buffer
(masks, rotary tables, the rows' K/V buffers, the noise kernels' step pointers) before the capture. A graph reads those
buffers by address, and the model and ops replace some of them later (a longer rotary table, another shape's
K/V buffers, a cleared mask cache): `keep` holds references to every one of them for as long as the graph lives
(Transformer.cached_tensors, StepOps.cached_tensors), so a later replacement never frees memory a graph reads.

The first replay of each new capture is checked (first_replay): its outputs against the same step run uncaptured
through the torch ops (the owner's ReplayCheck says what to compare and how closely); on a mismatch or an error the
same step runs uncaptured with the plan's ops, and if that is wrong too, through the torch ops; the owner switches
the run over in place (the plan says which and why: sicl_fast.run.plan.fall_back) and the run goes on. A warm-up or
a capture that raises (a kernel this GPU cannot run, an operation a capture refuses) is such an error: the step is
kept without a graph and its first call takes the same way. Nothing of the check runs inside a capture: it reads the
outputs on the host after a replay.

Freed by reference counting: a graph is held by its owner (a cache entry, a forward, a packed step) and holds nothing
that holds the owner back (the callable it captured is a `weakly` one), so a dropped step, refresh, decode cache or
packed layout gives its memory back when its last reference goes, without waiting for a cyclic collection.

The cuBLAS workspace hazard (torch 2.11 and 2.12, pytorch/pytorch#193402): destroying a graph frees the cuBLAS
workspaces torch caches for its capture stream (the destructor clears them), which the other graphs captured on
that stream may have baked in, and those graphs then read freed memory when they replay (an illegal address, or
silent corruption). Two rules together keep any
graph from replaying after another graph of its stream died: each owner captures on a stream no other live owner
captures on (`capture_stream`), and on the affected versions (`WORKSPACE_HAZARD`) an owner that drops one graph while
others of its stream may still replay retires it instead (the graph object kept, unreplayed; the tensors it read
freed), until it drops all its graphs at once (ShapeCache.clear: when the retired entries outnumber the cache's
capacity, when the cache empties, and with the owner). A retired graph's pool memory is still counted
(ShapeCache.held); its count is bounded by the capacity. Newer torch (#193832, #194109 scope each captured
invocation's workspace to its graph) destroys at once.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from ..errors import SiclError, first_line
from .knobs import check_range

GRAPH_MODES = ("auto", "on", "off")  # the run plan's choices (sicl_fast.run.plan.resolve_graphs)
DEFAULT_CAPACITY = 4  # graphs kept per cache without length buckets (each decode graph has a pool of its own)
# static steps kept with length buckets (sicl_fast.run.buckets): 4 sizes a doubling over 64 to 4096 tokens make 24, a
# mix of 200-600-token prompts 7; their graphs share one pool, so a kept bucket costs its step's buffers only
BUCKET_CAPACITY = 16
# the torch versions [first, last] whose graph destructor frees the cuBLAS workspaces of its whole capture stream:
# pytorch/pytorch#193402 (the clearing came with #175276; #193832 and #194109 scope a captured invocation's workspace
# to its graph), affecting 2.11 and 2.12 as issue #53 reads it; a later version found affected goes here (retiring
# where there is no hazard costs memory only)
HAZARD_VERSIONS = ((2, 11), (2, 12))
STREAM_POOL = 32  # torch hands out streams round robin from 32 a device and priority (c10::cuda::getStreamFromPool)


def workspace_hazard(version: str = torch.__version__) -> bool:
    """Does this torch version free every graph's cuBLAS workspace of a stream when one graph of it is destroyed?"""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return True  # a version we cannot read: assume the hazard (retiring costs memory, never correctness)
    first, last = HAZARD_VERSIONS
    return first <= (major, minor) <= last


WORKSPACE_HAZARD = workspace_hazard()


def capturable(device) -> bool:
    """Can graphs be captured on `device` (CUDA)? Elsewhere a Captures captures nothing: the callable runs itself."""
    return torch.device(device).type == "cuda"


_STREAMS_IN_USE: dict = {}  # (device, stream handle) -> live owners capturing on it


def capture_stream(device):
    """A stream of torch's pool that no live Captures captures on (its handle released when the owner goes): the
    pool's streams come round again after STREAM_POOL draws."""
    device = torch.device(device)
    current = torch.cuda.current_stream(device).cuda_stream
    for _ in range(STREAM_POOL + 1):
        s = torch.cuda.Stream(device=device)
        if s.cuda_stream != current and (device, s.cuda_stream) not in _STREAMS_IN_USE:
            return s
    raise SiclError(f"no CUDA stream of torch's pool is free for another graph owner on {device} (each of the "
                    f"{STREAM_POOL} pooled streams captures another owner's graphs): drop an engine first")


def _release_stream(key) -> None:
    _STREAMS_IN_USE.pop(key, None)


def weakly(method, *args) -> Callable[[], None]:
    """A callable running method(*args) (a bound method) that holds its object only weakly: what a graph its object
    owns captures, so that the object and the graph free each other by reference counting (module docstring)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        m = ref()
        if m is None:
            raise RuntimeError("a captured step ran after its owner was dropped")
        m(*args)
    return call


class ReplayCheck:
    """What the first replay of a capture is compared with (first_replay), given by the graph's owner. name: the
    step, for the messages.

        state()            the tensors the step writes: saved before the first replay, put back before another try
        reference()        the step's outputs (new tensors) as the same step computes them uncaptured through the
                           torch ops, from the state as it is (it writes none of state())
        outputs()          the step's outputs after a call, in reference()'s order
        compare(got, want) None, or why they differ (the owner's stated tolerances)
        fall_back(to, why) the run goes on 'uncaptured' (the plan's ops, the graph not replayed again) or through the
                           'torch' ops (switched in place, the step run again through them)"""

    name = "step"

    def state(self) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def reference(self) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def outputs(self) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def compare(self, got: list, want: list) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def fall_back(self, to: str, why: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def off_by(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """Why `got` is not `want` within `tol` (the largest absolute difference; NaN where the other is not counts as
    off), or None."""
    got, want = got.double(), want.double()
    nan = torch.isnan(got) != torch.isnan(want)
    if bool(nan.any()):
        return f"{name} is NaN where the reference's is not (or not where it is)"
    both = ~torch.isnan(want)
    err = float((got[both] - want[both]).abs().max()) if bool(both.any()) else 0.0
    return None if err <= tol else f"{name} is off by {err:.3g} (tolerance {tol:.3g})"


def _tried(run: Callable[[], None], check: ReplayCheck, want: list) -> str | None:
    """Why run()'s outputs are not the reference's (an error counts as not), or None."""
    try:
        run()
        return check.compare([t.clone() for t in check.outputs()], want)
    except Exception as exc:  # noqa: BLE001 - any error of a replay or a kernel falls back (the module docstring)
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def first_replay(step: CapturedStep, check: ReplayCheck) -> str | None:
    """The first replay of `step`, checked (module docstring): None where it matched the reference (the state is the
    replay's), else the fallback the run took, 'uncaptured' (the state is the plan's ops' uncaptured step) or
    'torch' (the owner switched to the torch ops and ran the step again through them)."""
    state = check.state()
    saved = [t.clone() for t in state]
    want = check.reference()
    if step.graph is None:  # its warm-up or its capture raised (CapturedStep.error): nothing to replay
        what = f"the {check.name} could not be captured ({step.error})"
    else:
        why = _tried(step.graph.replay, check, want)
        if why is None:
            return None
        what = f"the captured {check.name}'s first replay {why}"
    for t, s in zip(state, saved):
        t.copy_(s)
    eager = _tried(step.fn, check, want)
    if eager is None:
        check.fall_back("uncaptured", f"{what}; uncaptured it matched the torch ops")
        return "uncaptured"
    for t, s in zip(state, saved):
        t.copy_(s)
    check.fall_back("torch", f"{what}, and uncaptured it {eager}")
    return "torch"


class CapturedStep:
    """fn captured in a CUDA graph after `warmup` calls on `stream` (a side stream of its own: None); calling it
    replays the graph. keep: a callable returning the tensors the graph reads by address but does not own (module
    docstring), called after the capture and held. pool: a memory pool shared with other graphs (a Captures'), or
    None (its own). check: a ReplayCheck its first replay is checked with (first_replay); after a fallback the
    step runs fn uncaptured. A warm-up or capture that raises leaves graph None and says why in `error` (with a
    check: its first call falls back; without one the error is raised here)."""

    def __init__(self, fn: Callable[[], None], warmup: int = 2, keep: Callable[[], list] | None = None,
                 pool=None, stream=None, check: ReplayCheck | None = None) -> None:
        self.fn, self.pool, self.check = fn, pool, check
        self.fallback: str | None = None  # what the first replay's check fell back to
        self.error: str | None = None  # why the warm-up or the capture failed (then graph is None: first_replay)
        self.graph, self.kept = torch.cuda.CUDAGraph(), []
        try:
            side = stream if stream is not None else torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(self.graph, pool=pool, stream=side):
                fn()
            self.kept = keep() if keep is not None else []
        except Exception as exc:  # noqa: BLE001 - a kernel or a capture this GPU refuses: the first call falls back
            if check is None:  # nothing to check a fallback against: the owner's error
                raise
            self.graph, self.error = None, first_line(exc)

    def __call__(self) -> None:
        if self.check is not None:
            check, self.check = self.check, None
            self.fallback = first_replay(self, check)
        elif self.fallback is None:
            self.graph.replay()
        else:
            self.fn()

    def release(self):
        """Give up the graph, the callable and what it kept (the step no longer replays); -> the graph object."""
        graph, self.graph, self.fn, self.kept, self.check = self.graph, None, None, [], None
        return graph


class Captures:
    """One owner's CUDA graphs (module docstring): captured on a stream of its own (capture_stream), drawing on one
    memory pool (shared=True: graphs that replay one at a time and keep nothing they allocate past a replay, as
    SGLang's graph runner shares one pool over its batch sizes) or each on its own (shared=False); retired: the
    graphs dropped while others of the stream may still replay, on the torch versions with the workspace hazard
    (retire, default WORKSPACE_HAZARD). Off CUDA it captures nothing: capture() returns the callable itself."""

    def __init__(self, device, shared: bool = True, retire: bool | None = None) -> None:
        self.device = torch.device(device)
        self.on = capturable(self.device)
        self.retire = WORKSPACE_HAZARD if retire is None else retire
        self.retired: list = []
        self.stream = self.pool = None
        if self.on:
            self.stream = capture_stream(self.device)
            key = (self.device, self.stream.cuda_stream)
            _STREAMS_IN_USE[key] = True
            weakref.finalize(self, _release_stream, key)
            self.pool = torch.cuda.graph_pool_handle() if shared else None

    def capture(self, fn: Callable[[], None], warmup: int = 2, keep: Callable[[], list] | None = None,
                check: ReplayCheck | None = None):
        """fn captured on this owner's stream and pool (CapturedStep, its first replay checked with `check`), or fn
        itself off CUDA."""
        if not self.on:
            return fn
        return CapturedStep(fn, warmup, keep, self.pool, self.stream, check)

    def drop(self, *steps) -> None:
        """Captured steps their owner will not replay again while other graphs of this stream may (the rest of
        `steps`, anything not captured, is ignored): their graphs destroyed, or retired where the workspace hazard
        is. The steps hold nothing afterwards."""
        for st in steps:
            if isinstance(st, CapturedStep) and st.graph is not None:
                graph = st.release()
                if self.retire:
                    self.retired.append(graph)

    def flush(self) -> None:
        """Destroy the retired graphs: the owner has dropped every graph of its stream (none replays again)."""
        self.retired.clear()


def model_refs(model, ops) -> Callable[[], list]:
    """The `keep` of a capture that runs `model` (a sicl_fast Transformer) with `ops`."""
    return lambda: model.cached_tensors() + ops.cached_tensors()


class ShapeCache:
    """At most `capacity` entries, built on demand per key; the least recently used goes first (with it, its
    graph's memory pool). budget: at most that many bytes held as well (None: no bound), an entry's bytes given
    when it is built as (kept, scratch): what it keeps, and the temporaries of one call, which the entries share
    (their graphs draw on one pool and replay one at a time: the largest entry's scratch is held once). stats:
    builds and hits; dropped: the entries dropped for room. captures: the Captures its entries' graphs were made
    with, and graphs_of(entry) those graphs: a dropped entry's graphs go to captures.drop, and where they are
    retired (the workspace hazard) their scratch stays counted until every graph of the cache goes at once (clear:
    when the retired entries outnumber the capacity, or the cache empties)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, budget: int | None = None, captures: Captures | None = None,
                 graphs_of: Callable[[object], list] | None = None) -> None:
        self.capacity = check_range("graph_cache", capacity, "ShapeCache", "capacity")
        self.budget = budget
        self.entries: OrderedDict = OrderedDict()
        self.sizes: dict = {}  # key -> (kept, scratch) bytes
        self.stats = {"builds": 0, "hits": 0}
        self.dropped = 0
        self.captures, self.graphs_of = captures, graphs_of
        self.retired = 0  # entries whose graphs are retired
        self.retired_scratch = 0  # the largest scratch among them (what their pool still holds)

    def held(self, size: tuple = (0, 0)) -> int:
        """The bytes the entries hold, with one more of `size` (kept, scratch) beside them (and the retired graphs'
        scratch)."""
        sizes = [*self.sizes.values(), size]
        return sum(k for k, _ in sizes) + max(self.retired_scratch, *(s for _, s in sizes))

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
            self._drop_oldest()  # before the build: the old entry's memory is given back first
        entry = self.entries[key] = build()
        self.sizes[key] = tuple(size)
        self.stats["builds"] += 1
        return entry, False

    def _drop_oldest(self) -> None:
        key, entry = self.entries.popitem(last=False)
        _, scratch = self.sizes.pop(key)
        self.dropped += 1
        if self.captures is None:
            return
        graphs = self.graphs_of(entry)
        del entry  # the entry's own tensors go now (its graphs hold none of them)
        self.captures.drop(*graphs)
        del graphs
        if self.captures.retired:
            self.retired += 1
            self.retired_scratch = max(self.retired_scratch, scratch)
            if self.retired > self.capacity or not self.entries:
                self.clear()

    def clear(self) -> None:
        """Drop every entry, and every retired graph, at once."""
        self.entries.clear()
        self.sizes.clear()
        if self.captures is not None:
            self.captures.flush()
        self.retired = self.retired_scratch = 0

    def __len__(self) -> int:
        return len(self.entries)


def cache_rows(n: int, bucket: int = 256) -> int:
    """A decode cache's length for n rows: rounded up to a multiple of `bucket`, so prompts of many lengths share
    one cache and one captured decode step (the masked attention reads the whole buffer whatever its fill)."""
    return -(-n // bucket) * bucket


class DecodeGraph:
    """A static KV cache of max_len rows (sicl_fast.models.transformer.StaticCache) and the decode step on it:
    step(token int64 [1]) -> next-token logits [V] (model dtype; one buffer, overwritten by the next call).
    With captures that capture (CUDA) the step is a replayed graph: the token goes into a fixed input buffer, the
    position is the cache's device-held `pos`, so any fill of the cache replays the same graph. Reuse: the caller's
    prefill writes the cache's rows [0, L) and sets pos = L; rows past pos are masked, whatever an earlier answer
    left there. check(self): the ReplayCheck of its graph's first replay (FastBackend's DecodeCheck)."""

    def __init__(self, model, max_len: int, ops, captures: Captures | None = None,
                 check: Callable[[DecodeGraph], ReplayCheck] | None = None) -> None:
        self.model, self.max_len = model, max_len
        self.cache = model.new_cache(max_len)
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.logits = torch.empty(model.head.shape[0], dtype=model.dtype, device=model.device)
        # the warm-up decodes at positions 0, 1 (rows the next prefill overwrites)
        self._run = (captures.capture(weakly(self._decode), keep=model_refs(model, ops),
                                      check=check(self) if check is not None else None)
                     if captures is not None else None)

    @property
    def graph(self):
        """The captured decode step (or the uncaptured callable, or None)."""
        return self._run

    def _decode(self) -> None:
        self.logits.copy_(self.model.decode_logits(self.token, self.cache))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token.view(1))
        if self._run is None:
            self._decode()
        else:
            self._run()
        return self.logits


__all__ = ["CapturedStep", "Captures", "ReplayCheck", "first_replay", "off_by",
           "capturable", "capture_stream", "weakly", "workspace_hazard", "model_refs",
           "ShapeCache", "DecodeGraph", "cache_rows", "GRAPH_MODES", "DEFAULT_CAPACITY", "BUCKET_CAPACITY",
           "HAZARD_VERSIONS", "WORKSPACE_HAZARD"]
