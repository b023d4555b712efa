"""Algorithm 1 on a tiny random-weight Llama: repeatability, monotone best, untouched rows, projection, gate."""
import math

import pytest
import torch

from conftest import synthetic_prompt
from sicl_fast.step import zo
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator, preset_name
from sicl_fast.backends import make_backend
from sicl_fast.errors import NumericalError, SiclError
from sicl_fast.step.rng import directions
from sicl_fast.step.spec import StepSpec

# tau=0 so the gate never fires on a random model; scale=1: absolute units; big steps so things move
BASE = CalibrationConfig(N=4, mu=0.01, eta=0.5, kappa=0.2, tau=0.0, patience=0, max_steps=6, seed=3, scale=1.0)


@pytest.fixture(scope="module")
def setup(tiny_llama):
    p = synthetic_prompt(36, [(6, 9), (14, 16), (22, 26)], a=4, vocab=tiny_llama.config.vocab_size, seed=5)
    return make_backend("hf", tiny_llama), p


def test_seeded_run_is_bit_for_bit_repeatable(setup):
    hf, p = setup
    r1 = Calibrator(hf, BASE).run(p)
    r2 = Calibrator(hf, BASE).run(p)
    assert r1.history == r2.history and len(r1.history) == 6
    assert torch.equal(r1.embeddings, r2.embeddings)
    r3 = Calibrator(hf, BASE.replace(seed=4)).run(p)
    assert r3.history[1:] != r1.history[1:]


def test_never_worse_than_initial_and_best_is_max_of_history(setup):
    hf, p = setup
    for seed in range(3):
        r = Calibrator(hf, BASE.replace(seed=seed, eta=2.0)).run(p)
        assert r.best_proxy >= r.initial_proxy
        assert r.best_proxy == max(r.history) and r.history[r.best_step] == r.best_proxy
        # the returned embeddings really score best_proxy
        f = Calibrator(hf, BASE).proxy_of(r.embeddings.unsqueeze(0), p).f
        assert float(f[0]) == pytest.approx(r.best_proxy, abs=1e-6)


def test_query_and_prefix_rows_untouched_without_projection(setup):
    hf, p = setup
    X0 = hf.embed(p)
    r = Calibrator(hf, BASE.replace(kappa=0.0, eta=0.05)).run(p)
    assert r.projections == 0 and r.best_step > 0
    a, b = p.demo_start, p.demo_end
    assert torch.equal(r.embeddings[:a], X0[:a]) and torch.equal(r.embeddings[b:], X0[b:])
    assert not torch.equal(r.embeddings[a:b], X0[a:b])


def test_projection_fires_and_lands_on_kappa(setup):
    hf, p = setup
    X0 = hf.embed(p)
    # unit-norm rows times a huge eta drive cos(X, X0) far below kappa; every update projects back onto kappa
    r = Calibrator(hf, BASE.replace(eta=50.0, kappa=0.9, grad_mode="normalize")).run(p)
    assert r.projections > 0
    if r.best_step > 0:
        assert zo.cosine(r.embeddings, X0) == pytest.approx(0.9, abs=1e-5)
        # the whole-matrix projection rescales the query rows too (as the reference does)
        assert not torch.equal(r.embeddings[p.demo_end:], X0[p.demo_end:])


def test_projection_scope_demos_keeps_other_rows(setup):
    hf, p = setup
    X0 = hf.embed(p)
    r = Calibrator(hf, BASE.replace(eta=50.0, kappa=0.9, grad_mode="normalize", projection_scope="demos")).run(p)
    assert r.projections > 0 and r.best_step > 0
    a, b = p.demo_start, p.demo_end
    assert torch.equal(r.embeddings[:a], X0[:a]) and torch.equal(r.embeddings[b:], X0[b:])
    assert zo.cosine(r.embeddings[a:b], X0[a:b]) == pytest.approx(0.9, abs=1e-5)


def test_project_cosine_geometry():
    torch.manual_seed(0)
    X0 = torch.randn(7, 5)
    for X in (torch.randn(7, 5), -X0 + 0.1 * torch.randn(7, 5)):
        out, fired = zo.project_cosine(X, X0, 0.3)
        assert fired
        assert zo.cosine(out, X0) == pytest.approx(0.3, abs=1e-6)
        assert float(out.norm()) == pytest.approx(float(X.norm()), rel=1e-6)
    same, fired = zo.project_cosine(X0 * 2, X0, 0.3)
    assert not fired and torch.equal(same, X0 * 2)


def test_gate_returns_x0(setup):
    hf, p = setup
    r = Calibrator(hf, BASE.replace(tau=0.99)).run(p)
    assert r.gated and r.stop_reason == "gate" and r.steps == 1
    assert r.best_proxy == r.initial_proxy < 0.99
    assert torch.equal(r.embeddings, hf.embed(p))


def test_patience_stops(setup):
    hf, p = setup
    # eta=0: X never changes, f0 never improves after step 0
    r = Calibrator(hf, BASE.replace(eta=0.0, patience=2, max_steps=50)).run(p)
    assert r.stop_reason == "patience" and r.steps == 3 and r.best_step == 0


