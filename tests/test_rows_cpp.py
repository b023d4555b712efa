"""The C++ forms of the difference form's ops (sicl_fast.ops.cpp_ops: norm_rows, rope_rows, gated_rows,
attention_rows, span_head_rows; csrc/rows.cpp, attention.cpp, span_head.cpp) and of the static step's bookkeeping
(CppStepOps.bookkeep, csrc/step_state.cpp), beyond the shared parity contract (tests/test_rows_ops.py); the row ops
and the span head each without and with the value rows' float32 references (the products' input and output
references, the span head's reference logits):

  the plain forms (what a CPU without AVX-512 runs; set_plain_forms turns the AVX-512 ones off here) hold the same
      contract, at its tolerances;
  results do not depend on the thread count (bit for bit: every row's sums run in one order whatever the threads);
  NaN and inf come out where the reference puts them (the same non-finite entries, the same signs of inf);
  one extension call per op, two per vocabulary chunk for the span head (torch's product, lse_chunk_rows);
  a reference of the wrong shape, a value slot outside the reference logits: refused before the extension reads;
  bookkeep is the reference's bit for bit at an SNR exactly at the threshold and one float64 ulp above it: the SNR's
      float32 sum and float64 standard deviation are torch's own, at every N the sum kernel's cascade can take.
"""
import math

import pytest
import torch

import test_rows_ops as contract
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.diagnostics.kernel_count import count_kernels
from sicl_fast.step.logprobs import rows_logprobs
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import (RowLayout, gated_rows_reference, norm_rows_reference,
                                   rope_rows_reference, to_rows)
from sicl_fast.ops import cpp_ops, make_ops
from sicl_fast.ops.cpp_ops import HEAD_CHUNK
from sicl_fast.step.step_state import StepState, bookkeep_reference
from sicl_fast.step.zo import finite_differences
from test_rows_ops import LAYOUT_IDS, LAYOUTS, WITH_REF, form_of, layout, near_rows, reference_of

pytestmark = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")

# a layout large enough for every op to run on several threads: lead rows and packed anchors
BIG = RowLayout.build(4, 5, 48, 4, [0, 0, 0, 3, 3])


@pytest.fixture
def dec():
    return make_ops("cpp").decoder


@pytest.fixture
def plain_forms():
    cpp_ops.require().set_plain_forms(True)
    try:
        yield
    finally:
        cpp_ops.require().set_plain_forms(False)


def with_threads(fn) -> list:
    """fn() on 1 thread and on several (at least 4), the extension's count restored after."""
    n = cpp_ops.num_threads()
    try:
        outs = []
        for t in (1, max(4, n)):
            cpp_ops.set_num_threads(t)
            outs.append(fn())
        return outs
    finally:
        cpp_ops.set_num_threads(n)


def same_bits(a, b) -> bool:
    a, b = (t if isinstance(t, (tuple, list)) else (t,) for t in (a, b))
    return all(torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32),
                           y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32))
               for x, y in zip(a, b))


def same_nonfinite(got: torch.Tensor, ref: torch.Tensor) -> None:
    got, ref = got.float(), ref.float()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN elsewhere than the reference's"
    assert torch.equal(torch.isposinf(got), torch.isposinf(ref)) and torch.equal(torch.isneginf(got),
                                                                                 torch.isneginf(ref))
    assert bool(torch.isfinite(ref).any())  # the case leaves finite entries to compare


