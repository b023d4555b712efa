"""The graph caches (sicl_fast.run.graphs, sicl_fast.calibration.static.StepCache) and what they rely on, on the CPU: a
static step re-armed for another prompt of its shape (StaticStep.load) gives the result a new step gives, bit for bit;
the caches are bounded and least-recently-used; decoding through the bucketed, reused caches gives the answer a
fresh cache gives, whatever an earlier, longer answer left in the buffer. On the CPU `captured` is the callable
itself, so these run the very code a CUDA graph replays, minus the capture (tests/test_cuda.py runs the capture).
"""
import pytest
import torch

from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.engine import Engine
from sicl_fast.errors import SiclError
from sicl_fast.run.graphs import ShapeCache, cache_rows
from sicl_fast.run.plan import resolve_graphs
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from sicl_fast.calibration.static import StaticStep, StepCache, run_static
from test_fast_backend import L, V, make_prompt
from test_static import BASE, assert_same_result


def moved(a: int, seed: int) -> Prompt:
    """make_prompt's shape (L, a, b, span count and lengths) with its spans elsewhere and other tokens."""
    g = torch.Generator().manual_seed(seed)
    return Prompt(request=Request(id=f"moved-{seed}", prompt="x" * 100, output_spans=((10, 20),)),
                  input_ids=torch.randint(0, V, (L,), generator=g), token_spans=((16, 22), (25, 30)),
                  demo_start=a, demo_end=31)


@pytest.mark.parametrize("scope", ["prompt", "demos"])  # demos: the prefix K/V is kept, and re-armed by load
def test_step_cache_reuses_one_step_per_shape(models, scope):
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "projection_scope": scope, "kappa": 0.999, "eta": 2.0,
                                              "grad_mode": "normalize"})).config
    a = 6
    prompts = [make_prompt(a, seed=1), moved(a, seed=2), make_prompt(a, seed=3)]
    shapes = {StaticStep.shape(be, cfg, p, be.embed(p)) for p in prompts}
    assert len(shapes) == 1  # same shape although the spans moved
    cache = StepCache("cpu", capacity=2)
    for p in prompts + prompts[:1]:
        ref = run_static(be, cfg, p, sync_every=2)
        assert ref.projections > 0 or scope == "demos"
        assert_same_result(run_static(be, cfg, p, sync_every=2, steps=cache), ref)
    assert cache.cache.stats == {"builds": 1, "hits": 3}


def test_step_cache_is_bounded_and_keyed_by_shape(models):
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "max_steps": 2})).config
    cache = StepCache("cpu", capacity=1)
    p0, p6 = make_prompt(0, seed=1), make_prompt(6, seed=1)  # another demo start: another shape
    for p in (p0, p6, p0):
        assert_same_result(run_static(be, cfg, p, steps=cache), run_static(be, cfg, p))
    assert cache.cache.stats == {"builds": 3, "hits": 0} and len(cache.cache) == 1
    other = cfg.replace(max_steps=3)  # the config is part of the shape (history length, launch arguments)
    assert StaticStep.shape(be, cfg, p0, be.embed(p0)) != StaticStep.shape(be, other, p0, be.embed(p0))


def test_shape_cache_drops_the_least_recently_used():
    built = []
    c = ShapeCache(2)
    for key in ("a", "b", "a", "c", "b"):
        c.get(key, lambda: built.append(key) or key)
    assert built == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came
    assert list(c.entries) == ["c", "b"]
    for bad in (0, 1.5, True):
        with pytest.raises(SiclError, match="capacity"):
            ShapeCache(bad)


def test_decode_through_reused_caches_equals_a_fresh_cache(models):
    lm = models["qwen3"]
    fresh, reused = make_backend("fast-fp32", lm, impl="torch"), make_backend("fast-fp32", lm, impl="torch")
    reused.use_graphs(capacity=2)
    # a long prompt first (it fills the shared cache further), then shorter ones in the same length bucket
    for a, n, tokens in ((0, L, 12), (6, 30, 5), (6, 20, 9)):
        X = fresh.embed(make_prompt(a, seed=n))[:n]
        want = fresh.generate(X, None, tokens)
        got = reused.generate(X, None, tokens)
        assert got.token_ids == want.token_ids and len(want.token_ids) == tokens
    assert reused.decoders.stats == {"builds": 1, "hits": 2}
    assert cache_rows(1) == cache_rows(256) == 256 and cache_rows(257) == 512