def test_gradient_estimators_match_hand_formula():
    torch.manual_seed(0)
    U = torch.randn(3, 4, 5)
    f = torch.tensor([0.5, 0.6, 0.4, 0.55])
    g = zo.estimate_gradient(f, U, 0.1, "forward")
    ref = sum((f[1 + i] - f[0]) / 0.1 * U[i] for i in range(3)) / 3
    torch.testing.assert_close(g, ref)
    fc = torch.tensor([0.5, 0.6, 0.4, 0.7, 0.3, 0.52, 0.5])
    gc = zo.estimate_gradient(fc, U, 0.1, "central")
    refc = sum((fc[1 + 2 * i] - fc[2 + 2 * i]) / 0.2 * U[i] for i in range(3)) / 3
    torch.testing.assert_close(gc, refc)
    X = torch.randn(6, 5)
    batch = zo.perturb(X, U, StepSpec(L=6, d=5, a=1, b=5, N=3, mu=0.1, eta=0.0, kappa=0.0, estimator="central"))
    assert batch.shape == (7, 5, 5)
    torch.testing.assert_close(batch[1, 1:5], X[1:5] + 0.1 * U[0])
    torch.testing.assert_close(batch[2, 1:5], X[1:5] - 0.1 * U[0])
    assert torch.equal(batch[:, 0], X[0].expand(7, -1))


