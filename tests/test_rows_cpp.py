"""The C++ forms of the difference form's ops (sicl_fast.ops.cpp_ops: norm_rows, rope_rows, gated_rows,
attention_rows, span_head_rows; csrc/rows.cpp, attention.cpp, span_head.cpp) and of the static step's bookkeeping
(CppStepOps.advance, csrc/step_state.cpp), beyond the shared parity contract (tests/test_rows_ops.py):

  the plain forms (what a CPU without AVX-512 runs; set_plain_forms turns the AVX-512 ones off here) hold the same
      contract, at its tolerances;
  results do not depend on the thread count (bit for bit: every row's sums run in one order whatever the threads);
  NaN and inf come out where the reference puts them (the same non-finite entries, the same signs of inf);
  one extension call per op, two per vocabulary chunk for the span head (torch's product, lse_chunk_rows);
  advance is the reference's bit for bit at an SNR exactly at the threshold and one float64 ulp above it: the SNR's
      float32 sum and float64 standard deviation are torch's own, at every N the sum kernel's cascade can take.
"""
import math

import pytest
import torch

import test_rows_ops as contract
from sicl_fast.ascent import CalibrationConfig
from sicl_fast.kernel_count import count_kernels
from sicl_fast.logprobs import rows_logprobs
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import (RowLayout, gated_rows_reference, is_value, norm_rows_reference,
                                   rope_rows_reference, to_rows)
from sicl_fast.ops import cpp_ops, make_ops
from sicl_fast.ops.cpp_ops import HEAD_CHUNK
from sicl_fast.step_state import StepState, advance_reference
from sicl_fast.zo import finite_differences
from test_rows_ops import LAYOUT_IDS, LAYOUTS, layout, near_rows

pytestmark = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast._C is not built")

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


