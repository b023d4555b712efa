"""Triton perturb / zo_update / track_best against the torch reference (sicl_fast.zo, Algorithm 1's bookkeeping).

perturb: bit-identical to zo.perturb with U = rng.directions (same Philox bits, same float32 X + mu*U).
zo_update: float32 tolerance, rtol 1e-5 / atol 1e-6 on X_new (the gradient sum over directions and the row norms
are reduced in another order than torch's einsum / norm); the projection decision must agree.
"""

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sicl_fast import rng, zo  # noqa: E402
from sicl_fast.ascent import CalibrationConfig  # noqa: E402
from sicl_fast.errors import SiclError  # noqa: E402
from conftest import TRITON_DEVICE as DEV  # noqa: E402


def mats(L, d, seed=0, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    X0 = torch.randn(L, d, generator=g)
    X = X0 + drift * torch.randn(L, d, generator=g)
    return X.to(DEV), X0.to(DEV)


@pytest.mark.parametrize("estimator", ["forward", "central"])
@pytest.mark.parametrize("L,d,a,b,N,block", [(13, 37, 3, 9, 4, None), (6, 5, 0, 6, 1, None), (9, 33, 8, 9, 3, 64),
                                             (20, 40, 2, 17, 2, 256)])
def test_perturb_bit_identical(K, estimator, L, d, a, b, N, block):
    X, _ = mats(L, d)
    U = rng.directions(11, 5, N, b - a, d)
    ref = zo.perturb(X.cpu(), U, 0.037, a, b, estimator)
    got = K.perturb(X, 11, 5, N, 0.037, a, b, estimator, block=block)
    assert got.shape == ref.shape == (zo.batch_size(N, estimator), b, d)
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize(
    "estimator,grad_mode,scope,kappa,block_d",
    [
        ("forward", "clip", "prompt", 0.2, None),  # projection does not fire
        ("forward", "clip", "prompt", 0.999, 16),  # fires; d = 37 in 3 column blocks
        ("forward", "normalize", "demos", 0.999, None),
        ("central", "clip", "demos", 0.0, None),  # projection off
        ("central", "normalize", "prompt", 0.99, 32),
    ],
)
def test_update_matches_reference(K, estimator, grad_mode, scope, kappa, block_d):
    L, d, a, b, N, mu, eta = 13, 37, 3, 9, 4, 0.03, 0.5
    X, X0 = mats(L, d, seed=1)
    f = torch.rand(zo.batch_size(N, estimator), generator=torch.Generator().manual_seed(2))
    U = rng.directions(7, 3, N, b - a, d)
    ref, fired_ref = zo.update(X.cpu(), X0.cpu(), f, U, a, b, mu, eta, kappa, estimator, grad_mode, 1.0, scope)
    got, fired = K.zo_update(X, X0, f.to(DEV), 7, 3, N, a, b, mu, eta, kappa, estimator, grad_mode, 1.0, scope,
                             block_d=block_d)
    assert bool(fired.item()) == fired_ref
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)
    if not fired_ref:  # rows outside [a, b) are copied exactly
        assert torch.equal(got[:a].cpu(), X[:a].cpu()) and torch.equal(got[b:].cpu(), X[b:].cpu())
    if fired_ref:
        rows = slice(a, b) if scope == "demos" else slice(None)
        assert zo.cosine(got[rows].cpu(), X0[rows].cpu()) == pytest.approx(kappa, abs=1e-5)


def test_update_antiparallel_and_small_gradients(K):
    """cos(X, X0) = -1 (the projection lands on the X0 axis) and gradients below the clip norm."""
    X0 = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    X = -X0
    f = torch.tensor([0.5, 0.5, 0.5], device=DEV)  # zero differences: g = 0
    ref, fr = zo.update(X.cpu(), X0.cpu(), f.cpu(), rng.directions(0, 0, 2, 3, 8), 1, 4, 0.1, 1.0, 0.5)
    got, fired = K.zo_update(X, X0, f, 0, 0, 2, 1, 4, 0.1, 1.0, 0.5)
    assert fr and bool(fired.item())
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)
    f = torch.tensor([0.5, 0.5 + 1e-7, 0.5 - 1e-7], device=DEV)  # |g| << clip_norm: unscaled
    X, X0 = mats(5, 8, seed=4)
    ref, _ = zo.update(X.cpu(), X0.cpu(), f.cpu(), rng.directions(0, 0, 2, 3, 8), 1, 4, 0.1, 1.0, 0.0)
    got, _ = K.zo_update(X, X0, f, 0, 0, 2, 1, 4, 0.1, 1.0, 0.0)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)


def test_track_best_matches_algorithm_1(K):
    X = torch.zeros(4, 6, device=DEV)
    state = K.BestState(X)
    history = [0.3, 0.2, 0.5, 0.5, float("nan"), 0.4, 0.7]
    best, best_step, since = -float("inf"), 0, 0
    for step, f0 in enumerate(history):
        Xs = torch.full((4, 6), float(step), device=DEV)
        K.track_best(torch.tensor([f0, 9.0], device=DEV), Xs, state)
        if f0 > best:
            best, best_step, since = f0, step, 0
        else:
            since += 1
        assert state.since_best == since and state.best_step == best_step and state.steps == step + 1
        assert float(state.best_f) == pytest.approx(best)
        assert torch.equal(state.best_X.cpu(), torch.full((4, 6), float(best_step)))


def test_triton_ops_interface(K):
    cfg = CalibrationConfig(N=3, mu=0.02, eta=0.4, kappa=0.5, seed=9, scale=1.0, estimator="central")
    X, X0 = mats(10, 12, seed=5)
    ops, ref_ops = K.TritonOps(), zo.TorchOps()
    batch = ops.perturb(X, 4, cfg, 2, 7)
    assert torch.equal(batch.cpu(), ref_ops.perturb(X.cpu(), 4, cfg, 2, 7))
    f = torch.rand(cfg.batch, generator=torch.Generator().manual_seed(6))
    got, fired = ops.update(X, X0, f.to(DEV), 4, cfg, 2, 7)
    ref, fired_ref = ref_ops.update(X.cpu(), X0.cpu(), f, 4, cfg, 2, 7)
    assert isinstance(fired, bool) and fired == fired_ref
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)


def test_errors_are_clear(K):
    X, X0 = mats(6, 4)
    with pytest.raises(SiclError, match=r"perturbed rows \[a, b\)"):
        K.perturb(X, 0, 0, 2, 0.1, 4, 9)
    with pytest.raises(SiclError, match="X must be float32"):
        K.perturb(X.double(), 0, 0, 2, 0.1, 1, 3)
    with pytest.raises(SiclError, match="N must be >= 1"):
        K.perturb(X, 0, 0, 0, 0.1, 1, 3)
    with pytest.raises(SiclError, match=r"f must have shape \[3\]"):
        K.zo_update(X, X0, torch.zeros(5, device=DEV), 0, 0, 2, 1, 3, 0.1, 0.1, 0.2)
    with pytest.raises(SiclError, match=r"X0 must have shape \[6, 4\]"):
        K.zo_update(X, X0[:5], torch.zeros(3, device=DEV), 0, 0, 2, 1, 3, 0.1, 0.1, 0.2)
    with pytest.raises(SiclError, match="unknown grad_mode"):
        K.zo_update(X, X0, torch.zeros(3, device=DEV), 0, 0, 2, 1, 3, 0.1, 0.1, 0.2, grad_mode="sign")
    with pytest.raises(SiclError, match="int32 Philox counters"):
        K.perturb(torch.zeros(2**12, 2**10, device=DEV), 0, 0, 2**10, 0.1, 0, 2**12)
