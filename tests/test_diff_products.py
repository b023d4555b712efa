"""The difference form of a perturbation batch (sicl_fast.models.rows, Transformer.forward_rows): float32
activations, every projection one bf16 product of values and differences, the span head on the same form; the
stacked weights it multiplies (sicl_fast.models.weights).

Tolerances, and why (each row op of each implementation against its reference: tests/test_rows_ops.py):
  A whole forward, tiny random models: row 0 (a bf16 product of bf16-rounded values at every projection) within
      0.05 of the float32 log-probs; the rows' log-prob differences from row 0 within 3 % of their norm (bf16 rounds
      each layer's difference term by 2^-9; measured 1-2 % here).
  SmolLM2 against float64: the finite differences f_i - f_0 of the proxy within 5 % of float64's, f_0 within 1 %;
      the all-float32 path within 0.1 %.
"""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import reference_backend
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.errors import SiclError, SiclWarning
from sicl_fast.models.rows import RowLayout, from_rows, to_rows
from sicl_fast.models.transformer import fast_low_precision
from sicl_fast.models.weights import LowWeight, fp8_rows
from sicl_fast.ops import TorchStepOps
from sicl_fast.step.proxy import proxy as ref_proxy
from sicl_fast.step.spec import StepSpec

from test_fast_backend import SUPPORTED_FAMILIES, build, make_prompt, perturbed
from test_ops import why_unavailable


def test_the_form_keeps_a_change_of_one_bf16_ulp():
    """Rows that differ from their anchor by less than a bf16 ulp come back with that difference (to 2^-8 of it),
    where rounding the rows themselves to bf16 loses it."""
    rows = RowLayout.build(2, 4, 5, 2, [0, 0, 2, 2])
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(rows.R, 32, generator=g)
    xb = rows.batch(x)
    for j, a in enumerate(rows.anchors):
        if a != j:
            xb[j] = xb[a] + 1e-3 * torch.randn(5, 32, generator=g)  # below a bf16 ulp of 3 (2^-6)
    back = from_rows(to_rows(x, rows), rows)
    change, kept = rows.batch(x)[1] - rows.batch(x)[0], rows.batch(back)[1] - rows.batch(back)[0]
    assert float((kept - change).abs().max()) <= 2 ** -8 * float(change.abs().max()) + 1e-9
    plain = x.bfloat16().float()
    assert float(((rows.batch(plain)[1] - rows.batch(plain)[0]) - change).abs().max()) > 0.5 * float(
        change.abs().max())
    assert torch.equal(back[:2], x[:2].bfloat16().float())  # lead rows: values


@pytest.mark.parametrize("R,k,o", [(3, 37, 21), (8, 96, 160)])
def test_low_weight_made_once_same_bits(R, k, o):
    """A float32 weight's bf16 copy is made once, and kept only in oneDNN's packed layout where the CPU has its bf16
    kernels: the packed product gives F.linear's bits (the same kernel without the per-call reorder), for odd shapes
    and strides. A bf16 weight (a bf16 model's own) is used as it is: never copied, never packed (held once)."""
    g = torch.Generator().manual_seed(R)
    w = torch.randn(o, k, generator=g)
    low = LowWeight(w)
    packs = fast_low_precision(torch.device("cpu")) and torch.backends.mkldnn.is_available()
    if packs:  # the machines the difference form is for
        assert low.packed is not None and low.w is None
    else:
        assert low.packed is None and torch.equal(low.w, w.bfloat16())
    own = w.bfloat16()
    assert LowWeight(own).w is own and LowWeight(own).packed is None
    assert LowWeight(w, pack=False).w is not None and LowWeight(w, pack=False).packed is None
    dx = torch.randn(R, k + 5, generator=g).bfloat16()[..., 5:]  # not contiguous
    for x in (dx, dx.contiguous(), dx[:0]):
        got = low.linear(x)
        assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], o)
        assert torch.equal(got, F.linear(x, w.bfloat16()))


def test_fp8_rows_round_trip():
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 7)[:, None]
    q, scale = fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 1)
    back = q.float() * scale
    big = x.abs() > scale * 2 ** -6  # e4m3's normal range: 3 mantissa bits, half an ulp = 2^-4 relative
    assert bool(((back - x).abs() <= 2 ** -4 * x.abs() + 1e-12)[big].all())
    assert bool(((back - x).abs() <= scale * 2 ** -9)[~big].all())  # subnormals: absolute, 2^-9 of the scale
    assert torch.equal(fp8_rows(torch.zeros(2, 5))[0].float(), torch.zeros(2, 5))