class HostDataGuard:
    """Fails when a tensor is made from host data (torch.tensor / as_tensor / from_numpy): on CUDA that is a copy
    from pageable host memory, which a CUDA graph capture refuses. A warmed-up step and decode step make none (the
    launchers cache their device constants on the first call)."""

    NAMES = ("tensor", "as_tensor", "from_numpy")

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        for name in self.NAMES:
            def trip(*a, _name=name, **k):
                raise AssertionError(f"a tensor made from host data inside a captured call: torch.{_name}")
            self.mp.setattr(torch, name, trip)

    def __exit__(self, *exc):
        self.mp.undo()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_warm_step_and_decode_make_no_tensor_from_host_data(models, monkeypatch, impl):
    from test_ops import device_of, why_unavailable

    if why_unavailable(impl) or device_of(impl) != "cpu":
        pytest.skip(why_unavailable(impl) or "the tiny model lives on the CPU; tests/test_cuda.py captures on CUDA")
    be = make_backend("fast", models["gemma2"], diff_matmul="bf16", impl=impl)
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "snr_threshold": 0.5, "patience": 2, "kappa": 0.9})).config
    p = make_prompt(6)
    st = StaticStep(be, cfg, p, be.embed(p))
    be.use_graphs()
    X = be.embed(p)
    for _ in range(2):  # the warm-up a capture does
        st()
    be.generate(X, None, 3)
    dec = next(iter(be.decoders.entries.values()))
    with HostDataGuard(monkeypatch):
        st()
        dec.step(dec.token.clone())  # one decode step at the cache's position
    with HostDataGuard(monkeypatch), pytest.raises(AssertionError, match="host data"):
        torch.tensor([1.0])  # the guard works
    assert int(st.state.steps_run) == 3


def test_engine_graph_modes_on_the_cpu(models):
    lm = models["llama"]
    for static in (True, False):
        assert not resolve_graphs("auto", "cpu", static, "fast", "auto")[0]
        assert not resolve_graphs("off", "cuda", static, "fast", "auto")[0]
    assert resolve_graphs("auto", "cuda", True, "fast", "auto")[0]
    assert not resolve_graphs("auto", "cuda", False, "hf", "auto")[0]  # nothing to capture
    assert Engine(lm, backend="fast-fp32").steps is None  # auto: off on the CPU
    with pytest.raises(SiclError, match="graphs 'on' needs a CUDA device"):
        Engine(lm, backend="fast-fp32", graphs="on")
    with pytest.raises(SiclError, match="unknown graphs 'yes'"):
        Engine(lm, backend="fast-fp32", graphs="yes")


# ------------------------------------------------------------------ issue 53: freed by reference counting, the hazard


@pytest.fixture(scope="module")
def one_layer():
    """A one-layer Llama of the tiny models' shapes: what owns, checks and drops graphs, quickly."""
    from test_fast_backend import build

    return build("llama", layers=1)


@pytest.fixture
def no_cyclic_collector(monkeypatch):
    """The cyclic collector off (and gc.collect refused): what is freed is freed by reference counting alone."""
    import gc

    gc.collect()
    gc.disable()
    monkeypatch.setattr(gc, "collect", lambda *a: pytest.fail("gc.collect ran: a reference cycle to break"))
    yield
    gc.enable()


def step_size(backend, config, prompt, X0=None, bucket=None, plan=None):
    """The bytes of a StaticStep (run.memory.step_bytes through its StepPlan: the plan it was made with, or its
    own)."""
    from sicl_fast.calibration.step_plan import StepPlan

    if plan is None:
        X0 = backend.embed(prompt) if X0 is None else X0
        plan = StepPlan.of(backend, config.resolve_scale(backend.lm), prompt, X0[:prompt.length], bucket)
    return plan.bytes