def rope_inputs(rows, H, Hk, hd, seed=3, with_ref=False):
    """(qkv in difference form, cos, sin, a head norm, qkv's reference or None)."""
    g = torch.Generator().manual_seed(hd)
    qkv, qkv_ref = form_of(near_rows(rows, (H + 2 * Hk) * hd, seed=seed), rows, with_ref, seed + 1)
    pos = torch.arange(max(64, rows.pos0 + rows.T), dtype=torch.float32)[:, None] / (1 + torch.arange(hd // 2))
    norm = torch.randn(hd, generator=g).abs() + 0.5
    return qkv, torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1), norm, qkv_ref


def head_inputs(B, P, d, V, anchors, seed=0, with_ref=False):
    """(hidden [B, P, d] bf16 in difference form, weight [V, d] bf16, targets [P], anchor [B], z_ref [Vb, P, V] or
    None, value_slot [B]): with_ref, the value rows against a reference of their hidden states, whose float32
    product is z_ref."""
    g = torch.Generator().manual_seed(seed)
    rows = RowLayout.build(0, B, P, 0, anchors)
    h = 2.0 * torch.randn(B, P, d, generator=g)
    for j, a in enumerate(anchors):
        if a != j:
            h[j] = h[a] + 1e-2 * torch.randn(P, d, generator=g)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    h_ref = reference_of(h.view(B * P, d), rows, with_ref, seed + 1)
    z_ref = None if h_ref is None else (h_ref @ w.float().t()).view(-1, P, V)
    hl = rows.batch(to_rows(h.view(B * P, d), rows, ref=h_ref))
    return hl, w, torch.randint(0, V, (P,), generator=g), rows.anchor, z_ref, rows.value_slot


# ------------------------------------------------------------------------------------------------ plain forms


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@WITH_REF
def test_plain_forms_hold_the_contract(plain_forms, spec, with_ref):
    for d in (8, 131):
        contract.test_norm_rows("cpp", spec, True, True, False, d, with_ref)
        contract.test_norm_rows("cpp", spec, False, False, True, d, with_ref)
    for H, Hk, hd in ((4, 2, 8), (2, 2, 64)):
        contract.test_rope_rows("cpp", spec, H, Hk, hd, True, False, False, with_ref)
    for act in ("silu", "gelu_pytorch_tanh"):
        contract.test_gated_rows("cpp", spec, act, 67, True, with_ref)
    for window, softcap in ((None, None), (5, 20.0)):
        contract.test_attention_rows("cpp", spec, 4, 2, 16, window, softcap, with_ref)


@pytest.mark.parametrize("B,P,d,V,anchors", [(4, 5, 40, 300, None), (5, 2, 24, 1100, [0, 0, 2, 2, 2])])
@WITH_REF
def test_plain_span_head_holds_the_contract(plain_forms, B, P, d, V, anchors, with_ref):
    contract.test_span_head_rows("cpp", B, P, d, V, anchors, 30.0, with_ref)


# ------------------------------------------------------------------------------------------------ thread count


@WITH_REF
def test_norm_rows_independent_of_thread_count(dec, with_ref):
    d = 136
    x = near_rows(BIG, d, seed=1)
    y, y_ref = form_of(near_rows(BIG, d, seed=2), BIG, with_ref, 3)
    h_ref = reference_of(near_rows(BIG, d, scale=1.0, seed=4), BIG, with_ref, 5)
    w, pw, b = torch.rand(d) + 0.5, torch.rand(d) + 0.5, torch.randn(d)
    one, many = with_threads(lambda: dec.norm_rows(x, y, b, pw, w, 1e-6, True, BIG, y_ref, h_ref))
    assert same_bits(one, many)


@WITH_REF
def test_rope_rows_independent_of_thread_count(dec, with_ref):
    H, Hk, hd = 4, 2, 32
    qkv, cos, sin, norm, qkv_ref = rope_inputs(BIG, H, Hk, hd, with_ref=with_ref)

    def run():
        k, v = torch.empty(BIG.R, Hk, hd), torch.empty(BIG.R, Hk, hd)
        return dec.rope_rows(qkv, None, BIG, cos, sin, norm, norm, 1e-6, False, H, Hk, k, v, qkv_ref), k, v

    one, many = with_threads(run)
    assert same_bits(one, many)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@WITH_REF
def test_gated_rows_independent_of_thread_count(dec, act, with_ref):
    y, y_ref = form_of(near_rows(BIG, 600, seed=4), BIG, with_ref, 5)
    a_ref = reference_of(near_rows(BIG, 300, scale=1.0, seed=6), BIG, with_ref, 7)
    one, many = with_threads(lambda: dec.gated_rows(y, None, act, BIG, y_ref, a_ref))
    assert same_bits(one, many)


@WITH_REF
def test_attention_rows_independent_of_thread_count(with_ref):
    H, Hk, hd = 4, 2, 32
    q = near_rows(BIG, H * hd, scale=1.0, seed=5).view(BIG.R, H, hd)
    k, v = (near_rows(BIG, Hk * hd, scale=1.0, seed=s).view(BIG.R, Hk, hd) for s in (6, 7))
    o_ref = reference_of(near_rows(BIG, H * hd, scale=1.0, seed=8), BIG, with_ref, 9)
    attn = Attention("cpp", hd ** -0.5, 30.0, torch.float32, "cpu", cpp_ops)
    one, many = with_threads(lambda: attn.rows(q, k, v, BIG, 9, None, o_ref))
    assert same_bits(one, many)


@WITH_REF
def test_span_head_rows_independent_of_thread_count(with_ref):
    hl, w, t, anchor, z_ref, slot = head_inputs(5, 20, 64, 1300, [0, 0, 0, 3, 3], with_ref=with_ref)
    ops = make_ops("cpp").step
    one, many = with_threads(lambda: ops.span_head_rows(hl, w, t, anchor, softcap=30.0, z_ref=z_ref,
                                                        value_slot=slot))
    assert same_bits(one, many)


# ------------------------------------------------------------------------------------------------ NaN and inf


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[4]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[4]])
@WITH_REF
def test_norm_rows_nonfinite_where_the_reference(dec, spec, with_ref):
    rows, d = layout(spec), 24
    x, y = near_rows(rows, d, seed=1), near_rows(rows, d, seed=2)
    x[1, 3], y[rows.R - 1, 5] = math.nan, math.inf  # a lead / first-block row of x, the last row's product
    x[rows.lead + 2, 0] = -math.inf  # an anchor row of the batch: its differences too
    yl, y_ref = form_of(y, rows, with_ref, 3)
    h_ref = reference_of(near_rows(rows, d, scale=1.0, seed=4), rows, with_ref, 5)
    if with_ref:  # a NaN in the product's reference (an anchor's value row: its differences too), inf in h's
        y_ref[rows.lead + 1, 7], h_ref[0, 9] = math.nan, math.inf
    w = torch.rand(d) + 0.5
    for post in (None, torch.rand(d) + 0.5):
        for got, ref in zip(dec.norm_rows(x, yl, None, post, w, 1e-6, False, rows, y_ref, h_ref),
                            norm_rows_reference(x, yl, None, post, w, 1e-6, False, rows, y_ref, h_ref)):
            same_nonfinite(got, ref)


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[4]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[4]])
@WITH_REF
def test_rope_rows_nonfinite_where_the_reference(dec, spec, with_ref):
    rows, H, Hk, hd = layout(spec), 2, 1, 16
    qkv, cos, sin, norm, qkv_ref = rope_inputs(rows, H, Hk, hd, with_ref=with_ref)
    qkv[0, 3], qkv[rows.lead, 40], qkv[rows.R - 1, 60] = math.nan, math.inf, -math.inf
    if with_ref:  # a value batch row's q and v references
        qkv_ref[rows.lead, 5], qkv_ref[rows.values - 1, 50] = -math.inf, math.nan
    for qn in (None, norm):
        outs = []
        for fn in (dec.rope_rows, rope_rows_reference):
            k, v = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
            outs.append((fn(qkv, None, rows, cos, sin, qn, qn, 1e-6, False, H, Hk, k, v, qkv_ref), k, v))
        for got, ref in zip(*outs):
            same_nonfinite(got, ref)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@WITH_REF