@pytest.mark.parametrize("anchors", [None, [0, 0, 0, 3, 3]])  # one prompt (value rows first), two packed
def test_fp8_differences_take_one_product_of_each_kind(anchors):
    """FP8 differences: the value rows through one bf16 product, the difference rows through one FP8 product, no row
    multiplied twice; each kind's rows equal the product of those rows alone (the value rows as the bf16 product of
    every row gives them). The _scaled_mm branch (what CUDA sm_89+ runs; torch's CPU has the op too) writes the same
    rows within bf16's rounding of the emulated product's."""
    from sicl_fast.models.projections import _product
    from sicl_fast.ops.torch_ops import TorchDecoderOps

    g = torch.Generator().manual_seed(0)
    rows = RowLayout.build(3, 5, 4, 3, anchors)
    x = torch.randn(rows.R, 48, generator=g).bfloat16()
    low = LowWeight(torch.randn(40, 48, generator=g), fp8=True)
    calls = []
    linear, linear_fp8 = low.linear, low.linear_fp8
    low.linear = lambda a, out=None: calls.append(("bf16", a.shape[0])) or linear(a, out=out)
    low.linear_fp8 = lambda q, s, out=None: calls.append(("fp8", q.shape[0])) or linear_fp8(q, s, out=out)
    y = _product(low, x, rows, TorchDecoderOps())
    value, diff = rows.value_rows, rows.difference_rows
    assert calls == [("bf16", rows.values), ("fp8", rows.R - rows.values)] and value.numel() == rows.values
    assert (rows.value_end is None) == (anchors is not None)
    assert torch.equal(y[value], linear(x)[value])  # the value rows: the bf16 product's own
    assert torch.equal(y[diff], linear_fp8(*fp8_rows(x[diff])))
    low.scaled_mm = True
    y_mm = _product(low, x, rows, TorchDecoderOps())
    assert torch.equal(y_mm[value], y[value])
    torch.testing.assert_close(y_mm[diff].float(), y[diff].float(), rtol=2 ** -7, atol=1e-6)


def test_stacked_weights_are_held_once(models):
    """q | k | v and gate | up are one tensor each, and the transformers modules' parameters are views of it (no
    copy of the model's weights); a second backend on the same model finds them stacked and reuses them."""
    lm = models["qwen3"]
    before = sum(p.numel() for p in lm.model.parameters())
    w = reference_backend("fast", lm).model.layers[0].w
    attn, mlp = lm.decoder.layers[0].self_attn, lm.decoder.layers[0].mlp
    for mod, off in ((attn.q_proj, 0), (attn.k_proj, w.q_rows), (attn.v_proj, w.q_rows + w.kv_rows)):
        assert mod.weight.data_ptr() == w.qkv[off:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w.gate_up[w.inter:].data_ptr()
    again = reference_backend("fast", lm).model.layers[0].w
    assert again.qkv.data_ptr() == w.qkv.data_ptr() and again.gate_up.data_ptr() == w.gate_up.data_ptr()
    assert sum(p.numel() for p in lm.model.parameters()) == before
    stored = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    assert len(stored) < len(list(lm.model.parameters()))  # shared storages: held once


@pytest.mark.parametrize("fmt,bound", [("bf16", 0.03), ("fp8", 0.3)])
def test_forward_with_fp8_or_bf16_differences_tracks_float32(models, fmt, bound):
    """Rows' log-prob differences from row 0 against the float32 forward: bf16 within 3 %, FP8 (emulated) within
    30 % (e4m3 keeps 3 mantissa bits; the measured figures are in bench/RESULTS.md)."""
    lm = models["llama"]
    exact, low = reference_backend("fast", lm, diff_matmul="off"), reference_backend("fast", lm, diff_matmul=fmt)
    p = make_prompt(6)
    X = perturbed(exact.embed(p), 6, B=7, scale=0.02)
    ref, got = exact.span_logprobs(X, p), low.span_logprobs(X, p, near_row0=True)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0.05)  # row 0: a bf16 product
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
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0.05)
        d_ref, d_got = ref[1:] - ref[:1], got[1:] - got[:1]
        rel = float((d_got - d_ref).norm() / d_ref.norm())
        assert 0 < rel < 0.03, rel
        # without the promise the fast backend takes the plain float32 products (bit for bit those of its impl)
        torch.testing.assert_close(fast.span_logprobs(X, p), plain.span_logprobs(X, p), rtol=0, atol=0)
    assert fast.model._rows_dense is not None and exact.model._rows_dense is None


