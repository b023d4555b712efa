"""The tensor cores' rounding of a float32 product, emulated in torch (sicl_fast.models.tensor_cores), and the Triton
attention's tf32x3 products against it (issue 53, item 6): the interpreter runs Triton's tl.dot in numpy's float32
whatever input_precision says, so the kernels split their operands into tf32 pieces themselves (kernels/_math.py's
split_tf32 / dot_tf32x3, the same code on a GPU), and the interpreter's result is the tensor cores' up to the
accumulation's rounding. Operands here carry a lo piece of their own sign (x = a tf32 value + 0.3 to 0.45 of its ulp),
the values v positive: the truncation of v's lo (tf32x3 drops its low bits) lowers every output a little, a bias of
about 2^-24 a value that float32's summation order (about 2^-21 at worst an element, between the kernel's online
softmax and the math path's, either sign) does not have: the mean signed gap tells the two roundings apart."""
import math

import pytest
import torch

from sicl_fast.errors import SiclError
from sicl_fast.models import tensor_cores as tc
from sicl_fast.models.attention import Attention, attention_rows_reference
from sicl_fast.models.rows import RowLayout
from test_ops import device_of, why_unavailable
from test_rows_ops import value_rows


def biased(*shape, seed: int = 0) -> torch.Tensor:
    """float32 values x = t + f ulp_tf32(t), t a tf32 value of a standard normal, f in [0.3, 0.45]: hi = t, lo of one
    sign with bits below tf32's."""
    g = torch.Generator().manual_seed(seed)
    t = tc.tf32_trunc(torch.randn(*shape, generator=g))
    ulp = torch.ldexp(torch.ones_like(t), torch.frexp(t)[1] - 11)
    return t + (0.3 + 0.15 * torch.rand(*shape, generator=g)) * ulp * t.sign()


def test_tf32_rounding_is_ptxs():
    """cvt.rna.tf32.f32: to nearest of 10 explicit mantissa bits, ties away from zero (a tie of either sign rounds
    out); a carry rounds up a binade; inf and NaN kept. The tensor core's read of a tf32 operand drops the low 13
    bits (toward zero)."""
    ulp = 2.0 ** -10
    x = torch.tensor([1 + ulp / 2, -(1 + ulp / 2), 1 + 1.5 * ulp, 1 + ulp / 2 - 2 ** -23, 2 - ulp / 4, 3.0,
                      math.inf, -math.inf, math.nan])
    got = tc.tf32_rna(x)
    want = [1 + ulp, -(1 + ulp), 1 + 2 * ulp, 1.0, 2.0, 3.0, math.inf, -math.inf]
    assert got[:-1].tolist() == want and math.isnan(got[-1])
    assert tc.tf32_trunc(torch.tensor([1 + ulp - 2 ** -23, -(1 + ulp - 2 ** -23)])).tolist() == [1.0, -1.0]
    r = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    hi, lo = tc.pieces(r, "tf32x3")
    assert torch.equal(tc.tf32_rna(hi), hi) and torch.equal(tc.tf32_trunc(lo), lo)
    assert float(((hi.double() + lo.double() - r.double()).abs() / r.double().abs()).max()) < 2 ** -21


@pytest.mark.parametrize("precision,bits", [("tf32x3", 20), ("bf16x3", 15), ("bf16x6", 22)])
def test_emulated_products_keep_their_bits(precision, bits):
    """Each precision's product within 2^-bits of the float64 product (relative to the sum of |a_i b_i|), and not
    IEEE float32's (the emulation rounds)."""
    a, b = biased(64, 128, seed=2), biased(128, 32, seed=3)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    got = tc.tc_matmul(a, b, precision)
    assert float(((got.double() - exact).abs() / scale).max()) < 2.0 ** -bits
    assert not torch.equal(got, a @ b)


def test_the_accumulation_model_truncates():
    """tc_accumulate: groups summed exactly, the accumulator rounded toward zero: on positive terms never above the
    float64 sum and within a float32 ulp of it a group; its error grows with K, where round-to-nearest's stays."""
    g = torch.Generator().manual_seed(4)
    a = tc.tf32_trunc(torch.rand(4, 4096, generator=g))
    b = tc.tf32_trunc(torch.rand(4096, 8, generator=g))
    exact = a.double() @ b.double()
    got = tc.tc_accumulate(a, b, 8).double()
    assert bool((got <= exact).all())
    assert float(((exact - got) / exact).max()) < (4096 / 8) * 2 ** -23
    assert float(((exact - got) / exact).mean()) > 4 * float(((a @ b).double() - exact).abs().div(exact).mean())
    assert torch.equal(tc.round_toward_zero(torch.tensor([1 + 2 ** -30, -(1 + 2 ** -30)], dtype=torch.float64)),
                       torch.tensor([1.0, -1.0]))