def test_gated_rows_nonfinite_where_the_reference(dec, act, with_ref):
    rows, I = layout(LAYOUTS[4]), 40
    y = near_rows(rows, 2 * I, seed=4)
    y_ref = reference_of(y, rows, with_ref, 5)  # of the finite rows
    # gate +-inf and NaN, up inf, in an anchor's row (its differences too) and in a difference's
    y[0, 1], y[0, 2], y[0, I + 3], y[rows.R - 1, 7] = math.inf, -math.inf, math.inf, math.nan
    yl = to_rows(y, rows, ref=y_ref)
    a_ref = reference_of(near_rows(rows, I, scale=1.0, seed=6), rows, with_ref, 7)
    if with_ref:  # the second block's anchor: a NaN gate reference, an inf output reference
        y_ref[rows.T + 2, 11], a_ref[rows.T + 3, 12] = math.nan, -math.inf
    same_nonfinite(dec.gated_rows(yl, None, act, rows, y_ref, a_ref),
                   gated_rows_reference(yl, None, act, rows, y_ref, a_ref))


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[3]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[3]])
@WITH_REF
def test_attention_rows_nonfinite_where_the_reference(spec, with_ref):
    """Non-finite keys and values where every later query sees them (the first row's, the kept prefix's) and a NaN
    query; with a reference, non-finite entries of the output's reference. (A non-finite key or value that a query
    does not see, a later one of its batch row, turns its row NaN in the reference: its masks add -inf to a masked
    score and multiply a masked value by 0; the C++ tiles leave masked keys out, or not, by tile: there the two
    differ, and neither is an answer.)"""
    rows, H, Hk, hd = layout(spec), 4, 2, 16
    q = near_rows(rows, H * hd, scale=1.0, seed=5).view(rows.R, H, hd)
    k, v = (near_rows(rows, Hk * hd, scale=1.0, seed=s).view(rows.R, Hk, hd) for s in (6, 7))
    q[rows.R - 1, 1, 3], k[0, 1, 0], v[0, 0, 2] = math.nan, math.inf, math.nan
    g = torch.Generator().manual_seed(0)
    prefix = None
    if rows.lead == 0:
        prefix = (torch.randn(1, rows.pos0, Hk, hd, generator=g), torch.randn(1, rows.pos0, Hk, hd, generator=g))
        prefix[0][0, 1, 0, 5] = -math.inf
    o_ref = reference_of(near_rows(rows, H * hd, scale=1.0, seed=8), rows, with_ref, 9)
    if with_ref:
        o_ref[rows.values - 1, 7], o_ref[rows.values - 2, 20] = math.nan, math.inf
    ref = attention_rows_reference(Attention("math", hd ** -0.5, None, torch.float32, "cpu"), q, k, v, rows, None,
                                   prefix, o_ref)
    got = Attention("cpp", hd ** -0.5, None, torch.float32, "cpu", cpp_ops).rows(q, k, v, rows, None, prefix, o_ref)
    same_nonfinite(got, ref)


