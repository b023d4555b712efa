"""The difference form's ops (sicl_fast.models.rows: norm_rows, rope_rows, gated_rows; Attention.rows; StepOps
span_head_rows) of every implementation against the torch references, on odd shapes and layouts: lead rows or
not, one prompt (every row anchored at row 0) or packed blocks (anchors at each block's first row), a batch of one;
without and with the value rows' float32 reference (the products' input and output references, the span head's
reference logits).

Tolerances, and why:
  float32 outputs (the residual x', rotary's q and the K / V written, the span log-probs): rtol 1e-5 / atol 1e-5
      (sums and rsqrt / exp / tanh in another order or form than torch's; the inputs are the same bits).
  difference-form outputs (bf16): each entry within one bf16 ulp of the reference's (2^-7 relative: both round a
      float32 that may differ in its last bits) plus 1e-6, plus 16 float32 ulps of the float32 row it was taken
      from (a change from an anchor or a reference inherits the rounding of the two float32 rows it is taken
      between).
"""
import math

import pytest
import torch

from sicl_fast.step.logprobs import rows_logprobs
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import (RowLayout, from_rows, gated_rows_reference, norm_rows_reference,
                                   rope_rows_reference, to_rows)
from sicl_fast.ops import attention_kernels, make_ops
from test_ops import device_of, why_unavailable

F32 = dict(rtol=1e-5, atol=1e-5)
# (lead, B, T, pos0, anchors): anchors None = one prompt (all rows anchored at row 0)
LAYOUTS = [
    (0, 1, 5, 0, None),  # a batch of one: values only
    (0, 4, 7, 0, None),  # one prompt, no prefix
    (3, 3, 6, 3, None),  # the prefix's rows in the pass (lead rows)
    (0, 3, 5, 4, None),  # batch rows after a kept prefix of 4
    (0, 5, 4, 0, [0, 0, 2, 2, 2]),  # two packed prompts
]
LAYOUT_IDS = ["one-row", "one-prompt", "lead-rows", "after-kept-prefix", "packed"]
WITH_REF = pytest.mark.parametrize("with_ref", [False, True], ids=["values", "reference"])


@pytest.fixture(params=["torch", "cpp", "triton"])
def impl(request):
    reason = why_unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def layout(spec, device="cpu") -> RowLayout:
    lead, B, T, pos0, anchors = spec
    return RowLayout.build(lead, B, T, pos0, anchors, device=device)


def near_rows(rows: RowLayout, k: int, scale: float = 3.0, step: float = 1e-2, seed: int = 0) -> torch.Tensor:
    """[R, k] float32 rows of a perturbation pass: lead rows and value rows random, each difference row its
    anchor's rows plus a small change (step)."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(rows.R, k, generator=g)
    xb = rows.batch(x)
    for j, a in enumerate(rows.anchors):
        if a != j:
            xb[j] = xb[a] + step * torch.randn(rows.T, k, generator=g)
    return x


def value_rows(x: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """The value rows of x [R, k] in a reference's order: [V, k]."""
    xb = rows.batch(x)
    return torch.cat([x[:rows.lead]] + [xb[j] for j, a in enumerate(rows.anchors) if a == j])


def reference_of(x: torch.Tensor, rows: RowLayout, with_ref: bool, seed: int) -> torch.Tensor | None:
    """A float32 reference of x's value rows [V, k] (their values moved by a few per cent, as between two
    references of a run), or None."""
    if not with_ref:
        return None
    v = value_rows(x, rows)
    return v + 0.03 * v.abs().mean() * torch.randn(v.shape, generator=torch.Generator().manual_seed(seed))


def form_of(x: torch.Tensor, rows: RowLayout, with_ref: bool, seed: int):
    """(x's difference form against its reference, the reference or None): a product's output and its reference
    (the reference of an output being, in a run, its reference input's product)."""
    ref = reference_of(x, rows, with_ref, seed)
    return to_rows(x, rows, ref=ref), ref


