"""The reference proxy against hand-computed values."""
import math

import pytest
import torch

from sicl_fast.errors import NumericalError, SiclError
from sicl_fast.step.proxy import proxy
from sicl_fast.formats.spans import span_offsets


def lp(*probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64)).float()


def test_hand_computed_three_spans():
    # spans: [0.5, 0.2] | [0.9] | [0.4, 0.8, 0.1]
    x = lp(0.5, 0.2, 0.9, 0.4, 0.8, 0.1)
    out = proxy(x, span_offsets([2, 1, 3]))
    c = [math.sqrt(0.5 * 0.2), 0.9, (0.4 * 0.8 * 0.1) ** (1 / 3)]
    C = sum(c) / 3
    # 0.1-quantile of 6 sorted values [0.1, 0.2, 0.4, 0.5, 0.8, 0.9]: rank 0.1 * 5 = 0.5 -> 0.1 + 0.5 * 0.1
    R = 0.15
    G = (max(0, c[1] - c[0]) + max(0, c[2] - c[1])) / 2
    assert out.c[0].tolist() == pytest.approx(c, rel=1e-6)
    assert float(out.C[0]) == pytest.approx(C, rel=1e-6)
    assert float(out.R[0]) == pytest.approx(R, rel=1e-6)
    assert float(out.G[0]) == pytest.approx(G, rel=1e-6)
    assert float(out.f[0]) == pytest.approx(0.6 * C + 0.3 * R + 0.1 * G, rel=1e-6)


def test_single_demo_has_no_gain():
    out = proxy(lp(0.25, 0.64), span_offsets([2]))
    assert float(out.G[0]) == 0.0
    assert float(out.C[0]) == pytest.approx(0.4, rel=1e-6)
    # quantile of [0.25, 0.64] at 0.1: 0.25 + 0.1 * 0.39
    assert float(out.R[0]) == pytest.approx(0.289, rel=1e-6)


def test_single_token_spans_and_weights():
    out = proxy(lp(0.3, 0.7, 0.6), span_offsets([1, 1, 1]), alpha=0.5, beta=0.25, gamma=0.25, q=0.5)
    assert out.c[0].tolist() == pytest.approx([0.3, 0.7, 0.6], rel=1e-6)
    G = (0.4 + 0.0) / 2
    R = 0.6  # median of three
    assert float(out.f[0]) == pytest.approx(0.5 * (1.6 / 3) + 0.25 * R + 0.25 * G, rel=1e-6)


def test_quantile_interpolation_matches_torch_quantile_on_random_rows():
    torch.manual_seed(1)
    x = -torch.rand(4, 37) * 5
    for q in (0.0, 0.1, 0.33, 1.0):
        out = proxy(x, span_offsets([10, 1, 26]), q=q)
        assert torch.allclose(out.R, torch.quantile(torch.exp(x), q, dim=1))


def test_batch_rows_are_independent():
    x = torch.cat([lp(0.5, 0.2, 0.9), lp(0.1, 0.1, 0.1)])
    out = proxy(x, span_offsets([2, 1]))
    one = proxy(x[1:], span_offsets([2, 1]))
    assert torch.equal(out.f[1:], one.f)
    assert float(out.f[0]) != float(out.f[1])


def test_bad_inputs():
    with pytest.raises(SiclError, match="offsets"):
        proxy(lp(0.5, 0.5), torch.tensor([0, 3]))
    with pytest.raises(SiclError, match="no tokens"):
        proxy(lp(0.5, 0.5), torch.tensor([0, 0, 2]))
    with pytest.raises(NumericalError, match="NaN"):
        proxy(torch.tensor([[float("nan"), -1.0]]), span_offsets([2]))
    with pytest.raises(SiclError, match="q must be"):
        proxy(lp(0.5), span_offsets([1]), q=1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_quantile_is_torch_quantile_bit_for_bit(dtype):
    """R takes the sorted values and torch.lerp on the device (no host read, a padded plan's count), and equals
    torch.quantile's linear interpolation exactly."""
    g = torch.Generator().manual_seed(7)
    for P in (1, 2, 3, 10, 37, 128):
        lp = (-torch.rand(5, P, generator=g) * 8).to(dtype)
        for q in (0.0, 0.1, 0.25, 0.37, 0.5, 0.9, 1.0):
            R = proxy(lp, span_offsets([P]), q=q).R
            assert torch.equal(R, torch.quantile(torch.exp(lp), q, dim=1, interpolation="linear")), (P, q)