def test_single_rows_and_generation_never_use_bf16(models):
    lm = models["llama"]
    fast, exact = reference_backend("fast", lm, diff_matmul="bf16"), reference_backend("fast", lm, diff_matmul="off")
    p = make_prompt(6)
    X = fast.embed(p)
    torch.testing.assert_close(fast.span_logprobs(X[None], p, near_row0=True), exact.span_logprobs(X[None], p),
                               rtol=0, atol=0)
    assert fast.generate(X, p, 6).token_ids == exact.generate(X, p, 6).token_ids
    assert fast.model._rows_dense is None  # the bf16 weights were never made


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_seeded_calibration_in_difference_form_tracks_float32(models, family):
    """The ascent's moves (X after each update: they read only the rows' differences) follow the float32 path's: the
    first to 5 % of the distance moved, the later ones to 15 % (the gradients of these random models are nearly
    noise, so small differences in one step's estimate change the next steps'; measured 1-2.5 %, then up to 11 %).
    The best X may come from another step: here a step changes f_0 by about 1e-6, below the rounding of a bf16 row
    0 (the precision study measures real prompts)."""
    lm = models[family]
    cfg = CalibrationConfig(N=4, max_steps=4, tau=0, scale=1.0, seed=1)
    p = make_prompt(6)
    moves = {}
    for diff in ("off", "bf16"):
        seen = moves[diff] = []
        Calibrator(reference_backend("fast", lm, diff_matmul=diff), cfg).run(p, on_update=lambda X: seen.append(
            X.clone()))
    X0 = reference_backend("fast", lm).embed(p)
    assert len(moves["off"]) == len(moves["bf16"]) == 3
    for i, (ref, got) in enumerate(zip(moves["off"], moves["bf16"])):
        assert float((got - ref).norm()) < (0.05 if i == 0 else 0.15) * float((ref - X0).norm())


def test_bf16_model_in_difference_form_tracks_float32(models):
    """A bf16 model's perturbation batch in difference form keeps its rows' differences (a plain bf16 forward
    rounds them away): against the float32 model's, within what the rounding of its weights allows."""
    lm32, lm16 = models["llama"], build("llama", torch.bfloat16)
    exact = reference_backend("fast", lm32, diff_matmul="off")
    p = make_prompt(6)
    X = perturbed(exact.embed(p), 6, B=7, scale=0.02)
    ref = exact.span_logprobs(X, p)
    d_ref = ref[1:] - ref[:1]
    errs = {}
    for diff in ("bf16", "off"):
        with pytest.warns(SiclWarning, match="plain bfloat16") if diff == "off" else contextlib.nullcontext():
            got = reference_backend("fast", lm16, diff_matmul=diff).span_logprobs(X, p, near_row0=True)
        errs[diff] = float(((got[1:] - got[:1]) - d_ref).norm() / d_ref.norm())
    assert errs["bf16"] < 0.1 and errs["off"] > 3 * errs["bf16"], errs


def test_settings_and_errors(models):
    lm = models["qwen3"]
    auto = reference_backend("fast", lm)
    assert auto.model.rows_on == fast_low_precision(lm.device)
    assert not reference_backend("fast", lm, diff_matmul="off").model.rows_on
    assert not make_backend("fast-fp32", lm).model.rows_on and make_backend("fast-fp32", lm).name == "fast-fp32"
    assert make_backend("fast", lm, diff_matmul="bf16").model.rows_on
    with pytest.raises(SiclError, match="diff_matmul"):
        reference_backend("fast", lm, diff_matmul="int4")
    assert reference_backend("fast", build("llama", torch.bfloat16)).model.rows_on  # auto: below float32, always
    # other backends accept the promise and ignore it
    p = make_prompt(0)
    hf = reference_backend("hf", lm)
    X = perturbed(hf.embed(p), 0)
    assert torch.equal(hf.span_logprobs(X, p, near_row0=True), hf.span_logprobs(X, p))


def test_smollm2_finite_differences_against_float64(smol):
    """The ascent only uses f_i - f_0: both paths' differences against a float64 forward of the same batch."""
    from sicl_fast.diagnostics.benchmark import synthetic_prompt

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
    for name, backend, kw, rel in (("fp32", exact, {}, 1e-5),
                                   ("bf16", reference_backend("fast", smol, diff_matmul="bf16"),
                                    {"near_row0": True}, 1e-2)):
        got = f(backend, batch, **kw)
        assert math.isclose(got[0], f64[0], rel_tol=rel), (name, float(got[0]), float(f64[0]))
        errs[name] = float(((got[1:] - got[0]) - d64).norm() / d64.norm())
    assert errs["fp32"] < 1e-3 and errs["bf16"] < 0.05, errs


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux's /proc/self/maps and madvise")
def test_stacked_away_pages_of_a_mapped_checkpoint_are_given_back(tmp_path):
    """The weights held once on a mapped checkpoint (transformers maps safetensors files): the resident pages of the
    weights stack_params copied away are given back; anonymous memory (the allocator's) is never touched."""
    from sicl_fast.models.weights import release_file_pages

    path = tmp_path / "weights.bin"
    path.write_bytes(torch.arange(1 << 20, dtype=torch.float32).numpy().tobytes())  # 4 MiB
    mapped = torch.from_file(str(path), shared=False, size=1 << 20, dtype=torch.float32)
    assert float(mapped.sum()) > 0  # resident now
    assert release_file_pages([mapped[1000:200_000]]) > 0
    assert release_file_pages([torch.ones(1 << 20)]) == 0
