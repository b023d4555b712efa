"""Difference products (sicl_fast.models.diff): row 0 in float32, the other rows' differences in bf16.

Tolerances, and why (the epilogues of each implementation against the reference: tests/test_ops.py):
  A whole forward, tiny random models: row 0 to 1e-5 (float32 path, only the C++ activation's ulps differ);
      rows' log-prob differences from row 0 to 3 % of their norm (bf16 rounds each layer's difference term
      by 2^-9; measured 0.2-1 % here).
  SmolLM2 against float64: finite differences f_i - f_0 of the proxy within 5 % of float64's (measured 0.8 %
      at L = 128 in bench/RESULTS.md); the all-float32 path within 0.1 % (measured 0.008 %).
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import reference_backend
from sicl_fast.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.errors import SiclError
from sicl_fast.models import diff
from sicl_fast.models.transformer import fast_low_precision
from sicl_fast.ops import TorchDecoderOps, TorchStepOps
from sicl_fast.proxy import proxy as ref_proxy
from sicl_fast.spec import StepSpec

from test_fast_backend import SUPPORTED_FAMILIES, build, make_prompt, perturbed
from test_ops import why_unavailable

GELU_TANH = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731


def near(B, T, k, scale=1e-2, seed=0):
    """[B, T, k] float32 rows: row 0 plus small differences (a perturbation batch's shape)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, T, k, generator=g)
    return torch.cat([x0, x0 + scale * torch.randn(B - 1, T, k, generator=g)])


@pytest.mark.parametrize("bias", [False, True])
def test_difference_product_equals_plain_product_up_to_bf16_on_the_difference(bias):
    x = near(6, 11, 96, scale=1e-2, seed=3)
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(40, 96, generator=g) * 0.1, torch.randn(24, 96, generator=g) * 0.1]
    bs = [torch.randn(40, generator=g), torch.randn(24, generator=g)] if bias else [None, None]
    y = diff.linear(TorchDecoderOps(), x, ws, bs, diff.Bf16Weight(torch.cat(ws)))
    ref = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)
    # row 0 is a float32 product (of one row: the BLAS blocking, hence the last bits, may differ from the batch's)
    torch.testing.assert_close(y[0], ref[0], rtol=1e-6, atol=1e-6)
    change = (ref[1:] - ref[:1]).abs().max()
    assert float((y[1:] - ref[1:]).abs().max()) < 0.02 * float(change)
    assert float((y[1:] - ref[1:]).abs().max()) > 0  # the bf16 path really ran


@pytest.mark.parametrize("R,T,k,o", [(3, 7, 37, 21), (8, 33, 96, 160)])
def test_bf16_weight_packed_once_same_bits(R, T, k, o):
    """The bf16 weight is cast once; where oneDNN packs it, the packed product gives F.linear's bits (the same
    kernel without the per-call reorder), for odd shapes and row-strided differences."""
    g = torch.Generator().manual_seed(R)
    w = torch.randn(o, k, generator=g)
    low = diff.Bf16Weight(w)
    assert low.w.dtype == torch.bfloat16 and torch.equal(low.w, w.bfloat16())
    if fast_low_precision(torch.device("cpu")) and torch.backends.mkldnn.is_available():
        assert low.packed is not None  # the machines the difference products are for
    dx = torch.randn(R, T, k + 5, generator=g).bfloat16()[..., 5:]  # not contiguous
    for x in (dx, dx.contiguous(), dx[:0]):
        got = low.linear(x)
        assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], o)
        assert torch.equal(got, F.linear(x, low.w))


def test_fp8_rows_round_trip():
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 7)[:, None]
    q, scale = diff.fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 1)
    back = q.float() * scale
    big = x.abs() > scale * 2 ** -6  # e4m3's normal range: 3 mantissa bits, half an ulp = 2^-4 relative
    assert bool(((back - x).abs() <= 2 ** -4 * x.abs() + 1e-12)[big].all())
    assert bool(((back - x).abs() <= scale * 2 ** -9)[~big].all())  # subnormals: absolute, 2^-9 of the scale
    assert torch.equal(diff.fp8_rows(torch.zeros(2, 5))[0].float(), torch.zeros(2, 5))