def assert_form_close(got: torch.Tensor, ref: torch.Tensor, rows: RowLayout, ref_in=None) -> None:
    """Difference-form outputs (the module docstring's tolerance); ref_in: the value rows' reference the forms
    were taken against (None: none)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    got, ref = got.detach().cpu().float(), ref.float()
    rows_f32 = from_rows(ref.to(torch.bfloat16), rows, ref_in)  # the float32 rows the forms were taken from
    err = (got - ref).abs()
    bound = ref.abs() * 2 ** -7 + 1e-6 + 16 * 2 ** -23 * rows_f32.abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def to(t, dev):
    return None if t is None else t.to(dev)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("gemma,post,bias", [(False, False, False), (False, False, True), (True, True, False)])
@pytest.mark.parametrize("d", [8, 131])
@WITH_REF
def test_norm_rows(impl, spec, gemma, post, bias, d, with_ref):
    dev = device_of(impl)
    rows, cpu = layout(spec, dev), layout(spec)
    g = torch.Generator().manual_seed(d)
    x = near_rows(cpu, d, seed=1)
    y, y_ref = form_of(near_rows(cpu, d, seed=2), cpu, with_ref, 3)
    h_ref = reference_of(norm_rows_reference(x, None, None, None, torch.ones(d), 1e-6, gemma, cpu,
                                             dtype=torch.float32)[1], cpu, with_ref, 4)  # near the rows' norms
    w = torch.randn(d, generator=g).abs() + 0.5
    post_w = torch.randn(d, generator=g).abs() + 0.5 if post else None
    b = torch.randn(d, generator=g) if bias else None
    ops = make_ops(impl, dev).decoder
    for yy, yr in ((None, None), (y, y_ref)):
        rx, rh = norm_rows_reference(x, yy, b, post_w, w, 1e-6, gemma, cpu, yr, h_ref)
        gx, gh = ops.norm_rows(x.to(dev), to(yy, dev), to(b, dev), to(post_w, dev), w.to(dev), 1e-6, gemma, rows,
                               to(yr, dev), to(h_ref, dev))
        torch.testing.assert_close(gx.cpu(), rx, **F32)
        assert_form_close(gh, rh, cpu, h_ref)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("H,Hk,hd", [(4, 2, 8), (3, 1, 24), (2, 2, 64)])
@pytest.mark.parametrize("qk_norm,gemma,bias", [(False, False, True), (True, False, False), (True, True, False)])
@WITH_REF
def test_rope_rows(impl, spec, H, Hk, hd, qk_norm, gemma, bias, with_ref):
    dev = device_of(impl)
    rows, cpu = layout(spec, dev), layout(spec)
    n = (H + 2 * Hk) * hd
    g = torch.Generator().manual_seed(hd)
    qkv, qkv_ref = form_of(near_rows(cpu, n, seed=3), cpu, with_ref, 5)
    b = torch.randn(n, generator=g) if bias else None
    pos = torch.arange(64, dtype=torch.float32)[:, None] / (1 + torch.arange(hd // 2))[None]
    cos, sin = torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1)  # [64, hd]
    qn = torch.randn(hd, generator=g).abs() + 0.5 if qk_norm else None
    kn = torch.randn(hd, generator=g).abs() + 0.5 if qk_norm else None
    rk, rv = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
    rq = rope_rows_reference(qkv, b, cpu, cos, sin, qn, kn, 1e-6, gemma, H, Hk, rk, rv, qkv_ref)
    gk = torch.full((rows.R, Hk, hd), math.nan, device=dev)
    gv = torch.full((rows.R, Hk, hd), math.nan, device=dev)
    gq = make_ops(impl, dev).decoder.rope_rows(qkv.to(dev), to(b, dev), rows, cos.to(dev), sin.to(dev), to(qn, dev),
                                              to(kn, dev), 1e-6, gemma, H, Hk, gk, gv, to(qkv_ref, dev))
    for got, ref in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(got.cpu(), ref, **F32)


@pytest.mark.parametrize("spec", [LAYOUTS[2], LAYOUTS[4]], ids=["lead-rows", "packed"])
def test_later_families_rows(impl, spec):
    """The epilogues with the later families' features (issue 47), the value rows against their references:
    norm_rows without its norm (OLMo 2: the form of x' itself) and with Granite's residual multiplier; rope_rows with
    q / k norms over the whole projection (OLMo 2) and partial rotary (Phi-3: the rest of each head as it is)."""
    dev = device_of(impl)
    rows, cpu = layout(spec, dev), layout(spec)
    ops = make_ops(impl, dev).decoder
    d = 40
    x = near_rows(cpu, d, seed=1)
    y, y_ref = form_of(near_rows(cpu, d, seed=2), cpu, True, 3)
    w = torch.randn(d, generator=torch.Generator().manual_seed(d)).abs() + 0.5
    for post_w, ww, ys in ((w, None, None), (None, w, 0.4)):
        h_ref = reference_of(x if ww is None else norm_rows_reference(x, None, None, None, ww, 1e-6, False, cpu,
                                                                      dtype=torch.float32)[1], cpu, True, 4)
        rx, rh = norm_rows_reference(x, y, w, post_w, ww, 1e-6, False, cpu, y_ref, h_ref, y_scale=ys)
        gx, gh = ops.norm_rows(x.to(dev), y.to(dev), w.to(dev), to(post_w, dev), to(ww, dev), 1e-6, False, rows,
                               y_ref.to(dev), h_ref.to(dev), y_scale=ys)
        torch.testing.assert_close(gx.cpu(), rx, **F32)
        assert_form_close(gh, rh, cpu, h_ref)
    H, Hk, hd, rot = 3, 2, 12, 8
    n = (H + 2 * Hk) * hd
    qkv, qkv_ref = form_of(near_rows(cpu, n, seed=3), cpu, True, 5)
    pos = torch.arange(64, dtype=torch.float32)[:, None] / (1 + torch.arange(rot // 2))[None]
    cos, sin = torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1)  # [64, rot]
    g = torch.Generator().manual_seed(hd)
    for qn, kn in ((None, None), (torch.randn(H * hd, generator=g).abs() + 0.5, torch.randn(Hk * hd, generator=g).abs()
                                  + 0.5)):
        rk, rv = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
        rq = rope_rows_reference(qkv, None, cpu, cos, sin, qn, kn, 1e-6, False, H, Hk, rk, rv, qkv_ref)
        gk, gv = torch.empty(rows.R, Hk, hd, device=dev), torch.empty(rows.R, Hk, hd, device=dev)
        gq = ops.rope_rows(qkv.to(dev), None, rows, cos.to(dev), sin.to(dev), to(qn, dev), to(kn, dev), 1e-6, False,
                           H, Hk, gk, gv, qkv_ref.to(dev))
        for got, ref in ((gq, rq), (gk, rk), (gv, rv)):
            torch.testing.assert_close(got.cpu(), ref, **F32)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("act_name", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("I,bias", [(3, False), (67, True), (1537, False)])
@WITH_REF
def test_gated_rows(impl, spec, act_name, I, bias, with_ref):
    dev = device_of(impl)
    rows, cpu = layout(spec, dev), layout(spec)
    y, y_ref = form_of(near_rows(cpu, 2 * I, seed=4), cpu, with_ref, 6)
    a_ref = reference_of(near_rows(cpu, I, seed=7), cpu, with_ref, 8)
    b = torch.randn(2 * I, generator=torch.Generator().manual_seed(I)) if bias else None
    ref = gated_rows_reference(y, b, act_name, cpu, y_ref, a_ref)
    got = make_ops(impl, dev).decoder.gated_rows(y.to(dev), to(b, dev), act_name, rows, to(y_ref, dev),
                                                 to(a_ref, dev))
    assert_form_close(got, ref, cpu, a_ref)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("H,Hk,hd", [(6, 3, 24), (2, 1, 16)])  # a head size off the tiles' powers of two; G 2
@pytest.mark.parametrize("window,softcap", [(None, None), (5, 20.0)])  # (Gemma 2 has both at once)
@WITH_REF
def test_attention_rows(impl, spec, H, Hk, hd, window, softcap, with_ref):
    dev = device_of(impl)
    rows, cpu = layout(spec, dev), layout(spec)
    g = torch.Generator().manual_seed(H + hd)
    q = near_rows(cpu, H * hd, scale=1.0, seed=5).view(rows.R, H, hd)
    k = near_rows(cpu, Hk * hd, scale=1.0, seed=6).view(rows.R, Hk, hd)
    v = near_rows(cpu, Hk * hd, scale=1.0, seed=7).view(rows.R, Hk, hd)
    kept = rows.lead == 0 and rows.pos0 > 0
    prefix = (torch.randn(1, rows.pos0, Hk, hd, generator=g), torch.randn(1, rows.pos0, Hk, hd, generator=g)) \
        if kept else None
    math_attn = Attention("math", hd ** -0.5, softcap, torch.float32, "cpu")
    o_ref = reference_of(attention_rows_reference(math_attn, q, k, v, cpu, window, prefix, dtype=torch.float32), cpu,
                         with_ref, 9)
    ref = attention_rows_reference(math_attn, q, k, v, cpu, window, prefix, o_ref)
    kind = {"torch": "math", "cpp": "cpp", "triton": "triton"}[impl]
    attn = Attention(kind, hd ** -0.5, softcap, torch.float32, dev, attention_kernels(kind))
    got = attn.rows(q.to(dev), k.to(dev), v.to(dev), rows, window,
                    None if prefix is None else tuple(t.to(dev) for t in prefix), to(o_ref, dev))
    assert_form_close(got, ref, cpu, o_ref)


@pytest.mark.parametrize("B,P,d,V,anchors", [(1, 3, 16, 50, None), (4, 5, 40, 300, None),
                                             (5, 2, 24, 1100, [0, 0, 2, 2, 2])])
@pytest.mark.parametrize("softcap", [None, 30.0])
@WITH_REF
def test_span_head_rows(impl, B, P, d, V, anchors, softcap, with_ref):
    dev = device_of(impl)
    g = torch.Generator().manual_seed(V)
    rows = RowLayout.build(0, B, P, 0, anchors)  # the span rows, as a layout: for the value slots and the form
    h = near_rows(rows, d, scale=2.0, seed=V)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    h_ref = reference_of(h, rows, with_ref, 10)
    # the reference logits: the reference hidden states' float32 product with the weights
    z_ref = None if h_ref is None else (h_ref @ w.float().t()).view(-1, P, V)
    hl = rows.batch(to_rows(h, rows, ref=h_ref))
    t = torch.randint(0, V, (P,), generator=g)
    ref = rows_logprobs(hl, w, t, rows.anchor, softcap, z_ref, rows.value_slot)
    got = make_ops(impl, dev).step.span_head_rows(hl.to(dev), w.to(dev), t.to(dev), rows.anchor.to(dev),
                                                  softcap=softcap, z_ref=to(z_ref, dev),
                                                  value_slot=rows.value_slot.to(dev))
    torch.testing.assert_close(got.cpu(), ref, **F32)
    # the differences between rows carry the perturbation: each row's change from its anchor to 1 % of its size
    a = rows.anchor
    dr, dg = ref - ref[a], got.cpu() - got.cpu()[a]
    assert float((dg - dr).abs().max()) <= 1e-2 * float(dr.abs().max()) + 1e-5
    if with_ref:  # against the float32 logits of the rows themselves: the reference takes the values' rounding away
        exact = torch.log_softmax((h @ w.float().t()).view(B, P, V) if softcap is None else
                                  softcap * torch.tanh((h @ w.float().t()).view(B, P, V) / softcap), -1)
        exact = exact.gather(-1, t.view(1, P, 1).expand(B, P, 1)).squeeze(-1)
        assert float((ref - exact).abs().max()) < 1e-3


def test_layout_refuses_bad_anchors():
    with pytest.raises(ValueError, match="anchors"):
        RowLayout.build(0, 3, 2, 0, [0, 2, 2])  # row 1 names a later row
    with pytest.raises(ValueError, match="anchors"):
        RowLayout.build(0, 3, 2, 0, [0, 0, 1])  # row 2's anchor is itself a difference


def test_value_slots_and_the_value_layout():
    rows = RowLayout.build(2, 5, 3, 2, [0, 0, 2, 2, 4])
    assert rows.value_slot.tolist() == [0, 0, 1, 0, 2] and rows.values == 2 + 3 * 3
    v = rows.value_layout()
    assert (v.lead, v.B, v.T, v.pos0, v.anchors) == (2, 3, 3, 2, (0, 1, 2)) and v.R == rows.values