def rope_inputs(rows, H, Hk, hd, seed=3):
    g = torch.Generator().manual_seed(hd)
    qkv = to_rows(near_rows(rows, (H + 2 * Hk) * hd, seed=seed), rows)
    pos = torch.arange(max(64, rows.pos0 + rows.T), dtype=torch.float32)[:, None] / (1 + torch.arange(hd // 2))
    norm = torch.randn(hd, generator=g).abs() + 0.5
    return qkv, torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1), norm


def head_inputs(B, P, d, V, anchors, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.tensor(anchors)
    h = 2.0 * torch.randn(B, P, d, generator=g)
    for j, a in enumerate(anchors):
        if a != j:
            h[j] = h[a] + 1e-2 * torch.randn(P, d, generator=g)
    hl = torch.where(is_value(anchor)[:, None, None], h, h - h[anchor]).to(torch.bfloat16)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    return hl, w, torch.randint(0, V, (P,), generator=g), anchor


# ------------------------------------------------------------------------------------------------ plain forms


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
def test_plain_forms_hold_the_contract(plain_forms, spec):
    for d in (8, 131):
        contract.test_norm_rows("cpp", spec, True, True, False, d)
        contract.test_norm_rows("cpp", spec, False, False, True, d)
    for H, Hk, hd in ((4, 2, 8), (2, 2, 64)):
        contract.test_rope_rows("cpp", spec, H, Hk, hd, True, False, False)
    for act in ("silu", "gelu_pytorch_tanh"):
        contract.test_gated_rows("cpp", spec, act, 67, True)
    for window, softcap in ((None, None), (5, 20.0)):
        contract.test_attention_rows("cpp", spec, 4, 2, 16, window, softcap)


@pytest.mark.parametrize("B,P,d,V,anchors", [(4, 5, 40, 300, None), (5, 2, 24, 1100, [0, 0, 2, 2, 2])])
def test_plain_span_head_holds_the_contract(plain_forms, B, P, d, V, anchors):
    contract.test_span_head_rows("cpp", B, P, d, V, anchors, 30.0)


# ------------------------------------------------------------------------------------------------ thread count


def test_norm_rows_independent_of_thread_count(dec):
    d = 136
    x, y = near_rows(BIG, d, seed=1), to_rows(near_rows(BIG, d, seed=2), BIG)
    w, pw, b = torch.rand(d) + 0.5, torch.rand(d) + 0.5, torch.randn(d)
    one, many = with_threads(lambda: dec.norm_rows(x, y, b, pw, w, 1e-6, True, BIG))
    assert same_bits(one, many)


def test_rope_rows_independent_of_thread_count(dec):
    H, Hk, hd = 4, 2, 32
    qkv, cos, sin, norm = rope_inputs(BIG, H, Hk, hd)

    def run():
        k, v = torch.empty(BIG.R, Hk, hd), torch.empty(BIG.R, Hk, hd)
        return dec.rope_rows(qkv, None, BIG, cos, sin, norm, norm, 1e-6, False, H, Hk, k, v), k, v

    one, many = with_threads(run)
    assert same_bits(one, many)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_rows_independent_of_thread_count(dec, act):
    y = to_rows(near_rows(BIG, 600, seed=4), BIG)
    one, many = with_threads(lambda: dec.gated_rows(y, None, act, BIG))
    assert same_bits(one, many)


def test_attention_rows_independent_of_thread_count():
    H, Hk, hd = 4, 2, 32
    q = near_rows(BIG, H * hd, scale=1.0, seed=5).view(BIG.R, H, hd)
    k, v = (near_rows(BIG, Hk * hd, scale=1.0, seed=s).view(BIG.R, Hk, hd) for s in (6, 7))
    attn = Attention("cpp", hd ** -0.5, 30.0, torch.float32, "cpu")
    one, many = with_threads(lambda: attn.rows(q, k, v, BIG, 9))
    assert same_bits(one, many)


def test_span_head_rows_independent_of_thread_count():
    hl, w, t, anchor = head_inputs(5, 20, 64, 1300, [0, 0, 0, 3, 3])
    ops = make_ops("cpp").step
    one, many = with_threads(lambda: ops.span_head_rows(hl, w, t, anchor, softcap=30.0))
    assert same_bits(one, many)


# ------------------------------------------------------------------------------------------------ NaN and inf


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[4]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[4]])
def test_norm_rows_nonfinite_where_the_reference(dec, spec):
    rows, d = layout(spec), 24
    x, y = near_rows(rows, d, seed=1), near_rows(rows, d, seed=2)
    x[1, 3], y[rows.R - 1, 5] = math.nan, math.inf  # a lead / first-block row of x, the last row's product
    x[rows.lead + 2, 0] = -math.inf  # an anchor row of the batch: its differences too
    yl, w = to_rows(y, rows), torch.rand(d) + 0.5
    for post in (None, torch.rand(d) + 0.5):
        for got, ref in zip(dec.norm_rows(x, yl, None, post, w, 1e-6, False, rows),
                            norm_rows_reference(x, yl, None, post, w, 1e-6, False, rows)):
            same_nonfinite(got, ref)


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[4]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[4]])
def test_rope_rows_nonfinite_where_the_reference(dec, spec):
    rows, H, Hk, hd = layout(spec), 2, 1, 16
    qkv, cos, sin, norm = rope_inputs(rows, H, Hk, hd)
    qkv[0, 3], qkv[rows.lead, 40], qkv[rows.R - 1, 60] = math.nan, math.inf, -math.inf
    for qn in (None, norm):
        outs = []
        for fn in (dec.rope_rows, rope_rows_reference):
            k, v = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
            outs.append((fn(qkv, None, rows, cos, sin, qn, qn, 1e-6, False, H, Hk, k, v), k, v))
        for got, ref in zip(*outs):
            same_nonfinite(got, ref)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_rows_nonfinite_where_the_reference(dec, act):
    rows, I = layout(LAYOUTS[4]), 40
    y = near_rows(rows, 2 * I, seed=4)
    # gate +-inf and NaN, up inf, in an anchor's row (its differences too) and in a difference's
    y[0, 1], y[0, 2], y[0, I + 3], y[rows.R - 1, 7] = math.inf, -math.inf, math.inf, math.nan
    yl = to_rows(y, rows)
    same_nonfinite(dec.gated_rows(yl, None, act, rows), gated_rows_reference(yl, None, act, rows))


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[3]], ids=[LAYOUT_IDS[2], LAYOUT_IDS[3]])
def test_attention_rows_nonfinite_where_the_reference(spec):
    """Non-finite keys and values where every later query sees them (the first row's, the kept prefix's) and a NaN
    query. (A non-finite key or value that a query does not see, a later one of its batch row, turns its row NaN in
    the reference: its masks add -inf to a masked score and multiply a masked value by 0; the C++ tiles leave
    masked keys out, or not, by tile: there the two differ, and neither is an answer.)"""
    rows, H, Hk, hd = layout(spec), 4, 2, 16
    q = near_rows(rows, H * hd, scale=1.0, seed=5).view(rows.R, H, hd)
    k, v = (near_rows(rows, Hk * hd, scale=1.0, seed=s).view(rows.R, Hk, hd) for s in (6, 7))
    q[rows.R - 1, 1, 3], k[0, 1, 0], v[0, 0, 2] = math.nan, math.inf, math.nan
    g = torch.Generator().manual_seed(0)
    prefix = None
    if rows.lead == 0:
        prefix = (torch.randn(1, rows.pos0, Hk, hd, generator=g), torch.randn(1, rows.pos0, Hk, hd, generator=g))
        prefix[0][0, 1, 0, 5] = -math.inf
    ref = attention_rows_reference(Attention("math", hd ** -0.5, None, torch.float32, "cpu"), q, k, v, rows, None,
                                   prefix)
    got = Attention("cpp", hd ** -0.5, None, torch.float32, "cpu").rows(q, k, v, rows, None, prefix)
    same_nonfinite(got, ref)


