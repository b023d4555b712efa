"""The difference form's ops (sicl_fast.models.rows: norm_rows, rope_rows, gated_rows; Attention.rows; StepOps
span_head_rows) of every implementation against the torch references, on odd shapes and layouts: lead rows or
not, one prompt (every row anchored at row 0) or packed blocks (anchors at each block's first row), a batch of one.

Tolerances, and why:
  float32 outputs (the residual x', rotary's q and the K / V written, the span log-probs): rtol 1e-5 / atol 1e-5
      (sums and rsqrt / exp / tanh in another order or form than torch's; the inputs are the same bf16 bits).
  difference-form outputs (bf16): each value within one bf16 ulp of the reference's (2^-7 relative, both round a
      float32 that may differ in its last bits) plus 1e-6; each difference within one bf16 ulp of the reference's
      difference plus 16 float32 ulps of its anchor's value (a difference inherits the rounding of the two float32
      rows it is taken between).
"""
import math

import pytest
import torch

from sicl_fast.logprobs import rows_logprobs
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import (RowLayout, from_rows, gated_rows_reference, is_value, norm_rows_reference,
                                   rope_rows_reference, to_rows)
from sicl_fast.ops import make_ops
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


def assert_form_close(got: torch.Tensor, ref: torch.Tensor, rows: RowLayout) -> None:
    """Difference-form outputs (module docstring's tolerance)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    got, ref = got.detach().cpu().float(), ref.float()
    value = torch.ones(rows.R, dtype=torch.bool)
    rows.batch(value)[:] = is_value(rows.anchor.cpu())[:, None]
    anchor_rows = from_rows(ref.to(torch.bfloat16), rows) - torch.where(value[:, None], 0.0, ref)  # each row's anchor
    err = (got - ref).abs()
    bound = ref.abs() * 2 ** -7 + 1e-6 + torch.where(value[:, None], 0.0, 16 * 2 ** -23 * anchor_rows.abs())
    assert bool((err <= bound).all()), float((err - bound).max())


def low(x: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    return to_rows(x, rows)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("gemma,post,bias", [(False, False, False), (False, False, True), (True, True, False)])
@pytest.mark.parametrize("d", [8, 131])
def test_norm_rows(impl, spec, gemma, post, bias, d):
    dev = device_of(impl)
    rows = layout(spec, dev)
    g = torch.Generator().manual_seed(d)
    x = near_rows(rows, d, seed=1)
    y = low(near_rows(rows, d, seed=2), rows)
    w = torch.randn(d, generator=g).abs() + 0.5
    post_w = torch.randn(d, generator=g).abs() + 0.5 if post else None
    b = torch.randn(d, generator=g) if bias else None
    ops = make_ops(impl, dev).decoder
    for yy in (None, y):
        rx, rh = norm_rows_reference(x, yy, b, post_w, w, 1e-6, gemma, layout(spec))
        to = lambda t: None if t is None else t.to(dev)  # noqa: E731
        gx, gh = ops.norm_rows(x.to(dev), to(yy), to(b), to(post_w), w.to(dev), 1e-6, gemma, rows)
        torch.testing.assert_close(gx.cpu(), rx, **F32)
        assert_form_close(gh, rh, layout(spec))


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("H,Hk,hd", [(4, 2, 8), (3, 1, 24), (2, 2, 64)])
@pytest.mark.parametrize("qk_norm,gemma,bias", [(False, False, True), (True, False, False), (True, True, False)])
def test_rope_rows(impl, spec, H, Hk, hd, qk_norm, gemma, bias):
    dev = device_of(impl)
    rows = layout(spec, dev)
    n = (H + 2 * Hk) * hd
    g = torch.Generator().manual_seed(hd)
    qkv = low(near_rows(rows, n, seed=3), rows)
    b = torch.randn(n, generator=g) if bias else None
    pos = torch.arange(64, dtype=torch.float32)[:, None] / (1 + torch.arange(hd // 2))[None]
    cos, sin = torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1)  # [64, hd]
    qn = torch.randn(hd, generator=g).abs() + 0.5 if qk_norm else None
    kn = torch.randn(hd, generator=g).abs() + 0.5 if qk_norm else None
    rk, rv = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
    rq = rope_rows_reference(qkv, b, layout(spec), cos, sin, qn, kn, 1e-6, gemma, H, Hk, rk, rv)
    gk = torch.full((rows.R, Hk, hd), math.nan, device=dev)
    gv = torch.full((rows.R, Hk, hd), math.nan, device=dev)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    gq = make_ops(impl, dev).decoder.rope_rows(qkv.to(dev), to(b), rows, cos.to(dev), sin.to(dev), to(qn), to(kn),
                                              1e-6, gemma, H, Hk, gk, gv)
    for got, ref in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(got.cpu(), ref, **F32)


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("act_name", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("I,bias", [(3, False), (67, True), (1537, False)])
def test_gated_rows(impl, spec, act_name, I, bias):
    dev = device_of(impl)
    rows = layout(spec, dev)
    y = low(near_rows(rows, 2 * I, seed=4), rows)
    b = torch.randn(2 * I, generator=torch.Generator().manual_seed(I)) if bias else None
    ref = gated_rows_reference(y, b, act_name, layout(spec))
    got = make_ops(impl, dev).decoder.gated_rows(y.to(dev), None if b is None else b.to(dev), act_name, rows)
    assert_form_close(got, ref, layout(spec))


@pytest.mark.parametrize("spec", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("H,Hk,hd", [(4, 2, 16), (6, 3, 24)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0)])
def test_attention_rows(impl, spec, H, Hk, hd, window, softcap):
    dev = device_of(impl)
    rows = layout(spec, dev)
    g = torch.Generator().manual_seed(H + hd)
    q = near_rows(rows, H * hd, scale=1.0, seed=5).view(rows.R, H, hd)
    k = near_rows(rows, Hk * hd, scale=1.0, seed=6).view(rows.R, Hk, hd)
    v = near_rows(rows, Hk * hd, scale=1.0, seed=7).view(rows.R, Hk, hd)
    kept = rows.lead == 0 and rows.pos0 > 0
    prefix = (torch.randn(1, rows.pos0, Hk, hd, generator=g), torch.randn(1, rows.pos0, Hk, hd, generator=g)) \
        if kept else None
    ref = attention_rows_reference(Attention("math", hd ** -0.5, softcap, torch.float32, "cpu"), q, k, v,
                                   layout(spec), window, prefix)
    attn = Attention({"torch": "math", "cpp": "cpp", "triton": "triton"}[impl], hd ** -0.5, softcap, torch.float32,
                     dev)
    got = attn.rows(q.to(dev), k.to(dev), v.to(dev), rows, window,
                    None if prefix is None else tuple(t.to(dev) for t in prefix))
    assert_form_close(got, ref, layout(spec))


@pytest.mark.parametrize("B,P,d,V,anchors", [(1, 3, 16, 50, None), (4, 5, 40, 300, None),
                                             (5, 2, 24, 1100, [0, 0, 2, 2, 2])])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_span_head_rows(impl, B, P, d, V, anchors, softcap):
    dev = device_of(impl)
    g = torch.Generator().manual_seed(V)
    anchor = torch.tensor(anchors if anchors is not None else [0] * B)
    h = 2.0 * torch.randn(B, P, d, generator=g)
    for j, a in enumerate(anchor.tolist()):
        if a != j:
            h[j] = h[a] + 1e-2 * torch.randn(P, d, generator=g)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    hl = torch.where(is_value(anchor)[:, None, None], h, h - h[anchor]).to(torch.bfloat16)
    t = torch.randint(0, V, (P,), generator=g)
    ref = rows_logprobs(hl, w, t, anchor, softcap)
    got = make_ops(impl, dev).step.span_head_rows(hl.to(dev), w.to(dev), t.to(dev), anchor.to(dev), softcap=softcap)
    torch.testing.assert_close(got.cpu(), ref, **F32)
    # the differences between rows carry the perturbation: each row's change from its anchor to 1 % of its size
    dr, dg = ref - ref[anchor], got.cpu() - got.cpu()[anchor]
    assert float((dg - dr).abs().max()) <= 1e-2 * float(dr.abs().max()) + 1e-5


def test_layout_refuses_bad_anchors():
    with pytest.raises(ValueError, match="anchors"):
        RowLayout.build(0, 3, 2, 0, [0, 2, 2])  # row 1 names a later row
    with pytest.raises(ValueError, match="anchors"):
        RowLayout.build(0, 3, 2, 0, [0, 0, 1])  # row 2's anchor is itself a difference
