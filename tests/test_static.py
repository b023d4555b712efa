"""The static, sync-free step and its driver (sicl_fast.calibration.static) against the eager reference loop
(Calibrator.run): the same CalibrationResult bit for bit (history, best step, stop reason, steps, projections,
embeddings), for every estimator, grad mode, projection scope, SNR setting and gate case, whatever the number
of steps between two reads of the state; and no host read inside a step.
"""
import copy
import dataclasses

import pytest
import torch

from conftest import synthetic_prompt
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import build_backend, make_backend
from sicl_fast.errors import SiclError
from sicl_fast.calibration.static import StaticStep, run_static
from sicl_fast.models.decoder_config import DecoderConfig
from sicl_fast.run.buckets import Bucket
from sicl_fast.run.plan import make_plan
from test_fast_backend import V, build, make_prompt
from test_ops import device_of, why_unavailable

BASE = dict(N=3, mu=0.05, eta=0.5, kappa=0.2, tau=0.0, patience=0, max_steps=5, seed=3, scale=1.0)
CONFIGS = {
    "forward-clip-prompt": dict(),
    "central-normalize-demos-projects": dict(estimator="central", grad_mode="normalize", projection_scope="demos",
                                             kappa=0.999, eta=2.0),
    "prompt-projection-fires": dict(kappa=0.999, eta=2.0, grad_mode="normalize"),
    "patience": dict(eta=0.0, patience=2, max_steps=8),
    "snr-stop": dict(snr_threshold=1e9, patience=2, max_steps=8),
    "snr-skips": dict(snr_threshold=0.5, patience=4, max_steps=6),
    "gate": dict(tau=0.99),
    "perturb-query": dict(perturb_query=True, grad_mode="normalize"),
    "one-step": dict(max_steps=1),
    # patience from the last counted improvement: better steps that do not count, and ones that do
    "min-delta": dict(patience=2, max_steps=12, min_delta=1e-5),
    "min-delta-rel": dict(patience=2, max_steps=12, min_delta_rel=8e-3),
}


def assert_same_result(got, ref):
    assert got.history == ref.history  # python floats of the same float32 values: exact
    for name in ("steps", "best_step", "stop_reason", "gated", "projections", "initial_proxy", "best_proxy",
                 "impl"):
        assert getattr(got, name) == getattr(ref, name), name
    assert torch.equal(got.embeddings.cpu(), ref.embeddings.cpu())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("family,a", [("llama", 0), ("gemma2", 6)])
def test_static_equals_eager(models, family, a, impl, name):
    if why_unavailable(impl):
        pytest.skip(why_unavailable(impl))
    lm = models[family]
    be = make_backend("fast-fp32", lm, impl=impl)
    cfg = CalibrationConfig(**{**BASE, **CONFIGS[name]})
    p = make_prompt(a, seed=a + 1)
    ref = Calibrator(be, cfg).run(p)
    expected = {"patience": "patience", "snr-stop": "snr", "gate": "gate", "min-delta": "patience",
                "min-delta-rel": "patience"}.get(name, "max_steps")
    assert ref.stop_reason == expected or name == "snr-skips"
    if name.endswith("fires") or name.endswith("projects"):
        assert ref.projections > 0
    for k in (1, 3, 7):  # reads every k steps; the runs past a stop must not change the result
        assert_same_result(run_static(be, cfg, p, sync_every=k), ref)


def test_static_with_difference_products_equals_eager(models):
    be = make_backend(
        "fast", models["llama"], diff_matmul="bf16", impl="cpp" if not why_unavailable("cpp") else "torch"
    )
    cfg = CalibrationConfig(**{**BASE, **CONFIGS["central-normalize-demos-projects"]})
    p = make_prompt(6)
    assert_same_result(run_static(be, cfg, p, sync_every=2), Calibrator(be, cfg).run(p))


@pytest.fixture(scope="module")
def llama_one_layer():
    """The tiny Llama with one decoder layer: Triton's interpreter runs each kernel program in Python, and what the
    static driver adds (perturb, update, proxy state on the device) is the same for any depth."""
    return build("llama", layers=1)


