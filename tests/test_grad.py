"""The exact-gradient ascent (estimator "grad", sicl_fast.calibration.grad) on tiny random-weight models: the gradient
against finite differences in float64, hf against fast-fp32, checkpointing, repeatability, and every refusal."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import synthetic_prompt
from sicl_fast import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.engine import Engine
from sicl_fast.errors import SiclError
from sicl_fast.calibration.grad import proxy_gradient
from sicl_fast.models import from_transformers
from sicl_fast.models.attention import attend_math
from sicl_fast.step import zo

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 16  # a small vocabulary keeps f far from 1/V ~ 0 and its gradient far from 0
SPANS = ((5, 7), (9, 11), (12, 14))  # three output spans; rows [3, 14) move


def _prompt(seed: int = 1):
    return synthetic_prompt(16, SPANS, 3, VOCAB, seed=seed)


@pytest.fixture(scope="module")
def gpt2_f64(smol):
    """A tiny GPT-2 in float64: LayerNorm, attention and head all in float64 (Llama's RMSNorm rounds through
    float32 in transformers, which would set a float32 noise floor under the finite differences)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=64, initializer_range=0.5,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return from_transformers(GPT2LMHeadModel(cfg).double(), smol.tokenizer, name="tiny-gpt2-f64")


def tiny_llama16(tokenizer, layers: int, name: str):
    """A tiny Llama (float32, vocabulary 16), random weights large enough that the proxy moves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, initializer_range=0.5)
    return from_transformers(LlamaForCausalLM(cfg), tokenizer, name=name)


@pytest.fixture(scope="module")
def llama(smol):
    return tiny_llama16(smol.tokenizer, 2, "tiny-llama-v16")


def central_difference(cal, prompt, X, spec, v, h: float) -> float:
    """(f(X + h v) - f(X - h v)) / 2h, v [rows, d] on the perturbed rows [a, b)."""
    Xp, Xm = X.clone(), X.clone()
    Xp[spec.a:spec.b] += h * v
    Xm[spec.a:spec.b] -= h * v
    return float((cal.proxy_of(Xp[None], prompt).f - cal.proxy_of(Xm[None], prompt).f)[0]) / (2 * h)


def _grad(backend, prompt, X, **kw):
    cfg = CalibrationConfig(estimator="grad", scale=1.0, **kw)
    cal = Calibrator(backend, cfg)
    spec = cal.step_spec(prompt, X)
    out, g = proxy_gradient(backend, prompt, X, cfg, spec)
    return cal, spec, out, g


def test_gradient_matches_central_differences_in_float64(gpt2_f64):
    """<g, v> against (f(X + h v) - f(X - h v)) / 2h along 6 random unit directions on rows [a, b), h = 1e-5:
    relative error below 1e-6 (measured: 1e-10 to 2e-9; the central difference's own error is O(h^2) and its
    float64 rounding about 1e-16 |f| / h ~ 1e-12 relative)."""
    be, p = make_backend("hf", gpt2_f64, grad=True), _prompt()
    X = be.embed(p).double()
    cal, spec, out, g = _grad(be, p, X)
    assert g.dtype == torch.float64 and g.shape == (spec.rows, spec.d) and float(g.norm()) > 1e-3
    gen = torch.Generator().manual_seed(0)
    h = 1e-5
    for _ in range(6):
        v = torch.randn(spec.rows, spec.d, generator=gen, dtype=torch.float64)
        v /= v.norm()
        fd = central_difference(cal, p, X, spec, v, h)
        exact = float((g * v).sum())
        assert abs(fd - exact) <= 1e-6 * abs(exact), (fd, exact)
    # and f itself is the forward-only proxy, bit for bit
    assert float(out.f[0]) == float(cal.proxy_of(X[None], p).f[0])


@pytest.mark.parametrize("name", ["hf", "fast-fp32", "fast"])
def test_float32_backends_agree_with_each_other_and_with_differences(llama, name):
    """float32 Llama: every differentiable backend's gradient equals hf's to 2e-5 relative (their forwards agree to
    float32 rounding), and the central differences in float32 agree with <g, v> to 1e-2 relative. h = 3e-3 keeps
    both errors of the difference under it: the float32 noise of f over 2h (measured 0.4 % at h = 3e-3, up to 1.2 %
    at h = 1e-3, which failed on a CPU whose float32 products round in another order) and its O(h^2) error (2 % at
    h = 3e-2, 0.3 % at 1e-2)."""
    p = _prompt()
    ref_be = make_backend("hf", llama, grad=True)
    X = ref_be.embed(p)
    _, _, _, g_ref = _grad(ref_be, p, X)
    be = make_backend(name, llama, grad=True)
    cal, spec, out, g = _grad(be, p, X)
    assert g.dtype == torch.float32
    assert float((g - g_ref).norm()) <= 2e-5 * float(g_ref.norm())
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(spec.rows, spec.d, generator=gen)
    v /= v.norm()
    h = 3e-3
    fd = central_difference(cal, p, X, spec, v, h)
    exact = float((g * v).sum())
    assert abs(fd - exact) <= 1e-2 * abs(exact), (fd, exact)


@pytest.mark.parametrize("name", ["hf", "fast-fp32"])
def test_checkpointing_gives_the_same_gradient(llama, name):
    """Recomputing each layer in the backward changes nothing but memory (same operations, same order)."""
    be, p = make_backend(name, llama, grad=True), _prompt()
    X = be.embed(p)
    g = _grad(be, p, X)[3]
    gc = _grad(be, p, X, checkpoint=True)[3]
    assert torch.allclose(gc, g, rtol=1e-6, atol=1e-9)
    # the hf layers are back in eval mode, without the checkpointing switch
    if name == "hf":
        assert all(not layer.training and not layer.gradient_checkpointing for layer in llama.decoder.layers)


def test_grad_calibration_repeatable_and_backends_agree(llama):
    """A seeded grad calibration is the same bit for bit when run again; hf and fast-fp32 follow the same path
    (histories to 1e-5, embeddings to 1e-4); every step moves every row with a nonzero gradient by eta
    (normalised), and the proxy rises."""
    p = _prompt()
    cfg = CalibrationConfig(estimator="grad", grad_mode="normalize", max_steps=6, patience=0, tau=0.0, eta=0.02,
                            scale=1.0, seed=3)
    runs = {name: Calibrator(make_backend(name, llama, grad=True), cfg).run(p) for name in ("hf", "fast-fp32")}
    again = Calibrator(make_backend("hf", llama, grad=True), cfg).run(p)
    assert again.history == runs["hf"].history and torch.equal(again.embeddings, runs["hf"].embeddings)
    a, b = runs["hf"], runs["fast-fp32"]
    assert a.impl == b.impl == "torch" and a.steps == 6 and a.stop_reason == "max_steps"
    assert max(abs(x - y) for x, y in zip(a.history, b.history)) < 1e-5
    assert torch.allclose(a.embeddings, b.embeddings, atol=1e-4)
    assert a.best_proxy > a.initial_proxy + 1e-3


def test_grad_step_is_the_shared_update(llama):
    """One step of the loop = ops.ascend with the exact gradient = zo.ascend (the rule the ZO update ends in)."""
    be, p = make_backend("fast-fp32", llama, grad=True), _prompt()
    cfg = CalibrationConfig(estimator="grad", max_steps=2, patience=0, tau=0.0, eta=0.05, scale=1.0, kappa=0.9)
    res = Calibrator(be, cfg).run(p)
    X0 = be.embed(p)
    cal, spec, out, g = _grad(be, p, X0, eta=0.05, kappa=0.9)
    X1, fired = zo.ascend(X0, X0, g, spec)
    assert res.history[0] == float(out.f[0])
    f1 = float(cal.proxy_of(X1[None], p).f[0])
    assert res.history[1] == pytest.approx(f1, abs=1e-7)
    assert res.best_step == (1 if f1 > res.history[0] else 0)


def test_attend_math_differentiable_form():
    """While autograd records, attend_math runs out of place: same values as the in-place form (bit for bit), and
    gradients equal to those of a plain softmax attention (soft-capped, masked, grouped heads)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, Hk, hd, cap = 2, 5, 4, 2, 8, 3.0
    q, k, v = (torch.randn(B, T, n, hd, generator=gen, dtype=torch.float64) for n in (H, Hk, Hk))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(T, 1, T, dtype=torch.float32).masked_fill_(~mask.view(T, 1, T), float("-inf"))
    with torch.no_grad():
        o_ref, lse_ref = attend_math(q, k, v, bias, 0.3, cap)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = attend_math(qg, kg, vg, bias, 0.3, cap)
    assert torch.equal(o.detach(), o_ref) and torch.equal(lse.detach(), lse_ref)
    w = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((o * w).sum(), (qg, kg, vg))
    # the plain form
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
    kk, vv = k2.repeat_interleave(H // Hk, dim=2), v2.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bthd,bnhd->bhtn", q2, kk).float() * 0.3
    s = torch.tanh(s / cap) * cap + bias.view(1, 1, T, T)
    o2 = torch.einsum("bhtn,bnhd->bthd", torch.softmax(s, dim=-1), vv.float())
    ref = torch.autograd.grad((o2 * w).sum(), (q2, k2, v2))
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------------------------- refusals


def test_bad_settings_are_refused(llama):
    with pytest.raises(SiclError, match="checkpoint applies to estimator 'grad' only"):
        CalibrationConfig(checkpoint=True)
    with pytest.raises(SiclError, match="snr_threshold.*estimator 'grad' has none"):
        CalibrationConfig(estimator="grad", snr_threshold=1.0)
    with pytest.raises(SiclError, match="checkpoint must be true or false"):
        CalibrationConfig(estimator="grad", checkpoint="yes")
    with pytest.raises(SiclError, match="impl 'cpp' is forward-only"):
        make_backend("fast", llama, impl="cpp", grad=True)
    with pytest.raises(SiclError, match="'naive' backend has no differentiable forward"):
        make_backend("naive", llama, grad=True)


def test_engine_without_differentiable_ops_refuses_grad(llama):
    """An engine built for the zeroth-order ascent on the C++ ops says what to do instead of failing in autograd."""
    pytest.importorskip("sicl_fast.ops._C")
    eng = Engine(llama, backend="fast", impl="cpp")
    with pytest.raises(SiclError, match="impl 'cpp' is forward-only"):
        eng.calibrate(_prompt(), CalibrationConfig(estimator="grad", max_steps=1))


def test_loops_and_packing_refuse_grad(llama):
    p, cfg = _prompt(), CalibrationConfig(estimator="grad", max_steps=2, tau=0.0)
    with pytest.raises(SiclError, match="static and packed steps run the zeroth-order ascent only"):
        Engine(llama, backend="fast", loop="static", grad=True).calibrate(p, cfg)
    with pytest.raises(SiclError, match="estimator 'grad' calibrates one prompt at a time"):
        Engine(llama, backend="fast", pack=2, grad=True).calibrate_many([p, p], cfg)
    # loop 'auto' on the fast backend runs grad on the eager loop
    res = Engine(llama, backend="fast", grad=True).calibrate(p, cfg)
    assert res.steps == 2 and res.impl == "torch"


def test_models_autograd_cannot_use(gpt2_f64, smol):
    """Weights made under inference_mode, and hf checkpointing of layers transformers cannot checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.inference_mode():
        m = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    lm = from_transformers(m, smol.tokenizer, name="inference-made")
    with pytest.raises(SiclError, match="made under torch.inference_mode"):
        make_backend("hf", lm, grad=True)
    be, p = make_backend("hf", gpt2_f64, grad=True), _prompt()
    with pytest.raises(SiclError, match="do not support activation checkpointing"):
        _grad(be, p, be.embed(p).double(), checkpoint=True)


def test_cli_refuses_before_loading(tmp_path, capsys):
    from sicl_fast.commands.cli import main

    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "a", "demos": [{"input": "one", "output": "1"}], "query": "two"}) + "\n")
    out = str(tmp_path / "o.jsonl")
    assert main(["calibrate", str(reqs), "--out", out, "--checkpoint", "--model", "no-such-model"]) == 2
    assert "checkpoint applies to estimator 'grad' only" in capsys.readouterr().err
    assert main(["calibrate", str(reqs), "--out", out, "--estimator", "grad", "--snr-threshold", "1"]) == 2
    assert "estimator 'grad' has none" in capsys.readouterr().err
    assert main(["calibrate", str(reqs), "--out", out, "--estimator", "grad", "--impl", "cpp",
                 "--model", "no-such-model"]) == 2
    assert "impl 'cpp' is forward-only" in capsys.readouterr().err


def test_memory_check_names_the_gradient(monkeypatch, llama):
    """A grad step too big for memory is refused before any work, with what to do (checkpoint, then a shorter
    prompt); the estimate counts every layer's activations without checkpoint, one layer's with it."""
    import sicl_fast.run.checks as checks

    p = _prompt()
    full = checks.step_memory(llama, p, CalibrationConfig(estimator="grad"))
    one = checks.step_memory(llama, p, CalibrationConfig(estimator="grad", checkpoint=True))
    assert full > one > 0
    monkeypatch.setattr(checks, "available_memory", lambda device: one)
    be = make_backend("hf", llama, grad=True)
    with pytest.raises(SiclError, match=r"the exact gradient of 14 tokens.*use checkpoint \(--checkpoint\)"):
        Calibrator(be, CalibrationConfig(estimator="grad")).run(p)
    assert Calibrator(be, CalibrationConfig(estimator="grad", checkpoint=True, max_steps=1)).run(p).steps == 1


@pytest.mark.filterwarnings("ignore::sicl_fast.icleval.ICLEvalDataWarning")  # excerpts: not the release sha256
def test_icleval_sicl_grad_method(tiny_llama, tmp_path):
    """run_methods with base, sicl and sicl-grad on an ICLEval excerpt: the sicl-grad record carries its config
    (estimator grad, rows normalised, the sicl settings otherwise), and the report's proxy gain per second and
    answers changed follow from the records."""
    from conftest import ICLEVAL_EXCERPTS
    from sicl_fast.evaluation.methods import run_methods
    from sicl_fast.evaluation.report import proxy_analysis

    eng = Engine(tiny_llama, add_special_tokens=True, grad=True)
    cfg = eng.config(max_steps=2, N=2, tau=0.0)
    recs = run_methods(eng, ICLEVAL_EXCERPTS, tmp_path / "r.jsonl", methods=["base", "sicl", "sicl-grad"], config=cfg,
                       tasks=["classifier_order"], limit=1, progress=False)
    by = {r["method"]: r for r in recs}
    assert set(by) == {"base", "sicl", "sicl-grad"}
    g = by["sicl-grad"]
    assert g["method"] == "sicl-grad" and g["config"]["estimator"] == "grad"
    assert g["config"]["grad_mode"] == "normalize" and g["config"]["eta"] == cfg.eta and g["steps"] == 2
    assert by["sicl"]["config"]["estimator"] == "forward"
    assert g["initial_proxy"] == pytest.approx(by["sicl"]["initial_proxy"], rel=1e-5)  # the same f(X0)
    row = proxy_analysis([g])["tasks"][0]
    assert row["proxy_gain_per_minute"] == pytest.approx(60 * (g["best_proxy"] - g["initial_proxy"]) / g["seconds"])
    assert row["answers_changed"] == int(g["answer_calibrated"] != g["answer_base"])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3_text"])
def test_fast_gradient_matches_hf_on_every_family(family):
    """The fast decoder's backward (soft-capped math attention on Gemma 2, sliding windows on Gemma 2 / 3, q / k
    norms on Qwen3 / Gemma 3, llama3 rope) against transformers' own, on the random-weight models of the fast
    backend's tests, with a demonstration-free prefix: relative difference below 1e-4 (float32 forwards agree to
    1e-4 there)."""
    from test_fast_backend import build, make_prompt

    lm = build(family)
    p = make_prompt(a=5)
    hf = make_backend("hf", lm, grad=True)
    X = hf.embed(p)
    g_hf = _grad(hf, p, X)[3]
    g_fast = _grad(make_backend("fast", lm, grad=True), p, X)[3]
    assert float(g_hf.norm()) > 0
    assert float((g_fast - g_hf).norm()) <= 1e-4 * float(g_hf.norm())
