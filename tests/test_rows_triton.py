"""The Triton forms of the difference form's ops (kernels/norm_rows.py, rope_rows.py, gated_rows.py, attention.py's
attention_rows, span_logprobs.py's span_logprobs_rows) on what tests/test_rows_ops.py's shared parity contract does
not reach: several programs and tiles (position-major row order across programs, multi-tile attention with windows,
batch-row groups that recompute their anchor, span tiles of several positions), each without and with the value rows'
float32 references (read through a row stride: references that are strided views, their other columns NaN; the span
head's reference logits of several value rows, tiles of one position and of many), the activations' tails, and the
launchers' refusals. Tolerances as tests/test_rows_ops.py (its helpers), unless a test says otherwise.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from sicl_fast.errors import SiclError
from sicl_fast.step.logprobs import rows_logprobs
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import RowLayout, gated_rows_reference, norm_rows_reference, rope_rows_reference, to_rows
from test_ops import device_of, why_unavailable
from test_rows_ops import F32, WITH_REF, assert_form_close, near_rows, reference_of

# more rows than one interpreter program takes (64), anchors of two packed prompts, lead rows
BIG = (5, 9, 13, 5, [0, 0, 0, 0, 4, 4, 4, 4, 4])


@pytest.fixture(scope="module")
def K():
    reason = why_unavailable("triton")
    if reason:
        pytest.skip(reason)
    from sicl_fast.ops.triton_ops import load_kernels

    return load_kernels()


def dev():
    return device_of("triton")


def layout(spec, device="cpu") -> RowLayout:
    lead, B, T, pos0, anchors = spec
    return RowLayout.build(lead, B, T, pos0, anchors, device=device)


def strided(ref: torch.Tensor | None) -> torch.Tensor | None:
    """ref [V, k] as a view with row stride k + 3 whose other columns are NaN (a column read beyond a row's k, or a
    row stride taken for k, shows up as NaN)."""
    if ref is None:
        return None
    big = torch.full((ref.shape[0], ref.shape[1] + 3), math.nan)
    big[:, :ref.shape[1]] = ref
    return big[:, :ref.shape[1]]


def to_dev(t):
    return None if t is None else t.to(dev())


@WITH_REF
def test_norm_rows_many_programs(K, with_ref):
    rows, cpu, d = layout(BIG, dev()), layout(BIG), 72
    g = torch.Generator().manual_seed(0)
    x, yf = near_rows(cpu, d, seed=1), near_rows(cpu, d, seed=2)
    y_ref = reference_of(yf, cpu, with_ref, 3)
    y = to_rows(yf, cpu, ref=y_ref)
    h_ref = reference_of(near_rows(cpu, d, scale=1.0, seed=4), cpu, with_ref, 5)
    w, post_w, b = (torch.randn(d, generator=g).abs() + 0.5 for _ in range(3))
    rx, rh = norm_rows_reference(x, y, b, post_w, w, 1e-6, True, cpu, y_ref, h_ref)
    gx, gh = K.norm_rows(x.to(dev()), y.to(dev()), b.to(dev()), post_w.to(dev()), w.to(dev()), 1e-6, True, rows,
                         to_dev(strided(y_ref)), to_dev(strided(h_ref)))
    torch.testing.assert_close(gx.cpu(), rx, **F32)
    assert_form_close(gh, rh, cpu, h_ref)


@WITH_REF
def test_rope_rows_many_programs(K, with_ref):
    rows, cpu, H, Hk, hd = layout(BIG, dev()), layout(BIG), 6, 2, 16
    g = torch.Generator().manual_seed(1)
    f = near_rows(cpu, (H + 2 * Hk) * hd, seed=3)
    qkv_ref = reference_of(f, cpu, with_ref, 6)
    qkv = to_rows(f, cpu, ref=qkv_ref)
    pos = torch.arange(32, dtype=torch.float32)[:, None] / (1 + torch.arange(hd // 2))[None]
    cos, sin = torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1)
    qn, kn = torch.randn(hd, generator=g).abs() + 0.5, torch.randn(hd, generator=g).abs() + 0.5
    rk, rv = torch.empty(rows.R, Hk, hd), torch.empty(rows.R, Hk, hd)
    rq = rope_rows_reference(qkv, None, cpu, cos, sin, qn, kn, 1e-6, False, H, Hk, rk, rv, qkv_ref)
    gk = torch.full((rows.R, Hk, hd), math.nan, device=dev())
    gv = torch.full((rows.R, Hk, hd), math.nan, device=dev())
    gq = K.rope_rows(qkv.to(dev()), None, rows, cos.to(dev()), sin.to(dev()), qn.to(dev()), kn.to(dev()), 1e-6,
                     False, H, Hk, gk, gv, to_dev(strided(qkv_ref)))
    for got, ref in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(got.cpu(), ref, **F32)


@pytest.mark.parametrize("act_name,with_ref", [("silu", False), ("gelu_pytorch_tanh", False), ("silu", True),
                                               ("gelu_pytorch_tanh", True)])
def test_gated_rows_many_programs(K, act_name, with_ref):
    rows, cpu, I = layout(BIG, dev()), layout(BIG), 40
    yf = near_rows(cpu, 2 * I, scale=1.5, seed=4)
    y_ref = reference_of(yf, cpu, with_ref, 7)
    y = to_rows(yf, cpu, ref=y_ref)
    a_ref = reference_of(near_rows(cpu, I, seed=8), cpu, with_ref, 9)
    b = torch.randn(2 * I, generator=torch.Generator().manual_seed(2))
    ref = gated_rows_reference(y, b, act_name, cpu, y_ref, a_ref)
    got = K.gated_rows(y.to(dev()), b.to(dev()), act_name, rows, to_dev(strided(y_ref)), to_dev(strided(a_ref)))
    assert_form_close(got, ref, cpu, a_ref)


# float64 activations without cancellation (0.5 g (1 + erf(g / sqrt 2)) in float64 still loses the tail below -6)
EXACT_ACT = {"gelu": lambda g: 0.5 * g * torch.special.erfc(-g / 2 ** 0.5), "silu": F.silu}


def tail_rows():
    """Gates from -9 to 3 (up 1) in a batch of 3 rows: rows 1 and 2 small steps from row 0. -> (layout, y [R, 2])."""
    rows = layout((0, 3, 128, 0, None))
    g = torch.linspace(-9.0, 3.0, 128)
    gate = torch.stack([g, g + 3e-3 * torch.sin(7 * g), g - 2e-3 * torch.cos(5 * g)])  # [B, T]
    return rows, to_rows(torch.stack([gate, torch.ones_like(gate)], -1).reshape(3 * 128, 2), rows)  # I = 1


@pytest.mark.parametrize("act_name", list(EXACT_ACT))
def test_gated_rows_tail_is_exact(K, act_name):
    """SiLU and GELU-erf down their tails: the kernel's differences are those of the float64 activation, rounded to
    bf16 (half a bf16 ulp), plus what float32 evaluation costs each of the two values: a few ulps of the anchor's
    value, times the activation's condition in the tail (|g a'(g) / a| ~ g^2: the exponent's rounding is amplified by
    exp). GELU-erf is written without cancellation (kernels._math.gated_act); 0.5 g (1 + erf) would lose the tail."""
    rows, y = tail_rows()
    got = K.gated_rows(y.to(dev()), None, act_name, layout((0, 3, 128, 0, None), dev())).cpu().double().view(3, 128)
    yf = y.double().view(3, 128, 2)
    gf = torch.stack([yf[0, :, 0], yf[0, :, 0] + yf[1, :, 0], yf[0, :, 0] + yf[2, :, 0]])
    a = EXACT_ACT[act_name](gf)  # up is 1 on every row
    exact = torch.cat([a[:1], a[1:] - a[:1]])
    err = (got - exact).abs()
    ulps = 8 + 2 * gf[:1] ** 2
    assert bool((err <= exact.abs() * 2 ** -8 + ulps * 2 ** -23 * a[:1].abs() + 1e-30).all()), float(err.max())


def test_gated_rows_gelu_tanh_tail_is_torchs(K):
    """GELU-tanh down its tail as the reference computes it: torch's float32 0.5 g (1 + tanh z), whose 1 + tanh
    rounds to a multiple of 2^-24 below g ~ -3 (a value 13 % off at -4.9, all of it below -5.1, where torch's tanh
    is -1): the kernel shares that rounding (kernels._math.tanh_torch), so its differences are the reference's within
    the contract's tolerance (tests/test_rows_ops.py), as the C++ form's are."""
    rows, y = tail_rows()
    got = K.gated_rows(y.to(dev()), None, "gelu_pytorch_tanh", layout((0, 3, 128, 0, None), dev()))
    assert_form_close(got, gated_rows_reference(y, None, "gelu_pytorch_tanh", rows), rows)


ATTN_CASES = [  # (lead, B, T, pos0, anchors), kept prefix, window, softcap, batch rows a program, with references
    ((20, 3, 40, 20, None), False, None, None, 1, False),  # every difference row's program computes its anchor again
    ((20, 3, 40, 20, None), False, 7, 20.0, 2, True),  # the second group starts on a difference row
    ((0, 4, 35, 18, [0, 0, 2, 2]), True, 9, None, 3, True),  # a new anchor inside a group; one outside the next
    ((0, 5, 33, 0, [0, 0, 0, 3, 3]), False, None, 30.0, None, False),  # the launcher's choice: one group of all rows
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=["lead", "lead-window-cap-ref", "kept-packed-window-ref",
                                                  "packed-cap"])
def test_attention_rows_tiles_and_groups(K, case):
    """Tiles of 16 (several query and key tiles, window bounds inside the prefix and the row), and batch-row groups
    that hold an anchor, compute one again, or take a new one; the value rows (lead rows, and the anchors of two
    packed prompts) against their reference where the case says so."""
    spec, kept, window, softcap, rows_per_program, with_ref = case
    rows, cpu, H, Hk, hd = layout(spec, dev()), layout(spec), 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = near_rows(cpu, H * hd, scale=1.0, seed=5).view(rows.R, H, hd)
    k = near_rows(cpu, Hk * hd, scale=1.0, seed=6).view(rows.R, Hk, hd)
    v = near_rows(cpu, Hk * hd, scale=1.0, seed=7).view(rows.R, Hk, hd)
    prefix = (torch.randn(1, rows.pos0, Hk, hd, generator=g), torch.randn(1, rows.pos0, Hk, hd, generator=g)) \
        if kept else None
    math_attn = Attention("math", hd ** -0.5, softcap, torch.float32, "cpu")
    o_ref = reference_of(attention_rows_reference(math_attn, q, k, v, cpu, window, prefix, dtype=torch.float32), cpu,
                         with_ref, 10)
    ref = attention_rows_reference(math_attn, q, k, v, cpu, window, prefix, o_ref)
    got = K.attention_rows(q.to(dev()), k.to(dev()), v.to(dev()), rows,
                           None if prefix is None else tuple(t.to(dev()) for t in prefix), hd ** -0.5, softcap, window,
                           to_dev(strided(o_ref)), block=16, rows_per_program=rows_per_program)
    assert_form_close(got, ref, cpu, o_ref)


@pytest.mark.parametrize("B,P,anchors,config,splits", [
    (3, 11, None, {"BLOCK_M": 16, "BLOCK_V": 64, "BLOCK_K": 16}, 3),  # 5 positions a tile, 3 tiles, padded rows
    (5, 4, [0, 0, 2, 2, 2], {"BLOCK_M": 16, "BLOCK_V": 128, "BLOCK_K": 32}, 2),  # packed anchors, one position a tile
    (6, 5, [0, 1, 1, 3, 3, 3], {"BLOCK_M": 16, "BLOCK_V": 64, "BLOCK_K": 16}, 2),  # 3 value rows, 2 positions a tile
    (9, 7, None, None, None),  # SmolLM2's batch (N 8): the launcher's tile
])
def test_span_head_rows_tiles(K, B, P, anchors, config, splits):
    """Span tiles of one and of several positions, without and with the value rows' reference logits (z_ref: a
    strided view, its other entries NaN; value batch row j's at z_ref[value_slot[j]])."""
    d, V = 40, 700
    g = torch.Generator().manual_seed(B)
    rows = RowLayout.build(0, B, P, 0, anchors)
    anchor = rows.anchor
    h = 2.0 * torch.randn(B, P, d, generator=g)
    for j, a in enumerate(anchor.tolist()):
        if a != j:
            h[j] = h[a] + 1e-2 * torch.randn(P, d, generator=g)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, V, (P,), generator=g)
    h_ref = reference_of(h.view(B * P, d), rows, True, B)
    z_ref = (h_ref @ w.float().t()).view(-1, P, V)
    z_view = torch.full((2 * z_ref.shape[0], P + 1, V + 5), math.nan)
    z_view[::2, :P, :V] = z_ref
    z_view = z_view[::2, :P, :V]  # batch, position and vocabulary strides of another tensor
    for hr, zr in ((None, None), (h_ref, z_ref)):
        hl = rows.batch(to_rows(h.view(B * P, d), rows, ref=hr))
        for softcap in (None, 30.0):
            ref = rows_logprobs(hl, w, t, anchor, softcap, zr, rows.value_slot)
            got = K.span_logprobs_rows(hl.to(dev()), w.to(dev()), t.to(dev()), anchor.to(dev()), softcap=softcap,
                                       z_ref=None if zr is None else z_view.to(dev()),
                                       value_slot=rows.value_slot.to(dev()), config=config, splits=splits)
            torch.testing.assert_close(got.cpu(), ref, **F32)