@WITH_REF
def test_span_head_rows_nonfinite_where_the_reference(with_ref):
    hl, w, t, anchor, z_ref, slot = head_inputs(5, 3, 24, 1100, [0, 0, 2, 2, 2], with_ref=with_ref)
    ops = make_ops("cpp").step
    nan_value, inf_difference = hl.clone(), hl.clone()
    nan_value[2, 1, 4] = math.nan  # an anchor's row: its differences' rows too
    inf_difference[3, 0, 3] = math.inf  # +-inf logits in one difference row: a NaN sum there
    cases = [(nan_value, z_ref), (inf_difference, z_ref)]
    if with_ref:  # the reference logits: a NaN in the first block's anchor row, -inf at a target of the second's
        bad = z_ref.clone()
        bad[0, 1, 17], bad[1, 2, int(t[2])] = math.nan, -math.inf
        cases.append((hl, bad))
    for h, zr in cases:
        same_nonfinite(ops.span_head_rows(h, w, t, anchor, z_ref=zr, value_slot=slot),
                       rows_logprobs(h, w, t, anchor, None, zr, slot))


# ------------------------------------------------------------------------------------------------ launches


@WITH_REF
def test_one_call_per_row_op(dec, with_ref):
    rows, d, H, Hk, hd = layout(LAYOUTS[2]), 24, 2, 1, 16
    x = near_rows(rows, d, seed=1)
    y, y_ref = form_of(near_rows(rows, d, seed=2), rows, with_ref, 3)
    y2, y2_ref = form_of(near_rows(rows, 2 * d), rows, with_ref, 4)
    h_ref, a_ref = (reference_of(near_rows(rows, n, seed=5), rows, with_ref, 6) for n in (d, d))
    w = torch.rand(d) + 0.5
    qkv, cos, sin, norm, qkv_ref = rope_inputs(rows, H, Hk, hd, with_ref=with_ref)
    k, v = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
    q = near_rows(rows, H * hd, seed=5).view(rows.R, H, hd)
    o_ref = reference_of(near_rows(rows, H * hd, seed=7), rows, with_ref, 8)
    attn = Attention("cpp", hd ** -0.5, None, torch.float32, "cpu", cpp_ops)
    calls = {"norm_rows": lambda: dec.norm_rows(x, y, None, w, w, 1e-6, False, rows, y_ref, h_ref),
             "norm_rows (input)": lambda: dec.norm_rows(x, None, None, None, w, 1e-6, False, rows, None, h_ref),
             "rope_rows": lambda: dec.rope_rows(qkv, None, rows, cos, sin, norm, norm, 1e-6, False, H, Hk, k, v,
                                                qkv_ref),
             "gated_rows": lambda: dec.gated_rows(y2, None, "silu", rows, y2_ref, a_ref),
             "attention_rows": lambda: attn.rows(q, k, v, rows, None, None, o_ref)}
    counts = {name: count_kernels(fn) for name, fn in calls.items()}
    assert all(n == 1 for n in counts.values()), counts


