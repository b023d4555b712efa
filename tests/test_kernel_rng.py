"""The in-kernel noise: bit-identical to sicl_fast.step.rng, good normals, and GPU code that keeps the bits.

Triton runs under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it when there is no GPU).
"""
import math

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sicl_fast.step import rng  # noqa: E402
from conftest import TRITON_DEVICE as DEV  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("seed,step,shape", [(0, 0, (3, 5, 37)), (2**32 - 1, 7, (2, 3, 129)),
                                             (12345, 2**31 + 5, (1, 1, 1000))])
def test_triton_randn_bit_identical_to_torch_reference(K, seed, step, shape):
    got = K.randn(seed, step, *shape, device=DEV)
    ref = rng.directions(seed, step, *shape)
    assert torch.equal(bits(got), bits(ref))


def test_edge_integers_take_every_branch():
    """Counters whose uniforms hit the clamp (u1 < 1e-7), u2 = 0 and the 1/8, 1/4, 1/2 fold points."""
    i = torch.tensor([0, 1, 200, 2**31 - 1, 2**29, 2**30, 2**28, 2**29 + 1, 2**28 - 1, 3 * 2**28, 5 * 2**28,
                      7 * 2**28, 12345678], dtype=torch.int64)
    u = rng._uint_to_uniform(i)
    z = rng.box_muller(u, u)
    exact = np.sqrt(-2 * np.log(np.maximum(u.double().numpy(), float(np.float32(1e-7))))) * np.cos(
        2 * np.pi * u.double().numpy())
    assert np.allclose(z.double().numpy(), exact, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(z).all()


def test_transform_accuracy_against_float64():
    """The polynomial log / cos: within a few float32 ulp of the exact float64 transform of the same uniforms."""
    c = torch.arange(50_000, dtype=torch.int64) * 40009
    i1, i2, _, _ = rng.philox4x32(c, 17, 4)
    u1, u2 = rng._uint_to_uniform(i1), rng._uint_to_uniform(i2)
    u1c = torch.clamp(u1, min=float(np.float32(1e-7))).double()
    log = rng.log_f32(torch.clamp(u1, min=float(np.float32(1e-7))))
    assert ((log.double() - torch.log(u1c)).abs() / torch.log(u1c).abs()).max() < 4 * 2.0**-24
    cos = rng.cos_2pi_f32(u2)
    assert (cos.double() - torch.cos(2 * math.pi * u2.double())).abs().max() < 3 * 2.0**-24
    z = rng.box_muller(u1, u2).double()
    exact = torch.sqrt(-2 * torch.log(u1c)) * torch.cos(2 * math.pi * u2.double())
    assert ((z - exact).abs() / exact.abs().clamp(min=1.0)).max() < 1e-6


def test_normal_quality_one_million_samples(K):
    """Mean, variance, tails and Kolmogorov-Smirnov on 2**20 kernel samples (bounds ~5 sigma)."""
    n = 1 << 20
    z = K.randn(99, 1, 1, 1, n, device=DEV).double().cpu().view(-1)
    # the kernel's samples are the reference's (checked bitwise on a slice; the whole run is slow in torch)
    assert torch.equal(bits(z[:4096].float()), bits(rng.directions(99, 1, 1, 1, 4096).view(-1)))
    mean, var = float(z.mean()), float(z.var())
    assert abs(mean) < 5 / math.sqrt(n)
    assert abs(var - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((z**3).mean())) < 5 * math.sqrt(15 / n)  # skewness
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96 / n)  # kurtosis
    for t in (1.0, 2.0, 3.0, 4.0):
        p = math.erfc(t / math.sqrt(2))  # P(|z| > t)
        got = float((z.abs() > t).double().mean())
        assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-6, (t, got, p)
    # Box-Muller with u1 >= 1e-7 (Triton's clamp) cannot exceed sqrt(-2 ln 1e-7) = 5.68
    assert float(z.abs().max()) <= math.sqrt(-2 * math.log(1e-7)) + 1e-4
    zs, _ = torch.sort(z)
    cdf = 0.5 * torch.erfc(-zs / math.sqrt(2))
    k = torch.arange(1, n + 1, dtype=torch.float64)
    ks = float(torch.maximum(k / n - cdf, cdf - (k - 1) / n).max())
    assert ks < 1.95 / math.sqrt(n)  # 0.1% critical value


def test_step_and_seed_change_the_stream(K):
    a = K.randn(5, 0, 2, 3, 64, device=DEV)
    assert not torch.equal(a, K.randn(5, 1, 2, 3, 64, device=DEV))
    assert not torch.equal(a, K.randn(6, 0, 2, 3, 64, device=DEV))
    # counters are laid out (i, r, c): direction i of a longer block starts at i * R * d
    U = rng.directions(5, 0, 2, 3, 64)
    flat = K.randn(5, 0, 1, 1, 2 * 3 * 64, device=DEV).view(2, 3, 64)
    assert torch.equal(bits(U), bits(flat))


def test_counter_range_checked(K):
    from sicl_fast.errors import SiclError

    with pytest.raises(SiclError, match="int32 Philox counters"):
        K.randn(0, 0, 2**16, 2**10, 2**6, device=DEV)


AOT_KERNELS = ["randn", "perturb", "zo_step"]


@pytest.fixture(scope="module")
def aot_ops():
    """{kernel: Counter of the float32 ops of its PTX} compiled for sm_90 (no GPU needed) with the configuration its
    launcher chooses at SmolLM2's shapes, through the compile cache that tests/test_sm90_configs.py fills
    (kernels/_configs.py: a child interpreter with the interpreter off and an empty Triton cache)."""
    pytest.importorskip("triton.backends.nvidia")
    from collections import Counter

    from sicl_fast.kernels import _configs

    cases = {}
    for c in _configs.suite_cases():
        if c.spec in AOT_KERNELS and c.aligned:
            cases.setdefault(c.spec, c)
    got = _configs.compile_cases(cases.values(), 90)
    return {name: Counter(got[c]["float_ops"]) for name, c in cases.items()}


def test_aot_specs_match_the_kernels():
    """A changed kernel parameter must show up here, not as a broken ahead-of-time compile."""
    pytest.importorskip("triton.backends.nvidia")
    from sicl_fast.kernels import _aot

    assert _aot.spec_mismatches() == []


@pytest.mark.parametrize("name", AOT_KERNELS)
def test_gpu_code_has_no_fma_or_approximate_math(aot_ops, name):
    """Compiled for sm_90: only correctly rounded f32 ops, so the GPU reproduces the bits."""
    ops = aot_ops[name]
    assert ops["mul.rn.f32"] > 0 and ops["div.rn.f32"] > 0 and ops["sqrt.rn.f32"] > 0
    bad = {k: v for k, v in ops.items() if k.startswith(("fma", "rcp", "rsqrt", "ex2", "lg2")) or "approx" in k
           or "full" in k or "ftz" in k}
    assert not bad, bad
