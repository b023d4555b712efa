"""The fused decoder (impl 'triton', under Triton's interpreter on the CPU) against the reference ops (impl 'torch') on
the tiny models of all four families and on SmolLM2 (its first two layers), and its launch budget. Two forwards:

  plain             (diff_matmul 'off', fast-fp32): kernels/rms_norm, rope, gated, softcap, attention.prefix_attention
  difference form   (diff_matmul 'bf16', sicl_fast.models.rows): kernels/norm_rows, rope_rows, gated_rows,
                    attention.attention_rows, span_logprobs.span_logprobs_rows; the products are the same bf16 ones
                    on both sides

Tolerances. Plain float32: the proxy f of every batch row to rtol 1e-5 (the issue's bar), the span log-probs to 1e-4
absolute. Difference form: the value rows go into the bf16 products as their change from the float32 reference
(made from the same X at the step forward's start: changes of float32 rounding size), so row 0 carries no bf16
rounding and the two implementations' row 0 agree to float32 sums in another order: its log-probs within
1e-4 + 1e-5 |lp| (measured: <= 1.4e-6 on the tiny models, 9.5e-6 at SmolLM2's -28) and f_0 within 1e-4 relative
(measured: <= 5.8e-7; SmolLM2's f, near exp(-26): 5.9e-6). The difference rows' changes are rounded to bf16 (relative
to the change), so a float32 change that differs in its last bit now and then rounds the other way and the models
amplify the flip: each row's change from row 0 (what the ascent reads) within 2 % (log-probs) and 3 % (f) of the
largest change (measured: <= 0.63 % and 1.1 % on the float32 tiny models, <= 0.62 % and 0.39 % on the bf16 ones,
0.28 % and 0.04 % on SmolLM2).
"""
import dataclasses

import pytest
import torch

from conftest import first_layers
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.kernel_count import count_kernels
from sicl_fast.diagnostics.profile import kernels_per_step, layers_call
from sicl_fast.calibration.static import StaticStep
from test_fast_backend import SUPPORTED_FAMILIES, build, make_prompt
from test_ops import device_of, why_unavailable
from test_static import HostReadGuard

CFG = CalibrationConfig(N=3, mu=0.05, eta=0.5, max_steps=4, tau=0.0, scale=1.0, projection_scope="demos")
BUDGET_PER_LAYER, BUDGET_REST = 14, 40  # plain products
# the difference form: 4 products (cuBLAS), rope_rows, attention_rows, norm_rows x 2, gated_rows
BUDGET_PER_LAYER_ROWS, BUDGET_REST_ROWS = 9, 30
# (family, projection scope, prefix rows a): the prefix as lead rows of every pass ('prompt'); a kept prefix ('demos')
# where a span starts right at row a (its first prediction is the prefix's last row); no prefix. Gemma 3's own
# elementwise work (q / k norms, (1 + w) norms, windows) is Qwen3's and Gemma 2's, both here; its plain parity test
# runs on every family
ROWS_CASES = [("llama", "prompt", 6), ("gemma2", "prompt", 6), ("qwen3", "demos", 14), ("llama", "demos", 0)]


@pytest.fixture(autouse=True)
def need_triton_on_the_cpu():
    if why_unavailable("triton") or device_of("triton") != "cpu":
        pytest.skip(why_unavailable("triton") or "the tiny models live on the CPU")


def step_of(be, prompt, cfg=CFG):
    return StaticStep(be, Calibrator(be, cfg).config, prompt, be.embed(prompt))


def batch_f(be, prompt, cfg=CFG):
    """f [B] and the span log-probs [B, P] of one perturbation batch (the static step's first evaluation)."""
    st = step_of(be, prompt, cfg)
    st.perturb()
    lp = st.forward(st.batch)
    return st.ops.proxy_planned(lp, st.proxy_plan).f, lp