def test_span_head_rows_nonfinite_where_the_reference():
    hl, w, t, anchor = head_inputs(5, 3, 24, 1100, [0, 0, 2, 2, 2])
    ops = make_ops("cpp").step
    nan_value, inf_difference = hl.clone(), hl.clone()
    nan_value[2, 1, 4] = math.nan  # an anchor's row: its differences' rows too
    inf_difference[3, 0, 3] = math.inf  # +-inf logits in one difference row: a NaN sum there
    for h in (nan_value, inf_difference):
        same_nonfinite(ops.span_head_rows(h, w, t, anchor), rows_logprobs(h, w, t, anchor))


# ------------------------------------------------------------------------------------------------ launches


def test_one_call_per_row_op(dec):
    rows, d, H, Hk, hd = layout(LAYOUTS[2]), 24, 2, 1, 16
    x, y, y2 = near_rows(rows, d, seed=1), to_rows(near_rows(rows, d, seed=2), rows), to_rows(near_rows(rows, 2 * d),
                                                                                            rows)
    w = torch.rand(d) + 0.5
    qkv, cos, sin, norm = rope_inputs(rows, H, Hk, hd)
    k, v = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
    q = near_rows(rows, H * hd, seed=5).view(rows.R, H, hd)
    attn = Attention("cpp", hd ** -0.5, None, torch.float32, "cpu")
    calls = {"norm_rows": lambda: dec.norm_rows(x, y, None, w, w, 1e-6, False, rows),
             "norm_rows (input)": lambda: dec.norm_rows(x, None, None, None, w, 1e-6, False, rows),
             "rope_rows": lambda: dec.rope_rows(qkv, None, rows, cos, sin, norm, norm, 1e-6, False, H, Hk, k, v),
             "gated_rows": lambda: dec.gated_rows(y2, None, "silu", rows),
             "attention_rows": lambda: attn.rows(q, k, v, rows, None)}
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
def test_span_head_rows_two_calls_a_chunk(anchors):
    V = 2 * HEAD_CHUNK + 7
    hl, w, t, anchor = head_inputs(3, 4, 32, V, anchors)
    ops = make_ops("cpp").step
    n = count_kernels(lambda: ops.span_head_rows(hl, w, t, anchor))
    chunks = -(-V // HEAD_CHUNK)
    assert n == (chunks if anchors == [0, 1, 2] else 2 * chunks)  # values only: no difference product
    torch.testing.assert_close(ops.span_head_rows(hl, w, t, anchor), rows_logprobs(hl, w, t, anchor),
                               **contract.F32)


# ------------------------------------------------------------------------------------------------ advance


@pytest.mark.parametrize("N", [2, 3, 5, 7, 8, 9, 15, 16, 33, 100, 513, 2100, 65_536])
@pytest.mark.parametrize("estimator", ["forward", "central"])
def test_advance_snr_at_the_threshold_is_the_references(N, estimator):
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
        advance_reference(ref, f, fired, cfg)
        make_ops("cpp").step.advance(got, f, fired, cfg)
        for r, o in zip(contract_state(ref), contract_state(got)):
            assert torch.equal(r, o) or torch.allclose(r, o, rtol=0, atol=0, equal_nan=True)
        assert int(got.low_snr) == (threshold > snr)


def contract_state(st: StepState) -> list:
    return [st.X, st.best.best_X, st.best.best_f, st.best.counters, st.step_t, st.steps_run, st.reason, st.low_snr,
            st.projections, st.history, st.anchor]
