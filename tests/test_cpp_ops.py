"""The C++ extension (sicl_fast._C via sicl_fast.cpp_ops) against the torch reference, and against Triton.

Build first: `python setup.py build_ext --inplace` (or `pip install -e .`). Without the extension these tests
skip, unless SICL_REQUIRE_CPP=1 turns the skip into a failure (for CI that builds it).

    randn / perturb: bit-identical to sicl_fast.rng / zo.perturb and to the Triton kernels
    update: rtol 1e-5 / atol 1e-6 against zo.update (same projection decision)
    proxy (float32): rtol 1e-5 / atol 1e-7 against sicl_fast.proxy.proxy
"""
import os


import pytest  # noqa: E402
import torch  # noqa: E402

from sicl_fast import cpp_ops, fused, rng, zo  # noqa: E402
from sicl_fast.ascent import CalibrationConfig  # noqa: E402
from sicl_fast.errors import NumericalError, SiclError  # noqa: E402
from sicl_fast.proxy import proxy as ref_proxy  # noqa: E402
from sicl_fast.proxy import span_offsets  # noqa: E402

if not cpp_ops.available():
    if os.environ.get("SICL_REQUIRE_CPP") == "1":
        raise RuntimeError(f"sicl_fast._C is not built: {cpp_ops.BUILD_HINT}")
    pytest.skip(f"sicl_fast._C is not built; {cpp_ops.BUILD_HINT}", allow_module_level=True)


def bits(t):
    return t.detach().cpu().contiguous().view(torch.int32)