def lengths_prompt(L: int) -> Prompt:
    """A prompt of L tokens (a shape of its own per length), two spans, three prefix rows."""
    from test_packed import prompt_of

    return prompt_of(L, ((5, 9), (12, L - 3)), 3, L)


def test_dropped_steps_and_their_graphs_are_freed_by_reference_counting(one_layer, monkeypatch, no_cyclic_collector):
    """The step cache filled past its byte budget through the capture path (tests/fake_graphs.py), with the cyclic
    collector off: each step it drops, with its forward (reference, prefix K/V) and graphs (the step's, the
    refresh's), is gone as it leaves, and the bytes of the steps still reachable (run.memory.step_bytes, the
    project's own count) never exceed the budget, not even while the next step is built."""
    import weakref

    from fake_graphs import FakeCuda

    from sicl_fast.backends import step_forward

    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(step_forward, "REFRESH_EVERY", 4)  # 16 in a run, sooner here
    be = make_backend("fast", one_layer, diff_matmul="bf16", impl="torch")
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "max_steps": 5})).config  # a refresh after step 4
    prompts = [lengths_prompt(L) for L in (48, 50, 52, 50, 54, 56)]  # 50 again: a hit
    sizes = [step_size(be, cfg, p) for p in prompts]
    # two steps at a time, not three: each kept, and the temporaries with the step a capture is checked against
    budget = 2 * max(s.kept for s in sizes) + max(s.activations + s.kept for s in sizes)
    steps = StepCache("cuda", capacity=8, budget=budget)
    made, worst = [], [0]

    def live(*new) -> int:  # the bytes of every step still reachable (itself, or its forward alone), and of `new`
        alive = [size for (st, fwd), size in made if st() is not None or fwd() is not None] + list(new)
        return sum(s.kept for s in alive) + max((s.activations for s in alive), default=0)

    init = StaticStep.__init__

    def spy(self, backend, config, prompt, X0, *a, **k):  # the cache's steps and the capture checks' (run.graphs)
        size = step_size(backend, config, prompt, X0, k.get("bucket"), k.get("plan"))
        worst[0] = max(worst[0], live(size))  # as it is built
        init(self, backend, config, prompt, X0, *a, **k)
        made.append(((weakref.ref(self), weakref.ref(self.forward)), size))
        if backend is be:
            ours.append(made[-1][0])
    ours = []
    monkeypatch.setattr(StaticStep, "__init__", spy)
    for p in prompts:
        assert run_static(be, cfg, p, steps=steps).steps == 5
        assert live() <= budget
    assert len(ours) == 5 and steps.cache.dropped == 3 and fake.replays > 0  # each shape built once, captured
    assert be.plan.fallback is None and len(made) == 10  # each first replay checked against a step of its own
    assert worst[0] <= budget
    kept = {id(st) for st, _ in steps.cache.entries.values()}
    for st, fwd in ours:
        assert (st() is not None) == (fwd() is not None) == (id(st()) in kept)