def test_bf16_weights_converted_once(dec):
    """A bf16 model's norm weights and biases: a float32 copy made once per tensor (one call per op after the first),
    made again when the weight changes in place."""
    rows, d = layout(LAYOUTS[2]), 40
    x, y = near_rows(rows, d, seed=1), to_rows(near_rows(rows, d, seed=2), rows)
    w, b = (torch.rand(d) + 0.5).to(torch.bfloat16), torch.randn(d).to(torch.bfloat16)
    dec.norm_rows(x, y, b, w, w, 1e-6, False, rows)
    assert count_kernels(lambda: dec.norm_rows(x, y, b, w, w, 1e-6, False, rows)) == 1
    for _ in range(2):
        got, ref = dec.norm_rows(x, y, b, w, w, 1e-6, False, rows), norm_rows_reference(x, y, b, w, w, 1e-6, False,
                                                                                         rows)
        torch.testing.assert_close(got[0], ref[0], **contract.F32)
        contract.assert_form_close(got[1], ref[1], rows)
        w.mul_(2.0)


@pytest.mark.parametrize("anchors", [[0, 0, 0], [0, 0, 2], [0, 1, 2]], ids=["one-prompt", "packed", "values"])
@WITH_REF
def test_span_head_rows_two_calls_a_chunk(anchors, with_ref):
    """Two calls a chunk; one for values alone without reference logits (no product: their logits in float32 in the
    extension), two with them (the values' changes come from the product)."""
    V = 2 * HEAD_CHUNK + 7
    hl, w, t, anchor, z_ref, slot = head_inputs(3, 4, 32, V, anchors, with_ref=with_ref)
    ops = make_ops("cpp").step
    n = count_kernels(lambda: ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref, value_slot=slot))
    chunks = -(-V // HEAD_CHUNK)
    assert n == (chunks if anchors == [0, 1, 2] and not with_ref else 2 * chunks)
    torch.testing.assert_close(ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref, value_slot=slot),
                               rows_logprobs(hl, w, t, anchor, None, z_ref, slot), **contract.F32)