# the Triton ops under the interpreter: one configuration with the most of the step's branches (central estimate,
# normalised rows, scope 'demos', the projection firing); the others run with the torch and C++ ops above
@pytest.mark.parametrize("name", ["central-normalize-demos-projects"])
def test_static_triton_equals_eager(llama_one_layer, name):
    if why_unavailable("triton") or device_of("triton") != "cpu":
        pytest.skip(why_unavailable("triton") or "the tiny model lives on the CPU")
    be = make_backend("fast-fp32", llama_one_layer, impl="triton")
    cfg = CalibrationConfig(**{**BASE, **CONFIGS[name], "max_steps": 3})
    p = make_prompt(6)
    assert_same_result(run_static(be, cfg, p, sync_every=2), Calibrator(be, cfg).run(p))


class HostReadGuard:
    """Fails on what would synchronise with a GPU: .item(), .tolist(), float() / int() / bool() of a tensor (the
    semantics of torch.cuda.set_sync_debug_mode('error'), emulated on the CPU); and on a tensor made from host data
    (torch.tensor, torch.as_tensor: on CUDA a copy from pageable host memory, which a graph capture refuses). What a
    captured call reads must be made before the capture: the guarded calls come after a first call (the capture's
    warm-up) that may make and cache such tensors."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")
    MAKERS = ("tensor", "as_tensor")

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        for name in self.NAMES:
            def trip(self_, *a, _name=name, **k):
                raise AssertionError(f"host read inside the step: Tensor.{_name}")
            self.mp.setattr(torch.Tensor, name, trip)
        for name in self.MAKERS:
            def made(*a, _name=name, **k):
                raise AssertionError(f"host data made into a tensor inside the step: torch.{_name}")
            self.mp.setattr(torch, name, made)

    def __exit__(self, *exc):
        self.mp.undo()


def guarded_backend(models, family: str, impl: str):
    """The fast backend with difference products; family 'gemma2-unscaled': Gemma 2 as older transformers load it,
    its embedding without `embed_scale`, so that the decoder multiplies its inputs itself (DecoderConfig.input_mult)."""
    lm = models[family.removesuffix("-unscaled")]
    plan = make_plan(lm, backend="fast", diff_matmul="bf16", impl=impl)
    if family.endswith("-unscaled"):
        plan = dataclasses.replace(plan, decoder=DecoderConfig.from_hf(lm.text_config,
                                                                       torch.nn.Embedding(4, lm.hidden_size)))
        assert plan.decoder.input_mult is not None
    return build_backend(plan, lm)


@pytest.mark.parametrize("scope", ["prompt", "demos"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma2-unscaled", "gemma3_text"])
def test_no_host_read_in_the_step_its_refresh_and_decoding(models, monkeypatch, family, scope):
    """The difference form's step padded to a length bucket, its reference refresh and a decoding step, after a
    first call of each (a capture's warm-up): no host read and no tensor made from host data, for every family the
    fast backend runs (Gemma 2 with and without the embedding's own scale) and both projection scopes, with the C++
    ops (the CPU's default) and on Gemma 2 without embed_scale the torch ops too (the Triton ops: under this guard in
    tests/test_refresh.py's launch budget)."""
    impls = ["cpp" if not why_unavailable("cpp") else "torch"] + (["torch"] if family == "gemma2-unscaled" else [])
    p = synthetic_prompt(45, [(14, 20), (26, 31)], 6, V, seed=3)
    for impl in impls:
        be = guarded_backend(models, family, impl)
        # patience 4: the SNR skips and patience are live in the step, and no stop can come before the fourth call
        cfg = Calibrator(be, CalibrationConfig(**{**BASE, "snr_threshold": 0.5, "patience": 4, "kappa": 0.9,
                                                  "projection_scope": scope})).config
        st = StaticStep(be, cfg, p, be.embed(p), bucket=Bucket.of(p))
        assert st.spec.L > p.length and st.forward.policy == {"prompt": "pass", "demos": "kept"}[scope]
        m, tok = be.model, torch.tensor([3])
        cache = m.new_cache(64)
        m.forward(be.embed(p)[None, :20].to(m.dtype), 0, cache=cache)
        cache.pos.fill_(20)
        calls = (st, lambda: st.forward.refresh(st.state.X), lambda: m.decode_logits(tok, cache))
        for call in calls:
            call()
        with HostReadGuard(monkeypatch):
            for call in calls + (st,):
                call()
        assert int(st.state.steps_run) == 3 and int(cache.pos) == 22
    with HostReadGuard(monkeypatch), pytest.raises(AssertionError, match="host read inside the step"):
        float(st.state.steps_run)  # the guard works
    with HostReadGuard(monkeypatch), pytest.raises(AssertionError, match="host data made into a tensor"):
        torch.tensor([1])


def test_nonfinite_proxy_and_bad_arguments(models):
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    p = make_prompt(0)
    cfg = CalibrationConfig(**BASE)
    with pytest.raises(SiclError, match="sync_every must be >= 1, got 0"):
        run_static(be, cfg, p, sync_every=0)
    with pytest.raises(SiclError, match="the static step needs a forward without host reads.*'hf'"):
        run_static(make_backend("hf", models["llama"], impl="torch"), cfg, p)
    X0 = be.embed(p)
    X0[3, 0] = float("nan")
    with pytest.raises(SiclError, match="NaN or inf .row 3"):
        run_static(be, cfg, p, X0=X0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text"])
def test_static_cache_decoding_equals_transformers(models, family, monkeypatch):
    """Greedy ids of the fixed-buffer decoder equal transformers' own generation, whatever the read interval;
    every decoded token attends over the same buffer shape (no per-length shapes)."""
    from sicl_fast.backends.generate import greedy_generate
    from sicl_fast.models import attention

    lm = models[family]
    be = make_backend("fast-fp32", lm, impl="torch")
    p = make_prompt(0, seed=5)
    X = be.embed(p)
    ref = greedy_generate(lm, X, 12)
    shapes = []
    real = attention.attend_math
    monkeypatch.setattr(attention, "attend_math", lambda q, k, *a: shapes.append(tuple(k.shape)) or real(q, k, *a))
    for every in (1, 3, 8):
        be.read_every = every
        got = be.generate(X, p, 12)
        assert got.token_ids == ref.token_ids and got.stop_reason == ref.stop_reason
    decode_shapes = {s for s in shapes if s[1] > X.shape[0]}  # the decode steps' keys: the whole buffer
    assert len(decode_shapes) == 1


def test_decode_step_has_no_host_read(models, monkeypatch):
    m = make_backend("fast-fp32", models["gemma2"], impl="torch").model
    cache = m.new_cache(40)
    m.forward(torch.randn(1, 20, m.d), 0, cache=cache)
    cache.pos.fill_(20)
    tok = torch.tensor([3])
    with HostReadGuard(monkeypatch):
        for _ in range(5):
            tok = m.decode_logits(tok, cache).argmax().view(1)
    assert int(cache.pos) == 25
    from sicl_fast.models.transformer import Positions

    pos = Positions.decoding(m.rotary, cache.pos)
    assert pos.start is None and pos.at is cache.pos  # no host start, not even a sentinel: the position is the device's


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_captured_static_step_equals_eager_on_cuda(models):
    """Warm-up steps change the state, so the captured step runs on a fresh state whose first steps are the
    warm-up's: compare the eager loop against warm-up + replays."""
    from sicl_fast.run.graphs import CapturedStep
    from sicl_fast.models import from_transformers

    # a copy: the tiny models are shared by the whole session (test_fast_backend.tiny_models)
    lm = from_transformers(copy.deepcopy(models["llama"].model).to("cuda"), models["llama"].tokenizer,
                           name="tiny-llama-cuda")
    be = make_backend("fast-fp32", lm, impl="triton")
    cfg = Calibrator(be, CalibrationConfig(**{**BASE, "max_steps": 6})).config
    p = make_prompt(6)
    ref = Calibrator(be, cfg).run(p)
    st = StaticStep(be, cfg, p, be.embed(p))
    g = CapturedStep(st, warmup=2)  # steps 0 and 1 run eagerly; the capture records without running
    for _ in range(4):  # steps 2 .. 5: max_steps
        g()
    assert st.result(0.0).history == ref.history


def test_should_stop_ends_a_static_run_with_its_reason(models):
    """A deadline from outside (the server's hook): the run ends at the next read with the best X so far."""
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    cfg = CalibrationConfig(**{**BASE, "max_steps": 20})
    p = make_prompt(0)
    ticks = []
    res = run_static(be, cfg, p, sync_every=2, should_stop=lambda: ticks.append(1) or ("deadline" if len(ticks) == 2
                                                                                        else None))
    assert res.stop_reason == "deadline" and res.steps == 4 and len(res.history) == 4
    ref = Calibrator(be, cfg.replace(max_steps=4)).run(p)
    assert res.history == ref.history and res.best_step == ref.best_step


# ------------------------------------------------------------------ issue 31: min_delta and the time budget


def test_the_papers_rule_is_min_delta_zero(models):
    """min_delta = min_delta_rel = 0 leaves patience as the paper counts it; the smallest positive min_delta takes
    the anchor's path through every loop and gives the same run bit for bit (float32 proxies differ by far more
    than 5e-324), while a real margin changes where patience stops."""
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    cfg = CalibrationConfig(**{**BASE, **CONFIGS["min-delta"], "min_delta": 0.0})
    p = make_prompt(0, seed=1)
    paper = Calibrator(be, cfg).run(p)
    assert paper.stop_reason == "max_steps" and paper.steps == 12
    tiny = cfg.replace(min_delta=5e-324)
    assert_same_result(Calibrator(be, tiny).run(p), paper)
    assert_same_result(run_static(be, tiny, p, sync_every=5), paper)
    assert Calibrator(be, cfg.replace(min_delta=1e-5)).run(p).steps < 12


def fake_clock(monkeypatch) -> list:
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


@pytest.mark.parametrize("k", [1, 2])
def test_time_budget_in_the_static_loop_is_checked_at_each_read(models, monkeypatch, k):
    be = make_backend("fast-fp32", models["llama"], impl="torch")
    cfg = CalibrationConfig(**{**BASE, "max_steps": 10})
    p = make_prompt(0)
    clock = fake_clock(monkeypatch)
    tick = lambda step, f: clock.__setitem__(0, clock[0] + 1.0)  # noqa: E731 - each step takes a second
    res = run_static(be, cfg, p, sync_every=k, on_step=tick, time_budget_s=2.5)
    steps = 3 if k == 1 else 4  # the first read at or after 2.5 s
    assert res.stop_reason == "time_budget" and res.steps == steps
    ref = Calibrator(be, cfg.replace(max_steps=steps)).run(p)
    assert res.history == ref.history and res.best_step == ref.best_step
    assert torch.equal(res.embeddings, ref.embeddings)
    assert run_static(be, cfg, p, sync_every=k, time_budget_s=0).steps == k  # the first read


@pytest.mark.parametrize("loop", ["static", "eager"])
def test_engine_time_budget_and_best_at(models, loop):
    """Engine.calibrate's run arguments on either loop: the budget (0: one step, or one read), the best X kept
    after given step counts (equal to the run stopped there), and their checks."""
    from sicl_fast.engine import Engine

    eng = Engine(models["llama"], backend="fast-fp32", impl="torch", loop=loop, sync_every=3)
    cfg = CalibrationConfig(**{**BASE, "max_steps": 8, "eta": 2.0})
    p = make_prompt(6)
    res = eng.calibrate(p, cfg, time_budget_s=0)
    assert res.stop_reason == "time_budget" and res.steps == (3 if loop == "static" else 1)
    res = eng.calibrate(p, cfg, best_at=[5, 1, 2, 50])
    assert sorted(res.best_at) == [1, 2, 5] and res.steps == 8
    for n, (best_step, X) in res.best_at.items():
        ref = Calibrator(eng.backend, cfg.replace(max_steps=n)).run(p)
        assert best_step == ref.best_step and torch.equal(X, ref.embeddings)
    with pytest.raises(SiclError, match=r"Engine.calibrate: time_budget_s must be >= 0.0, got -1"):
        eng.calibrate(p, cfg, time_budget_s=-1)
    with pytest.raises(SiclError, match=r"Engine.calibrate: a step count must be >= 1, got 0"):
        eng.calibrate(p, cfg, best_at=[0])