def test_dropped_decode_graphs_and_packed_layouts_are_freed_by_reference_counting(models, monkeypatch,
                                                                                  no_cyclic_collector):
    """A decode cache dropped, and a packed step with its captured layout, are gone when their
    last holder lets them go, with the cyclic collector off; the packed run's graph replays what the uncaptured
    run computes."""
    import weakref

    from fake_graphs import FakeCuda
    from sicl_fast.calibration import packed
    from sicl_fast.run import graphs
    from test_packed import BASE as PACKED

    FakeCuda(monkeypatch)
    be = make_backend("fast", models["qwen3"], diff_matmul="bf16", impl="torch")
    be.use_graphs(capacity=1)
    decoders = []
    init = graphs.DecodeGraph.__init__
    monkeypatch.setattr(graphs.DecodeGraph, "__init__",
                        lambda self, *a, **k: init(self, *a, **k) or decoders.append(weakref.ref(self)))
    X = be.embed(make_prompt(6))
    want = be.generate(X[:20], None, 4).token_ids
    assert len(decoders) == 1 and decoders[0]() is not None
    be.use_graphs(capacity=1)  # the decode caches dropped
    assert decoders[0]() is None
    assert be.generate(X[:20], None, 4).token_ids == want
    steps = []
    pinit = packed.PackedStep.__init__
    monkeypatch.setattr(packed.PackedStep, "__init__",  # the runs' steps and their capture check's
                        lambda self, *a, **k: pinit(self, *a, **k) or steps.append(weakref.ref(self)))
    items = [(lengths_prompt(L), PACKED.replace(max_steps=6, patience=0)) for L in (20, 26, 22)]
    plain = packed.run_packed(be, items, pack=2, sync_every=2, graphs=False)
    got = packed.run_packed(be, items, pack=2, sync_every=2, graphs=True)
    assert len(steps) == 3 and [s() is None for s in steps] == [True, True, True]
    for g, r in zip(got, plain):
        assert_same_result(g, r)


def test_workspace_hazard_versions():
    from sicl_fast.run.graphs import workspace_hazard

    assert [workspace_hazard(v) for v in ("2.10.1", "2.11.0+cu130", "2.12.1", "2.13.0", "2.14.0.dev20261201")] == [
        False, True, True, False, False]
    assert workspace_hazard("unknown")  # assumed: retiring costs memory, never correctness


@pytest.mark.parametrize("retire", [True, False])
def test_no_graph_replays_after_another_graph_of_its_stream_died(one_layer, monkeypatch, retire):
    """torch 2.11-2.12 free the cuBLAS workspace of every graph captured on a stream when one of them is destroyed
    (pytorch/pytorch#193402; the fake records it: FakeCuda.hazards). With retirement (those versions) a step cache
    dropping steps for room replays no graph after another graph of its stream died: the dropped ones are retired,
    their pool's scratch still counted (ShapeCache.held), at most `capacity` entries' worth, then every graph of the
    cache goes at once. Without it (newer torch) they are destroyed at once, which the fake shows would be the
    hazard. Each owner (the step cache, the decode caches, a packed step) captures on a stream of its own, whatever
    torch's pool of 32 streams hands out in between."""
    import torch as t

    from fake_graphs import FakeCuda
    from sicl_fast.run import graphs

    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(graphs, "WORKSPACE_HAZARD", retire)
    be = make_backend("fast", one_layer, diff_matmul="bf16", impl="torch")
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "max_steps": 1})).config
    steps = StepCache("cpu", capacity=2, budget=10 ** 12)  # captures through the fake
    sizes = {n: step_size(be, cfg, lengths_prompt(n)) for n in (56, 52, 48, 44, 40)}
    seq = (56, 52, 48, 52, 44, 40, 52) if retire else (56, 52, 48, 52)  # without: 52 replays after 56 died
    for i, n in enumerate(seq):
        run_static(be, cfg, lengths_prompt(n), steps=steps)
        live = [sizes[p.length] for p in (st.prompt for st, _ in steps.cache.entries.values())]
        assert len(steps.captures.retired) <= 2 * steps.cache.capacity  # two graphs an entry
        if retire and i == 2:  # 56 dropped for 48: retired, its scratch (the largest) still held by the pool
            assert len(steps.captures.retired) == 2 and steps.cache.held() == (  # (a check's step counted with it)
                sum(s.kept for s in live) + sizes[56].activations + sizes[56].kept)
    # retiring: the third retired entry (52, for 40) outnumbers the capacity, and the cache goes at once
    assert steps.cache.dropped == (3 if retire else 1) and (fake.hazards == []) == retire
    assert steps.captures.retired == [] or retire
    be.use_graphs()
    owners = [steps.captures, be._decode_captures]
    for _ in range(40):  # torch's pool comes round again: a new owner still gets a stream of its own
        t.cuda.Stream()
        owners.append(graphs.Captures("cpu"))
        assert len({c.stream.cuda_stream for c in owners}) == len(owners)
        owners.pop()