def test_span_head_rows_value_slot_default_and_checks():
    """value_slot None: the value rows in order (what RowLayout gives); a slot outside z_ref, a reference of the wrong
    shape: refused by the extension before it reads."""
    hl, w, t, anchor, z_ref, slot = head_inputs(5, 3, 24, 700, [0, 0, 2, 2, 4], with_ref=True)
    ops = make_ops("cpp").step
    assert same_bits(ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref),
                     ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref, value_slot=slot))
    with pytest.raises(ValueError, match="value slot"):
        ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref, value_slot=torch.tensor([0, 0, 1, 0, 3]))
    with pytest.raises(ValueError, match="z_ref"):
        ops.span_head_rows(hl, w, t, anchor, z_ref=z_ref[:, :2].contiguous(), value_slot=slot)


def test_row_references_of_the_wrong_shape_refused(dec):
    rows, d = layout(LAYOUTS[4]), 16
    x, (y, y_ref) = near_rows(rows, d, seed=1), form_of(near_rows(rows, d, seed=2), rows, True, 3)
    w = torch.rand(d) + 0.5
    with pytest.raises(ValueError, match="y_ref"):
        dec.norm_rows(x, y, None, None, w, 1e-6, False, rows, y_ref[1:], None)
    with pytest.raises(ValueError, match="h_ref"):
        dec.norm_rows(x, y, None, None, w, 1e-6, False, rows, y_ref, torch.zeros(rows.R, d))
    with pytest.raises(ValueError, match="a_ref"):
        dec.gated_rows(y, None, "silu", rows, None, torch.zeros(rows.values, d))


# ------------------------------------------------------------------------------------------------ bookkeep


@pytest.mark.parametrize("N", [2, 3, 5, 7, 8, 9, 15, 16, 33, 100, 513, 2100, 65_536])
@pytest.mark.parametrize("estimator", ["forward", "central"])
def test_bookkeep_snr_at_the_threshold_is_the_references(N, estimator):
    g = torch.Generator().manual_seed(N)
    B = 2 * N + 1 if estimator == "central" else N + 1
    f = 0.5 + 1e-3 * torch.randn(B, generator=g)
    base = CalibrationConfig(N=N, mu=0.01, tau=0.0, patience=0, max_steps=8, scale=1.0, estimator=estimator)
    d = finite_differences(f, base.mu_eff, base.estimator)
    snr = float(d.mean().abs() / (d.std() + 1e-12))
    fired = torch.ones(1, dtype=torch.int32)
    for threshold in (snr, math.nextafter(snr, math.inf)):  # at the SNR: not low; one ulp above: low
        cfg = base.replace(snr_threshold=threshold)
        X0, X_next = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        ref, got = StepState.new(X0, cfg), StepState.new(X0, cfg)
        ref.X_next.copy_(X_next)
        got.X_next.copy_(X_next)
        bookkeep_reference(ref, f, fired, cfg)
        make_ops("cpp").step.bookkeep(got, f, fired, cfg)
        for r, o in zip(contract_state(ref), contract_state(got)):
            assert torch.equal(r, o) or torch.allclose(r, o, rtol=0, atol=0, equal_nan=True)
        assert int(got.low_snr) == (threshold > snr)


def contract_state(st: StepState) -> list:
    return [st.X, st.best.best_X, st.best.best_f, st.best.counters, st.step_t, st.steps_run, st.reason, st.low_snr,
            st.projections, st.history, st.anchor]