def test_the_interpreters_tf32x3_is_the_emulation():
    """kernels/_utils.tf32x3_matmul, which Triton's interpreter runs for tl.dot(..., input_precision='tf32x3'), is
    tc_matmul's 'tf32x3' to float32's summation order, on biased operands where both are 8x further from IEEE."""
    from sicl_fast.kernels._utils import tf32x3_matmul

    a, b = biased(48, 64, seed=13), biased(64, 40, seed=14)
    got = torch.from_numpy(tf32x3_matmul(a.numpy(), b.numpy()))
    want = tc.tc_matmul(a, b, "tf32x3")
    assert 8 * float((got - want).abs().mean()) < float((want - a @ b).abs().mean())
    torch.testing.assert_close(got, want, rtol=0, atol=2 ** -21 * float(want.abs().max()))
    nan = a.clone()
    nan[0, 0] = math.nan
    assert torch.isnan(torch.from_numpy(tf32x3_matmul(nan.numpy(), b.numpy()))[0]).all()


def test_an_unknown_precision_is_refused():
    with pytest.raises(SiclError, match="'tf32' is not one of"):
        tc.tc_matmul(torch.ones(2, 2), torch.ones(2, 2), "tf32")


@pytest.fixture(scope="module")
def K():
    """The Triton kernels under the interpreter: on a GPU the tensor cores' own accumulation (rounding toward zero)
    adds a bias of the size this file measures, and the kernels' GPU tests hold them to the math path instead."""
    reason = why_unavailable("triton")
    if reason:
        pytest.skip(reason)
    if device_of("triton") != "cpu":
        pytest.skip("the interpreter's parity (module docstring); on a GPU tests/test_ops.py and test_rows_triton.py")
    from sicl_fast.ops.triton_ops import load_kernels

    return load_kernels()


def bias(a: torch.Tensor, b: torch.Tensor) -> float:
    """|mean signed difference| of a from b (module docstring)."""
    return abs(float((a.cpu().double() - b.double()).mean()))


def test_prefix_attention_rounds_as_the_emulation(K):
    """The float32 prefix attention with tf32x3 products (the default) against the math path with the same rounding
    emulated, and with IEEE float32: the kernel's bias from the emulation 8x smaller than from IEEE; with precision
    'ieee' 2x the other way round (the kernel's online softmax has a bias of its own, about a third of tf32x3's);
    and within float32's summation order of the emulation anywhere."""
    dev = device_of("triton")
    B, T, a, H, Hk, hd = 2, 21, 13, 4, 2, 16
    q, k, v = biased(B, T, H, hd, seed=5), biased(B, T, Hk, hd, seed=6), biased(B, T, Hk, hd, seed=7).abs()
    prefix = (biased(1, a, Hk, hd, seed=8), biased(1, a, Hk, hd, seed=9).abs())
    math_at = {p: Attention("math", 0.3, None, torch.float32, "cpu", precision=p) for p in ("ieee", "tf32x3")}
    want = {p: att(q, k, v, a, None, prefix) for p, att in math_at.items()}
    to = lambda t: t.to(dev)  # noqa: E731
    for precision, other, factor in (("tf32x3", "ieee", 8), ("ieee", "tf32x3", 2)):
        got = K.prefix_attention(to(q), to(k), to(v), tuple(map(to, prefix)), a, None, 0.3, None, block=16,
                                 precision=precision)
        assert factor * bias(got, want[precision]) < bias(got, want[other]), precision
        torch.testing.assert_close(got.cpu(), want[precision], rtol=2 ** -20, atol=2 ** -21)


def test_attention_rows_rounds_as_the_emulation(K):
    """attention_rows (lead rows, a value batch row and a difference row) against the math path's float32 values with
    each rounding, taken as the value rows' reference o_ref: a value row's output is then bf16(o - o_ref), the gap
    itself. With tf32x3 products (the default) the bias from the emulation is 8x smaller than from IEEE; with
    'ieee' 2x the other way round (as the prefix attention's)."""
    dev = device_of("triton")
    spec = (9, 2, 24, 9, [0, 0])
    rows, cpu = RowLayout.build(*spec, device=dev), RowLayout.build(*spec)
    H, Hk, hd = 4, 2, 16
    q, k, v = biased(rows.R, H, hd, seed=10), biased(rows.R, Hk, hd, seed=11), biased(rows.R, Hk, hd, seed=12).abs()
    o_ref = {}
    for p in ("ieee", "tf32x3"):
        o = attention_rows_reference(Attention("math", 0.25, None, torch.float32, "cpu", precision=p), q, k, v,
                                     cpu, None, None, dtype=torch.float32)  # no reference: every row's value
        o_ref[p] = value_rows(o, cpu)
    for precision, other, factor in (("tf32x3", "ieee", 8), ("ieee", "tf32x3", 2)):
        gaps = [bias(value_rows(K.attention_rows(q.to(dev), k.to(dev), v.to(dev), rows, None, 0.25, None, None,
                                                 o_ref[p].to(dev), precision=precision).float().cpu(),
                                cpu), torch.zeros(())) for p in (precision, other)]
        assert factor * gaps[0] < gaps[1], (precision, gaps)