def test_refusals(K):
    rows = layout((0, 2, 3, 0, None), dev())
    x = torch.zeros(6, 8, device=dev())
    w = torch.ones(8, device=dev())
    with pytest.raises(SiclError, match="rows"):
        K.norm_rows(x[:5], None, None, None, w, 1e-6, False, rows)
    with pytest.raises(SiclError, match="bfloat16"):
        K.gated_rows(x, None, "silu", rows)
    with pytest.raises(SiclError, match="activation"):
        K.gated_rows(x.to(torch.bfloat16), None, "relu", rows)
    h = torch.zeros(2, 3, 8, dtype=torch.bfloat16, device=dev())
    anchor = torch.zeros(2, dtype=torch.int64, device=dev())
    with pytest.raises(SiclError, match="BLOCK_M"):
        K.span_logprobs_rows(h[:1].expand(32, 3, 8), h[0], torch.zeros(3, dtype=torch.int64), anchor[:1].expand(32),
                             config={"BLOCK_M": 16})
    # the references: [V, k] float32 (V = rows.values, 3 here), the span head's with its value slots
    with pytest.raises(SiclError, match="h_ref"):
        K.norm_rows(x, None, None, None, w, 1e-6, False, rows, None, torch.zeros(6, 8, device=dev()))
    with pytest.raises(SiclError, match="y_ref"):
        K.gated_rows(x.to(torch.bfloat16), None, "silu", rows, torch.zeros(3, 8, dtype=torch.bfloat16, device=dev()))
    with pytest.raises(SiclError, match="o_ref"):
        K.attention_rows(x.view(6, 2, 4), x.view(6, 2, 4), x.view(6, 2, 4), rows, None, 0.5, None, None,
                         torch.zeros(3, 4, device=dev()))
    tg = torch.zeros(3, dtype=torch.int64, device=dev())
    z = torch.zeros(1, 3, 8, device=dev())
    with pytest.raises(SiclError, match="value_slot"):
        K.span_logprobs_rows(h, h[0], tg, anchor, z_ref=z)
    with pytest.raises(SiclError, match="z_ref"):
        K.span_logprobs_rows(h, h[0], tg, anchor, z_ref=torch.zeros(3, 3, 8, device=dev()), value_slot=anchor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_bit_for_bit(K, dtype):
    """kernels/fp8_rows.py against the reference (sicl_fast.models.weights.fp8_rows: torch's conversion) bit for bit:
    every e4m3 value, every midpoint between two (ties to even) and the floats either side of it, in a row whose
    scale is 1 (its largest magnitude 448), and rows of other scales (2^-30 .. 2^30, a zero row, values that become
    e4m3 subnormals, more columns than a program's block)."""
    from sicl_fast.models.weights import fp8_rows

    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    v = e4m3[torch.isfinite(e4m3)].unique()
    mid = (v[1:] + v[:-1]) / 2
    pts = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))])
    pts = torch.cat([pts, -pts])
    one = torch.cat([pts[pts.abs() <= 448], torch.tensor([448.0])])[None]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 2500, generator=g) * torch.logspace(-9, 9, 6, base=8.0)[:, None]
    rows[1] = 0
    rows[2, ::5] *= 1e-5  # e4m3 subnormals after the scale
    for x in (one if dtype == torch.float32 else one.bfloat16().float().unique()[None].clamp(-448, 448), rows):
        x = x.to(dtype)
        q, scale = K.fp8_rows(x.to(dev()))
        q_ref, scale_ref = fp8_rows(x)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], 1)
        assert torch.equal(scale.cpu(), scale_ref)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