def assert_rows_close(got, ref, lp0_atol=1e-4, f0_rtol=1e-4, dlp_rel=0.02, df_rel=0.03):
    """The difference form's results (f, lp) against the reference's (module docstring)."""
    (f, lp), (f_ref, lp_ref) = got, ref
    assert torch.isfinite(lp).all() and torch.isfinite(f).all()
    torch.testing.assert_close(lp[0], lp_ref[0], rtol=1e-5, atol=lp0_atol)
    torch.testing.assert_close(f[0], f_ref[0], rtol=f0_rtol, atol=0)
    for x, x_ref, rel in ((lp, lp_ref, dlp_rel), (f, f_ref, df_rel)):
        d, d_ref = x - x[0], x_ref - x_ref[0]
        assert float((d - d_ref).abs().max()) <= rel * float(d_ref.abs().max()), (d, d_ref)


# every family with a prefix (the prefix-free path runs in the difference form's cases and the launch budget)
@pytest.mark.parametrize("family,a", [(f, 6) for f in SUPPORTED_FAMILIES])
def test_fused_decoder_equals_unfused_float32(models, family, a):
    lm, p = models[family], make_prompt(a, seed=a + 2)
    fused = make_backend("fast-fp32", lm, impl="triton")
    assert fused.model.attention.impl == "triton" and not fused.model.rows_on
    f, lp = batch_f(fused, p)
    f_ref, lp_ref = batch_f(make_backend("fast-fp32", lm, impl="torch"), p)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family,scope,a", ROWS_CASES)
def test_fused_rows_equal_reference_rows(models, family, scope, a):
    """float32 models, bf16 difference products: every layer's epilogues, the attention and the span head fused."""
    lm, p = models[family], make_prompt(a, seed=a + 2)
    cfg = dataclasses.replace(CFG, projection_scope=scope)
    fused = make_backend("fast", lm, impl="triton", diff_matmul="bf16")
    assert fused.model.rows_on and fused.model.attention.impl == "triton"
    st = step_of(fused, p, cfg)
    assert st.forward.policy == ("none" if a == 0 else "pass" if scope == "prompt" else "kept")
    got = batch_f(fused, p, cfg)
    ref = batch_f(make_backend("fast", lm, impl="torch", diff_matmul="bf16"), p, cfg)
    assert_rows_close(got, ref)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])  # q / k norms; soft-caps, post-norms, (1 + w) norms
def test_fused_rows_equal_reference_rows_bf16(family):
    """bf16 models: the difference form is the plan's default for them (float32 rows, their own bf16 weights)."""
    lm, p = build(family, torch.bfloat16), make_prompt(6, seed=8)
    fused = make_backend("fast", lm, impl="triton")
    assert fused.model.rows_on
    assert_rows_close(batch_f(fused, p), batch_f(make_backend("fast", lm, impl="torch"), p))


@pytest.mark.slow
@pytest.mark.parametrize("diff", ["off", "bf16"])
def test_fused_decoder_equals_unfused_on_smollm2(smol, diff):
    """SmolLM2's first two layers (its real weights and shapes: d 576, 9 query / 3 key-value heads, head 64, vocabulary
    49152), both forwards; the other 28 layers would only repeat the same kernels, for about 7x the time under the
    interpreter."""
    from sicl_fast.diagnostics.benchmark import synthetic_prompt

    lm = first_layers(smol, 2)
    p = synthetic_prompt(lm, 36, seed=1, prefix=6)
    assert p.demo_start > 0  # the prefix path
    cfg = dataclasses.replace(CFG, N=1)  # B = 2
    got = batch_f(make_backend("fast", lm, impl="triton", diff_matmul=diff), p, cfg)
    ref = batch_f(make_backend("fast", lm, impl="torch", diff_matmul=diff), p, cfg)
    if diff == "off":
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
    else:  # log-probs near -28, f near exp(-26): row 0 against its float32 reference, f_0 within 5.9e-6 (measured)
        assert_rows_close(got, ref)


@pytest.mark.parametrize("family", ["gemma2"])  # the family with the most elementwise work
def test_launch_budget(family):
    """Plain products: at most 14 kernels per decoder layer plus 40 for the rest, the prefix fixed (projection_scope
    'demos'). Two decoder layers: a count per layer from more than one, at two thirds of the interpreter's time for
    three."""
    lm = build(family, layers=2)
    be = make_backend("fast", lm, impl="triton", diff_matmul="off")
    st = step_of(be, make_prompt(6))
    st()
    n = kernels_per_step(st)
    assert n.n_layers == 2 and 0 < n.per_layer <= BUDGET_PER_LAYER and 0 < n.rest <= BUDGET_REST, n
    unfused = kernels_per_step(step_of(make_backend("fast", lm, impl="torch", diff_matmul="off"), make_prompt(6)))
    assert unfused.per_layer > 2 * n.per_layer  # the count can tell fused from unfused