@pytest.mark.parametrize("fmt,bound", [("bf16", 0.03), ("fp8", 0.3)])
def test_forward_with_fp8_or_bf16_differences_tracks_float32(models, fmt, bound):
    """Rows' log-prob differences from row 0 against the float32 forward: bf16 within 3 %, FP8 (emulated) within
    30 % (e4m3 keeps 3 mantissa bits; the measured figures are in bench/RESULTS.md)."""
    lm = models["llama"]
    exact, low = reference_backend("fast", lm, diff_matmul="off"), reference_backend("fast", lm, diff_matmul=fmt)
    p = make_prompt(6)
    X = perturbed(exact.embed(p), 6, B=7, scale=0.02)
    ref, got = exact.span_logprobs(X, p), low.span_logprobs(X, p, near_row0=True)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # row 0 stays float32
    d_ref, d_got = ref[1:] - ref[:1], got[1:] - got[:1]
    rel = float((d_got - d_ref).norm() / d_ref.norm())
    assert 0 < rel < bound, rel


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_forward_with_difference_products_tracks_float32(models, family, impl):
    reason = why_unavailable(impl)
    if reason:
        pytest.skip(reason)
    lm = models[family]
    exact = reference_backend("fast", lm, diff_matmul="off")
    fast = make_backend("fast", lm, diff_matmul="bf16", impl=impl)
    plain = make_backend("fast", lm, diff_matmul="off", impl=impl)  # the same elementwise ops, float32 products
    for a in (0, 6):  # without and with a shared prefix
        p = make_prompt(a, seed=a)
        X = perturbed(exact.embed(p), a, B=7, scale=0.02, seed=a)
        ref = exact.span_logprobs(X, p)
        got = fast.span_logprobs(X, p, near_row0=True)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        d_ref, d_got = ref[1:] - ref[:1], got[1:] - got[:1]
        rel = float((d_got - d_ref).norm() / d_ref.norm())
        assert 0 < rel < 0.03, rel
        # without the promise the fast backend takes the float32 products (bit for bit those of its impl; the C++
        # norms sum in another order than the reference's)
        torch.testing.assert_close(fast.span_logprobs(X, p), plain.span_logprobs(X, p), rtol=0, atol=0)
    assert fast.model._diff is not None and exact.model._diff is None


def test_single_rows_and_generation_never_use_bf16(models):
    lm = models["llama"]
    fast, exact = reference_backend("fast", lm, diff_matmul="bf16"), reference_backend("fast", lm, diff_matmul="off")
    p = make_prompt(6)
    X = fast.embed(p)
    torch.testing.assert_close(fast.span_logprobs(X[None], p, near_row0=True), exact.span_logprobs(X[None], p),
                               rtol=0, atol=0)
    assert fast.generate(X, p, 6).token_ids == exact.generate(X, p, 6).token_ids
    assert fast.model._diff is None  # the bf16 weights were never made


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_seeded_calibration_with_difference_products_tracks_float32(models, family):
    lm = models[family]
    cfg = CalibrationConfig(N=4, max_steps=3, tau=0, scale=1.0, seed=1)
    p = make_prompt(6)
    ref = Calibrator(reference_backend("fast", lm, diff_matmul="off"), cfg).run(p)
    got = Calibrator(reference_backend("fast", lm, diff_matmul="bf16"), cfg).run(p)
    assert got.history[0] == pytest.approx(ref.history[0], rel=1e-5, abs=1e-6)
    assert got.history == pytest.approx(ref.history, rel=1e-3, abs=1e-4)
    moved = (ref.embeddings - reference_backend("fast", lm).embed(p)).norm()
    assert float((got.embeddings - ref.embeddings).norm()) < 0.05 * float(moved)


def test_settings_and_errors(models):
    lm = models["qwen3"]
    auto = reference_backend("fast", lm)
    assert (auto.model.diff_dtype is not None) == fast_low_precision(lm.device)
    assert reference_backend("fast", lm, diff_matmul="off").model.diff_dtype is None
    assert make_backend("fast-fp32", lm).model.diff_dtype is None and make_backend("fast-fp32", lm).name == "fast-fp32"
    assert make_backend("fast", lm, diff_matmul="bf16").model.diff_dtype == torch.bfloat16
    with pytest.raises(SiclError, match="diff_matmul"):
        reference_backend("fast", lm, diff_matmul="int4")
    lm16 = build("llama", torch.bfloat16)
    with pytest.raises(SiclError, match="float32 models"):
        reference_backend("fast", lm16, diff_matmul="bf16")
    assert reference_backend("fast", lm16).model.diff_dtype is None  # auto: nothing to gain below float32
    # other backends accept the promise and ignore it
    p = make_prompt(0)
    hf = reference_backend("hf", lm)
    X = perturbed(hf.embed(p), 0)
    assert torch.equal(hf.span_logprobs(X, p, near_row0=True), hf.span_logprobs(X, p))


def test_smollm2_finite_differences_against_float64(smol):
    """The ascent only uses f_i - f_0: both paths' differences against a float64 forward of the same batch."""
    from sicl_fast.benchmark import synthetic_prompt

    p = synthetic_prompt(smol, 64)
    cfg = CalibrationConfig.for_model(smol, N=6)
    exact = reference_backend("fast", smol, diff_matmul="off")
    X0 = exact.embed(p)
    batch = TorchStepOps().perturb(X0, 0, StepSpec.build(cfg, *X0.shape, p.demo_start, p.demo_end))

    def f(backend, x, **kw):
        return ref_proxy(backend.span_logprobs(x, p, **kw), p.offsets, 0.6, 0.3, 0.1, 0.1).f.double()

    lm64 = copy.copy(smol)
    lm64.model = copy.deepcopy(smol.model).double()
    f64 = f(reference_backend("hf", lm64), batch.double())
    d64 = f64[1:] - f64[0]
    errs = {}
    for name, backend, kw in (("fp32", exact, {}), ("bf16", reference_backend("fast", smol, diff_matmul="bf16"),
                                                   {"near_row0": True})):
        got = f(backend, batch, **kw)
        assert math.isclose(got[0], f64[0], rel_tol=1e-5)
        errs[name] = float(((got[1:] - got[0]) - d64).norm() / d64.norm())
    assert errs["fp32"] < 1e-3 and errs["bf16"] < 0.05, errs
