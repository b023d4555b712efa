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