def one_layer(st: StaticStep) -> int:
    """The kernels of one decoder layer: the decoder pass's count less that of the same pass with its last layer
    taken out (restored after), as tests/test_cpp_launch_budget.py counts the C++ path's."""
    m = st.backend.model
    run = torch.no_grad()(layers_call(st))
    full = count_kernels(run)
    layers, dense = m.layers, m.rows_dense()
    try:
        m.layers, m._rows_dense = layers[:-1], dense[:-1]
        fewer = count_kernels(run)
    finally:
        m.layers, m._rows_dense = layers, dense
    return full - fewer


@pytest.mark.parametrize("family,scope", [("llama", "demos"), ("gemma2", "prompt")])
def test_launch_budget_rows(family, scope, monkeypatch):
    """The difference form: at most 9 kernels per decoder layer (the 4 products, rope_rows, attention_rows, norm_rows
    twice, gated_rows) plus 30 for the rest, with the prefix kept ('demos') or run as lead rows of every pass
    ('prompt'); measured: 9, and 13 / 14. The count per layer is measured (one_layer); the pass's input norm (Gemma:
    and its embedding scale) is the rest's. The counted steps run under the host-read guard (tests/test_static.py):
    the GPU's default step reads nothing back."""
    lm = build(family, layers=2)
    cfg = dataclasses.replace(CFG, projection_scope=scope)
    st = step_of(make_backend("fast", lm, impl="triton", diff_matmul="bf16"), make_prompt(6), cfg)
    assert st.forward.rows_on and st.forward.policy == ("kept" if scope == "demos" else "pass")
    st()  # the first step makes what the model keeps (bf16 weights, rotary tables): not counted
    with HostReadGuard(monkeypatch):
        n, per_layer = kernels_per_step(st), one_layer(st)
    rest = n.total - n.n_layers * per_layer
    assert 0 < per_layer <= BUDGET_PER_LAYER_ROWS and 0 < rest <= BUDGET_REST_ROWS, (per_layer, rest, n)
    ref = step_of(make_backend("fast", lm, impl="torch", diff_matmul="bf16"), make_prompt(6), cfg)
    ref()
    assert kernels_per_step(ref).layers > 2 * n.layers  # the count can tell fused from unfused


# the packed step's launches a slot: perturb, its batch's copy into the pass, the gather of its span rows, the span
# head (2), the proxy, the update (2) and the bookkeeping (2); measured 12
BUDGET_PER_SLOT = 12


def test_launch_budget_packed():
    """The packed step (difference form): 9 kernels a decoder layer as the static step's (its forward_rows, which
    test_launch_budget_rows counts a layer at a time), 30 for the rest and a fixed amount a slot, counted at 1 and 2
    slots of prompts of two lengths (measured: 19 + 12 a slot on two layers)."""
    from sicl_fast.calibration.packed import PackedStep
    from test_packed import prompt_of

    lm = build("llama", layers=2)
    be = make_backend("fast", lm, impl="triton", diff_matmul="bf16")
    cfg = Calibrator(be, dataclasses.replace(CFG, N=1)).config
    slots = [StaticStep(be, cfg, p, be.embed(p), use_prefix=False, own_forward=False)
             for p in (prompt_of(16, ((4, 7), (9, 12)), 0, 1), prompt_of(13, ((3, 5), (7, 10)), 2, 2))]
    step = PackedStep(be, slots[:1])
    step()  # what the first call makes lazily (bf16 weights, rotary tables): not counted
    one = count_kernels(step)
    step.set(slots)
    per_slot = count_kernels(step) - one
    assert 0 < per_slot <= BUDGET_PER_SLOT and 0 < one - per_slot <= 2 * BUDGET_PER_LAYER_ROWS + BUDGET_REST_ROWS, (
        one, per_slot)