def mats(L, d, seed=0, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    X0 = torch.randn(L, d, generator=g)
    return X0 + drift * torch.randn(L, d, generator=g), X0


@pytest.mark.parametrize("seed,step,shape", [(0, 0, (3, 5, 37)), (2**32 - 1, 7, (2, 3, 129)),
                                             (12345, 2**31 + 5, (1, 1, 20_000))])
def test_randn_bit_identical_to_torch(seed, step, shape):
    assert torch.equal(bits(cpp_ops.randn(seed, step, *shape)), bits(rng.directions(seed, step, *shape)))


def test_randn_normal_quality():
    """2**20 samples: mean, variance, tails (the transform itself is checked in test_kernel_rng)."""
    import math

    n = 1 << 20
    z = cpp_ops.randn(4, 2, 1, 1, n).double().view(-1)
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    for t in (1.0, 2.0, 3.0):
        p = math.erfc(t / math.sqrt(2))
        assert abs(float((z.abs() > t).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("estimator", ["forward", "central"])
@pytest.mark.parametrize("L,d,a,b,N", [(13, 37, 3, 9, 4), (6, 5, 0, 6, 1), (9, 33, 8, 9, 3)])
def test_perturb_bit_identical_to_torch(estimator, L, d, a, b, N):
    X, _ = mats(L, d)
    ref = zo.perturb(X, rng.directions(11, 5, N, b - a, d), 0.037, a, b, estimator)
    assert torch.equal(cpp_ops.perturb(X, 11, 5, N, 0.037, a, b, estimator), ref)


@pytest.fixture(scope="module")
def K():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    return fused.kernels()


@pytest.mark.parametrize("estimator", ["forward", "central"])
def test_triton_and_cpp_perturbations_bit_identical(K, estimator):
    """The requirement: the same seed gives the same perturbation batch on the CPU (C++) and in Triton."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    X, _ = mats(21, 45, seed=7)
    for seed, step in ((0, 0), (123456789, 41)):
        c = cpp_ops.perturb(X, seed, step, 5, 0.011, 4, 19, estimator)
        t = K.perturb(X.to(dev), seed, step, 5, 0.011, 4, 19, estimator)
        assert torch.equal(bits(c), bits(t))
    assert torch.equal(bits(cpp_ops.randn(3, 1, 4, 5, 999)), bits(K.randn(3, 1, 4, 5, 999, device=dev)))


@pytest.mark.parametrize("estimator", ["forward", "central"])
@pytest.mark.parametrize("grad_mode", ["clip", "normalize"])
@pytest.mark.parametrize("scope", ["prompt", "demos"])
@pytest.mark.parametrize("kappa", [0.0, 0.2, 0.999])
def test_update_matches_reference(estimator, grad_mode, scope, kappa):
    L, d, a, b, N, mu, eta = 13, 37, 3, 9, 4, 0.03, 0.5
    X, X0 = mats(L, d, seed=1)
    f = torch.rand(zo.batch_size(N, estimator), generator=torch.Generator().manual_seed(2))
    U = rng.directions(7, 3, N, b - a, d)
    ref, fired_ref = zo.update(X, X0, f, U, a, b, mu, eta, kappa, estimator, grad_mode, 1.0, scope)
    got, fired = cpp_ops.update(X, X0, f, 7, 3, N, a, b, mu, eta, kappa, estimator, grad_mode, 1.0, scope)
    assert fired == fired_ref
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(X, got) and X.shape == got.shape


def test_update_independent_of_thread_count():
    X, X0 = mats(40, 64, seed=3)
    f = torch.rand(9)
    n = cpp_ops.num_threads()
    try:
        cpp_ops.set_num_threads(1)
        one = cpp_ops.update(X, X0, f, 1, 2, 8, 5, 30, 0.01, 0.3, 0.99)
        cpp_ops.set_num_threads(max(2, n))
        many = cpp_ops.update(X, X0, f, 1, 2, 8, 5, 30, 0.01, 0.3, 0.99)
    finally:
        cpp_ops.set_num_threads(n)
    assert one[1] == many[1] and torch.equal(one[0], many[0])


@pytest.mark.parametrize("B,lengths", [(5, [1, 4, 2, 4]), (3, [7]), (4, [1, 1, 1]), (1, [1]),
                                       (9, [3, 17, 1, 44, 5, 30]), (2, [64] * 8)])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.37, 0.5, 1.0])
def test_proxy_matches_reference(B, lengths, q):
    g = torch.Generator().manual_seed(len(lengths) * 100 + B)
    lp = -torch.rand(B, sum(lengths), generator=g) * 6
    lp[0, 0] = float("-inf")  # probability 0 is legal
    offs = span_offsets(lengths)
    got, ref = cpp_ops.proxy(lp, offs, 0.6, 0.3, 0.1, q), ref_proxy(lp, offs, 0.6, 0.3, 0.1, q)
    for name in ("f", "C", "R", "G", "c"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-7)


def test_cpp_ops_interface_and_default_ops(monkeypatch):
    cfg = CalibrationConfig(N=3, mu=0.02, eta=0.4, kappa=0.5, seed=9, scale=1.0)
    X, X0 = mats(10, 12, seed=5)
    ops, ref_ops = cpp_ops.CppOps(), zo.TorchOps()
    assert torch.equal(ops.perturb(X, 4, cfg, 2, 7), ref_ops.perturb(X, 4, cfg, 2, 7))
    f = torch.rand(cfg.batch)
    (got, fired), (ref, fired_ref) = ops.update(X, X0, f, 4, cfg, 2, 7), ref_ops.update(X, X0, f, 4, cfg, 2, 7)
    assert fired == fired_ref
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    monkeypatch.delenv("SICL_TRITON", raising=False)
    monkeypatch.delenv("SICL_CPP", raising=False)
    assert isinstance(fused.default_ops("cpu"), cpp_ops.CppOps)
    monkeypatch.setenv("SICL_CPP", "0")
    assert isinstance(fused.default_ops("cpu"), zo.TorchOps)


def test_errors_are_clear():
    X, X0 = mats(6, 4)
    with pytest.raises(SiclError, match="must be float32"):
        cpp_ops.perturb(X.double(), 0, 0, 2, 0.1, 1, 3)
    with pytest.raises(SiclError, match=r"perturbed rows \[a, b\)"):
        cpp_ops.perturb(X, 0, 0, 2, 0.1, 3, 9)
    with pytest.raises(SiclError, match="f must have B = 3"):
        cpp_ops.update(X, X0, torch.zeros(4), 0, 0, 2, 1, 3, 0.1, 0.1, 0.2)
    with pytest.raises(SiclError, match="X0 must have X's shape"):
        cpp_ops.update(X, X0[:5], torch.zeros(3), 0, 0, 2, 1, 3, 0.1, 0.1, 0.2)
    with pytest.raises(SiclError, match="has no tokens"):
        cpp_ops.proxy(-torch.rand(2, 5), torch.tensor([0, 2, 2, 5]))
    with pytest.raises(NumericalError):
        cpp_ops.proxy(torch.tensor([[float("nan"), -1.0]]), span_offsets([2]))
    with pytest.raises(ValueError, match="C-contiguous"):  # the raw extension checks its buffers too
        cpp_ops._C.randn(torch.zeros(4, 2).t().numpy(), 0)