def test_clip_and_normalize_rows():
    g = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    torch.testing.assert_close(zo.clip_rows(g), torch.tensor([[0.6, 0.8], [0.3, 0.4]]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(zo.normalize_rows(g), torch.tensor([[0.6, 0.8], [0.6, 0.8]]), rtol=1e-6, atol=1e-7)


def test_central_normalize_and_snr_options_run(setup):
    hf, p = setup
    r = Calibrator(hf, BASE.replace(estimator="central", grad_mode="normalize", max_steps=3)).run(p)
    assert r.steps == 3 and r.best_proxy >= r.initial_proxy
    r = Calibrator(hf, BASE.replace(snr_threshold=1e9, patience=2, max_steps=20)).run(p)
    assert r.stop_reason == "snr" and r.steps == 2  # every estimate is "noise": no update, stop after 2 in a row


def test_directions_are_counter_based_and_standard_normal():
    U = directions(7, 2, 4, 50, 30)
    assert torch.equal(U, directions(7, 2, 4, 50, 30))
    assert not torch.equal(U, directions(7, 3, 4, 50, 30))
    # direction i does not depend on how many directions were drawn
    assert torch.equal(U[:2], directions(7, 2, 2, 50, 30))
    big = directions(1, 0, 1, 1000, 200).flatten()
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1) < 0.01


def test_config_validation_and_presets(tiny_llama):
    with pytest.raises(SiclError, match="mu must be > 0"):
        CalibrationConfig(mu=0)
    with pytest.raises(SiclError, match="estimator"):
        CalibrationConfig(estimator="backward")
    with pytest.raises(SiclError, match="seed"):
        CalibrationConfig(seed=-1)
    with pytest.raises(SiclError, match="finite"):
        CalibrationConfig(eta=math.nan)
    assert preset_name("qwen3") == "qwen3" and preset_name("gemma2") == "gemma2" and preset_name("mpt") == "llama"
    cfg = CalibrationConfig.for_model(tiny_llama, max_steps=3, mu=None)
    assert cfg.N == 8 and cfg.max_steps == 3 and cfg.mu == 0.004  # small model: N = 8; None keeps the preset


def test_scale_defaults_to_embedding_scale(setup):
    hf, _ = setup
    cal = Calibrator(hf, CalibrationConfig())
    s = hf.lm.embedding_scale
    assert cal.config.scale == pytest.approx(s) and cal.config.mu_eff == pytest.approx(0.004 * s)


def test_nan_initial_embeddings_are_rejected(setup):
    hf, p = setup
    X0 = hf.embed(p)
    X0[9, 0] = float("nan")
    with pytest.raises(NumericalError, match=r"row 9"):
        Calibrator(hf, BASE).run(p, X0=X0)


def test_perturb_query_ablation_moves_query_rows(setup):
    hf, p = setup
    X0 = hf.embed(p)
    r = Calibrator(hf, BASE.replace(kappa=0.0, eta=0.05, grad_mode="normalize", perturb_query=True)).run(p)
    assert r.best_step > 0
    assert torch.equal(r.embeddings[: p.demo_start], X0[: p.demo_start])
    assert not torch.equal(r.embeddings[p.demo_end:], X0[p.demo_end:])  # query rows drift (the gradient there is noise)


# ------------------------------------------------------------------ issue 31: min_delta and the time budget


@pytest.mark.parametrize("name", ["patience", "snr-skips-central", "gate", "max-steps", "nonfinite", "min-delta",
                                  "min-delta-rel", "min-delta-larger-margin", "min-delta-exact-tie",
                                  "min-delta-nonfinite", "min-delta-gate", "min-delta-snr"])
def test_eager_loop_equals_the_step_reference_on_scripts(setup, name, monkeypatch):
    """The eager loop (python floats) and the static step's reference (device tensors,
    sicl_fast.step.step_state) make the same decisions on the same scripted proxies: patience with and
    without min_delta, exact ties with the margin, the gate, SNR skips and stops, a non-finite proxy (tests/test_ops.py
    runs the fused kernel on them)."""
    from test_ops import BOOKKEEP_SCRIPTS

    from sicl_fast.step.step_state import NONFINITE, REASONS, StepState, bookkeep_reference

    hf, p = setup
    kw, f0s = BOOKKEEP_SCRIPTS[name]
    cal = Calibrator(hf, CalibrationConfig(**{"N": 5, "mu": 0.01, "tau": 0.0, "patience": 0, "max_steps": 8,
                                              "scale": 1.0, **kw}))
    X0 = hf.embed(p)
    g = torch.Generator().manual_seed(1)
    script = []  # (f [B], X_next, fired) of each step
    for step, f0 in enumerate(f0s):
        f = f0 + 0.01 * torch.randn(cal.config.batch, generator=g)
        f[0] = f0
        script.append((f, torch.randn(X0.shape, generator=g), torch.tensor([step % 2], dtype=torch.int32)))
    monkeypatch.setattr(cal, "evaluate", lambda X, prompt, spec, step, forward=None: (script[step][0], None))
    monkeypatch.setattr(cal, "move", lambda X, X0, f, g, spec, step: script[step][1:])
    st = StepState.new(X0, cal.config)
    for f, X_next, fired in script:
        st.X_next.copy_(X_next)
        bookkeep_reference(st, f, fired, cal.config)
    n = int(st.steps_run)
    if int(st.reason) == NONFINITE:
        with pytest.raises(NumericalError, match=f"step {n - 1}"):
            cal.run(p)
        return
    res = cal.run(p)
    assert res.history == st.history[:n].tolist() and res.steps == n
    assert (res.best_step, res.stop_reason, res.projections) == (st.best.best_step, REASONS[int(st.reason)],
                                                                 int(st.projections))
    assert torch.equal(res.embeddings, st.best.best_X)


def test_min_delta_stops_earlier_and_keeps_the_best(setup):
    """The run still returns the X with the highest f0; only patience reads the margin. A margin no step can beat
    stops the run after `patience` steps (the best X may come from a later step than step 0)."""
    hf, p = setup
    cfg = BASE.replace(patience=2, max_steps=12, eta=0.05)
    paper = Calibrator(hf, cfg).run(p)
    strict = Calibrator(hf, cfg.replace(min_delta=1.0)).run(p)
    assert paper.stop_reason == "max_steps" and strict.stop_reason == "patience" and strict.steps == 3
    assert strict.history == paper.history[:3] and strict.best_proxy == max(strict.history)
    assert strict.best_step == max(range(3), key=lambda i: (strict.history[i], -i))
    with pytest.raises(SiclError, match=r"CalibrationConfig: min_delta must be >= 0.0, got -0.1"):
        CalibrationConfig(min_delta=-0.1)
    with pytest.raises(SiclError, match=r"CalibrationConfig: min_delta_rel must be a number"):
        CalibrationConfig(min_delta_rel="0.1")


def fake_clock(monkeypatch) -> list:
    """time.perf_counter frozen at clock[0] (the tests move it: one second per step)."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


def test_time_budget_stops_at_the_first_step_after_it(setup, monkeypatch):
    hf, p = setup
    cfg = BASE.replace(max_steps=10)
    clock = fake_clock(monkeypatch)
    tick = lambda step, f: clock.__setitem__(0, clock[0] + 1.0)  # noqa: E731 - each step takes a second
    res = Calibrator(hf, cfg).run(p, on_step=tick, time_budget_s=2.5)
    assert res.stop_reason == "time_budget" and res.steps == 3  # 3 s >= 2.5 s after the third step
    ref = Calibrator(hf, cfg.replace(max_steps=3)).run(p)
    assert res.history == ref.history and res.best_step == ref.best_step
    assert torch.equal(res.embeddings, ref.embeddings)
    assert Calibrator(hf, cfg).run(p, time_budget_s=0).steps == 1  # at least one step runs
    assert Calibrator(hf, cfg.replace(tau=0.99)).run(p, time_budget_s=0).stop_reason == "gate"
    first = Calibrator(hf, cfg).run(p, time_budget_s=0, should_stop=lambda: "deadline")
    assert first.stop_reason == "deadline"  # the caller's hook first
    for bad, msg in ((-1, "must be >= 0.0, got -1"), (math.nan, "must be a number, got nan"),
                     (math.inf, "must be <= 2592000.0"), ("2", "must be a number, got '2'")):
        with pytest.raises(SiclError, match=rf"Calibrator.run: time_budget_s {msg}"):
            Calibrator(hf, cfg).run(p, time_budget_s=bad)
