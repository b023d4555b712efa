"""Every implementation of the ops protocols (sicl_fast.ops: StepOps and DecoderOps of torch, cpp, triton) against
the torch reference functions, on odd shapes. An implementation that is not available here skips and says why (the
C++ extension not built; Triton without CUDA or TRITON_INTERPRET=1, which tests/conftest.py sets on a CPU machine).

Tolerances, stated once (TOL below), and why:
  perturb, randn: bit-identical (the same Philox bits, the same float32 op sequence).
  update: rtol 1e-5 / atol 1e-6 on X_new (the gradient's sum over directions and the row norms are reduced in
      another order than torch's einsum / norm); the projection decision must agree.
  proxy (float32 log-probs): rtol 1e-5 / atol 1e-7 (sums and the quantile's sort in another order).
  span_head (float32): rtol 1e-5 / atol 1e-5 (online log-sum-exp over vocabulary chunks vs whole rows).
  the difference form's row ops (norm_rows, rope_rows, gated_rows, attention and span head of the rows):
      tests/test_rows_ops.py.
  track_best, bookkeep: exact (copies, comparisons and counters; the SNR's float32 mean / std are reduced in
      another order, which can only matter within an ulp of the threshold: the scripted SNRs are far from it).
  decoder elementwise ops (residual_norm, qk_rope, gated, softcap_), float32: rtol 1e-5 / atol 1e-5 (the
      norms' sums in another order, rsqrt / exp / tanh within an ulp or two of torch's); the C++ rotary and
      residual sum: bit-identical (the same operations one by one).
  the same in bf16: rtol 2^-6 and atol 2^-6 times the largest |reference| value (at least 1), four bf16 ulps
      of the largest term: up to three roundings, each of which Triton's CPU interpreter does by truncation (its
      float32 -> bf16 cast does not round to nearest; CUDA's does), and rotary's sum may cancel its terms.
  attention (triton vs the math path over the prefix and the rows), float32: 1e-5; bf16: atol 3e-2 (outputs
      ~1; the kernel rounds the probabilities to bf16 before the product with v, as flash attention does).
"""
import math
import os

import pytest
import torch

from sicl_fast.step import rng, zo
from sicl_fast.step.best import BestState
from sicl_fast.errors import NumericalError, SiclError
from sicl_fast.ops import attention_kernels, cpp_ops, make_ops
from sicl_fast.step.proxy import proxy as ref_proxy
from sicl_fast.formats.spans import span_offsets
from sicl_fast.step.spec import StepSpec
from sicl_fast.step.step_state import RUNNING, StepState, bookkeep_reference
from conftest import TRITON_DEVICE, span_logprobs_oracle

TOL = {
    "update": dict(rtol=1e-5, atol=1e-6),
    "proxy": dict(rtol=1e-5, atol=1e-7),
    "span_head": dict(rtol=1e-5, atol=1e-5),
    "elementwise": {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -6, atol=2 ** -6)},
    "attention": {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0.0, atol=3e-2)},
}


def why_unavailable(impl: str) -> str | None:
    if impl == "cpp" and not cpp_ops.available():
        return f"the C++ extension sicl_fast.ops._C is not built; {cpp_ops.BUILD_HINT}"
    if impl == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if TRITON_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton needs CUDA or TRITON_INTERPRET=1"
    return None


def device_of(impl: str) -> str:
    return TRITON_DEVICE if impl == "triton" else "cpu"


@pytest.fixture(params=["torch", "cpp", "triton"])
def impl(request):
    reason = why_unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(params=["cpp", "triton"])
def compiled_impl(request):
    """The implementations other than the reference."""
    reason = why_unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def ops(impl):
    """The StepOps of the implementation."""
    return make_ops(impl, device_of(impl)).step


@pytest.fixture
def dec(impl):
    """The DecoderOps of the implementation."""
    return make_ops(impl, device_of(impl)).decoder


@pytest.fixture
def dev(impl):
    return device_of(impl)


def bits(t):
    return t.detach().cpu().contiguous().view(torch.int32)


def mats(L, d, seed=0, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    X0 = torch.randn(L, d, generator=g)
    return X0 + drift * torch.randn(L, d, generator=g), X0


def spec(L, d, a, b, N, **kw):
    return StepSpec(L=L, d=d, a=a, b=b, N=N, mu=kw.pop("mu", 0.037), eta=kw.pop("eta", 0.5),
                    kappa=kw.pop("kappa", 0.2), seed=kw.pop("seed", 11), **kw)


# ------------------------------------------------------------------------------------------------- step ops


@pytest.mark.parametrize("estimator", ["forward", "central"])
@pytest.mark.parametrize("L,d,a,b,N", [(13, 37, 3, 9, 4), (6, 5, 0, 6, 1), (9, 33, 8, 9, 3), (20, 40, 2, 17, 2)])
def test_perturb_bit_identical(ops, dev, estimator, L, d, a, b, N):
    X, _ = mats(L, d)
    s = spec(L, d, a, b, N, estimator=estimator)
    ref = zo.perturb(X, rng.directions(s.seed, 5, N, b - a, d), s)
    got = ops.perturb(X.to(dev), 5, s)
    assert got.shape == ref.shape == (s.B, b, d) and got.dtype == torch.float32
    assert torch.equal(bits(got), bits(ref))


@pytest.mark.parametrize("estimator", ["forward", "central"])
@pytest.mark.parametrize("grad_mode", ["clip", "normalize"])
@pytest.mark.parametrize("scope", ["prompt", "demos"])
@pytest.mark.parametrize("kappa", [0.0, 0.2, 0.999])
def test_update_matches_reference(ops, dev, estimator, grad_mode, scope, kappa):
    L, d, a, b, N = 13, 37, 3, 9, 4
    s = spec(L, d, a, b, N, mu=0.03, eta=0.5, kappa=kappa, seed=7, estimator=estimator, grad_mode=grad_mode,
             scope=scope)
    X, X0 = mats(L, d, seed=1)
    f = torch.rand(s.B, generator=torch.Generator().manual_seed(2))
    ref, fired_ref = zo.update(X, X0, f, rng.directions(7, 3, N, b - a, d), s)
    got, fired = ops.update(X.to(dev), X0.to(dev), f.to(dev), 3, s)
    assert fired.dtype == torch.int32 and fired.shape == (1,) and fired.device == got.device
    assert bool(fired.item()) == fired_ref
    torch.testing.assert_close(got.cpu(), ref, **TOL["update"])
    if not fired_ref:  # rows outside [a, b) are copied exactly
        assert torch.equal(got[:a].cpu(), X[:a]) and torch.equal(got[b:].cpu(), X[b:])
    else:
        rows = slice(a, b) if scope == "demos" else slice(None)
        assert zo.cosine(got[rows].cpu(), X0[rows]) == pytest.approx(kappa, abs=1e-5)


def test_update_antiparallel_and_small_gradients(ops, dev):
    """cos(X, X0) = -1 (the projection lands on the X0 axis) and gradients below the clip norm (unscaled)."""
    X0 = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    s = spec(5, 8, 1, 4, 2, mu=0.1, eta=1.0, kappa=0.5, seed=0)
    f = torch.tensor([0.5, 0.5, 0.5])  # zero differences: g = 0
    ref, fired_ref = zo.update(-X0, X0, f, rng.directions(0, 0, 2, 3, 8), s)
    got, fired = ops.update(-X0.to(dev), X0.to(dev), f.to(dev), 0, s)
    assert fired_ref and bool(fired.item())
    torch.testing.assert_close(got.cpu(), ref, **TOL["update"])
    s = spec(5, 8, 1, 4, 2, mu=0.1, eta=1.0, kappa=0.0, seed=0)
    f = torch.tensor([0.5, 0.5 + 1e-7, 0.5 - 1e-7])
    X, X0 = mats(5, 8, seed=4)
    ref, _ = zo.update(X, X0, f, rng.directions(0, 0, 2, 3, 8), s)
    got, _ = ops.update(X.to(dev), X0.to(dev), f.to(dev), 0, s)
    torch.testing.assert_close(got.cpu(), ref, **TOL["update"])


def test_step_argument_errors_are_clear(ops, dev):
    X, X0 = mats(6, 4)
    X, X0 = X.to(dev), X0.to(dev)
    with pytest.raises(SiclError, match=r"perturbed rows \[a, b\)"):
        spec(6, 4, 4, 9, 2)
    with pytest.raises(SiclError, match="N must be >= 1"):
        spec(6, 4, 1, 3, 0)
    with pytest.raises(SiclError, match="N must be an int"):
        spec(6, 4, 1, 3, 2.0)
    with pytest.raises(SiclError, match="unknown grad_mode 'sign'"):
        spec(6, 4, 1, 3, 2, grad_mode="sign")
    with pytest.raises(SiclError, match="int32 Philox counters"):
        spec(2**12, 2**10, 0, 2**12, 2**10)
    s = spec(6, 4, 1, 3, 2)
    with pytest.raises(SiclError, match=r"X must have shape \[6, 4\]"):
        ops.perturb(X[:5], 0, s)
    with pytest.raises(SiclError, match=r"X0 must have shape \[6, 4\]"):
        ops.update(X, X0[:5], torch.zeros(3, device=dev), 0, s)
    with pytest.raises(SiclError, match="f must have B = 3"):
        ops.update(X, X0, torch.zeros(5, device=dev), 0, s)


def test_compiled_impls_refuse_other_dtypes(compiled_impl):
    impl, dev = compiled_impl, device_of(compiled_impl)
    X = mats(6, 4)[0].double().to(dev)
    perturb = make_ops("cpp").step.perturb if impl == "cpp" else make_ops(impl, dev).step.K.perturb
    with pytest.raises(SiclError, match="X must be float32"):
        perturb(X, 0, spec(6, 4, 1, 3, 2))


@pytest.mark.parametrize("seed,step,shape", [(0, 0, (3, 5, 37)), (2**32 - 1, 7, (2, 3, 129)),
                                             (12345, 2**31 + 5, (1, 1, 20_000))])
def test_randn_bit_identical(compiled_impl, seed, step, shape):
    """The standalone noise op of each compiled impl draws rng.directions' bits."""
    impl, dev = compiled_impl, device_of(compiled_impl)
    ref = rng.directions(seed, step, *shape)
    got = cpp_ops.randn(seed, step, *shape) if impl == "cpp" else make_ops(impl, dev).step.K.randn(
        seed, step, *shape, device=dev)
    assert torch.equal(bits(got), bits(ref))


@pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")
def test_cpp_update_independent_of_thread_count():
    X, X0 = mats(40, 64, seed=3)
    f = torch.rand(9)
    s = spec(40, 64, 5, 30, 8, mu=0.01, eta=0.3, kappa=0.99, seed=1)
    ops, n = make_ops("cpp").step, cpp_ops.num_threads()
    try:
        cpp_ops.set_num_threads(1)
        one = ops.update(X, X0, f, 2, s)
        cpp_ops.set_num_threads(max(2, n))
        many = ops.update(X, X0, f, 2, s)
    finally:
        cpp_ops.set_num_threads(n)
    assert torch.equal(one[1], many[1]) and torch.equal(one[0], many[0])


# ------------------------------------------------------------------------------------------------- proxy


PROXY_SHAPES = [(5, [1, 4, 2, 4]), (3, [7]), (4, [1, 1, 1]), (1, [1]), (9, [3, 17, 1, 44, 5, 30]), (2, [64] * 8)]


# every quantile at the small shapes; at 1024 span positions (a 2048-wide sort, 12 s a case under the interpreter)
# one rank that interpolates between two sorted values
@pytest.mark.parametrize("B,lengths,q", [(B, lengths, q) for B, lengths in PROXY_SHAPES for q in (0.0, 0.1, 0.37, 1.0)]
                         + [(3, [100, 200, 300, 424], 0.37)])
def test_proxy_matches_reference(ops, dev, B, lengths, q):
    g = torch.Generator().manual_seed(len(lengths) * 100 + B)
    lp = -torch.rand(B, sum(lengths), generator=g) * 6
    lp[0, 0] = float("-inf")  # probability 0 is legal
    offs = span_offsets(lengths)
    got, ref = ops.proxy(lp.to(dev), offs, 0.6, 0.3, 0.1, q), ref_proxy(lp, offs, 0.6, 0.3, 0.1, q)
    for name in ("f", "C", "R", "G", "c"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(ref, name), **TOL["proxy"])


def test_proxy_value_check_and_its_opt_out(ops, dev):
    lp = torch.tensor([[float("nan"), -1.0, -2.0]], device=dev)
    with pytest.raises(NumericalError, match="NaN or \\+inf"):
        ops.proxy(lp, span_offsets([1, 2]))
    out = ops.proxy(lp, span_offsets([1, 2]), check_values=False)  # no host sync: the NaN flows through
    assert math.isnan(float(out.f[0]))
    with pytest.raises(SiclError, match="has no tokens"):
        ops.proxy(-torch.rand(2, 5, device=dev), torch.tensor([0, 2, 2, 5]))
    with pytest.raises(SiclError, match="q must be in"):
        ops.proxy(-torch.rand(2, 5, device=dev), span_offsets([5]), q=1.5)


# ------------------------------------------------------------------------------------------------- span head


@pytest.mark.parametrize("B,P,d,V", [(1, 1, 8, 5), (3, 7, 33, 130), (2, 19, 64, 1000)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_span_head_matches_reference(ops, dev, B, P, d, V, softcap):
    g = torch.Generator().manual_seed(B * P + V)
    h, w = torch.randn(B, P, d, generator=g), torch.randn(V, d, generator=g) * 0.3
    t = torch.randint(0, V, (P,), generator=g)
    ref = span_logprobs_oracle(h, w, t, softcap=softcap)
    got = ops.span_head(h.to(dev), w.to(dev), t, softcap=softcap)
    assert got.shape == (B, P) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), ref, **TOL["span_head"])


def test_span_head_adds_the_output_bias(ops, dev):
    """#47: an output module's bias (Phi-2, GPT-J: the hf backend's head) added to every logit before the soft-cap;
    V 1100: three chunks of the C++ path."""
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(2, 5, 16, generator=g), torch.randn(1100, 16, generator=g) * 0.3
    b = torch.randn(1100, generator=g)
    t = torch.tensor([0, 511, 512, 1099, 700])
    ref = span_logprobs_oracle(h, w, t, softcap=3.0, bias=b)
    got = ops.span_head(h.to(dev), w.to(dev), t, softcap=3.0, bias=b.to(dev))
    torch.testing.assert_close(got.cpu(), ref, **TOL["span_head"])
    assert (got.cpu() - span_logprobs_oracle(h, w, t, softcap=3.0)).abs().max() > 0.1  # the bias matters here


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the Triton interpreter, on the NaN it is given
@pytest.mark.parametrize("value", ["nan", "+inf"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_span_head_keeps_nan_and_inf(ops, dev, value, softcap):
    """A NaN or +inf in one position's hidden state gives that position what the reference gives it: NaN (its
    logits NaN, or +-inf), or with soft-capping and +inf the capped logits' finite value; the other positions keep
    their values. V 1100: three chunks of the C++ path, the bad logits in all of them."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(2, 6, 16, generator=g), torch.randn(1100, 16, generator=g) * 0.3
    t = torch.randint(0, 1100, (6,), generator=g)
    h[1, 4, 3] = float(value)
    ref = span_logprobs_oracle(h, w, t, softcap=softcap)
    got = ops.span_head(h.to(dev), w.to(dev), t, softcap=softcap).cpu()
    assert bool(ref[1, 4].isnan()) == (value == "nan" or softcap is None)
    torch.testing.assert_close(got, ref, equal_nan=True, **TOL["span_head"])


NONFINITE = ["nan", "nan with every payload bit set", "+inf", "-inf"]


def poison(t: torch.Tensor, index, value: str) -> None:
    """Write a non-finite value (NONFINITE) at t[index]; 'nan with every payload bit set' is all one bits (bytes
    of 0xFF, as a damaged file may hold)."""
    if value == "nan with every payload bit set":
        t.view({4: torch.int32, 2: torch.int16}[t.element_size()])[index] = -1
    else:
        t[index] = float(value)


def same_nonfinite(got, ref) -> None:
    """NaN, +inf and -inf at the same places (the values elsewhere are the parity tests' business)."""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(ref)), (test.__name__, got, ref)


cpp_only = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")


# ------------------------------------------------------------------------------------------------- best tracking


def test_track_best_matches_algorithm_1(ops, dev):
    state = BestState(torch.zeros(4, 6, device=dev))
    history = [0.3, 0.2, 0.5, 0.5, float("nan"), 0.4, 0.7]
    best, best_step, since = -float("inf"), 0, 0
    for step, f0 in enumerate(history):
        ops.track_best(torch.tensor([f0, 9.0], device=dev), torch.full((4, 6), float(step), device=dev), state)
        if f0 > best:
            best, best_step, since = f0, step, 0
        else:
            since += 1
        assert (state.since_best, state.best_step, state.steps) == (since, best_step, step + 1)
        assert float(state.best_f) == pytest.approx(best)
        assert torch.equal(state.best_X.cpu(), torch.full((4, 6), float(best_step)))
    with pytest.raises(SiclError, match="X must have shape"):
        ops.track_best(torch.zeros(2, device=dev), torch.zeros(3, 6, device=dev), state)


# ------------------------------------------------------------------------------------------------- bookkeep


def scripted_state(L, d, cfg, dev) -> StepState:
    """A StepState from a random X0, on `dev`."""
    g = torch.Generator().manual_seed(5)
    return StepState.new(torch.randn(L, d, generator=g).to(dev), cfg)


def state_tensors(st: StepState) -> list:
    return [st.X, st.best.best_X, st.best.best_f, st.best.counters, st.step_t, st.steps_run, st.reason, st.low_snr,
            st.projections, st.history, st.anchor]


BOOKKEEP_SCRIPTS = {  # config, the f0 of each step (row 0); the other rows are random around it
    "gate": (dict(tau=0.5), [0.3, 0.6]),
    "patience": (dict(patience=2), [0.5, 0.4, 0.45, 0.6, 0.3, 0.2, 0.1]),
    "snr-stop": (dict(snr_threshold=1e9, patience=2), [0.5, 0.5, 0.5, 0.5]),
    "snr-skips-central": (dict(snr_threshold=0.5, estimator="central", patience=3, max_steps=5),
                          [0.5, 0.55, 0.52, 0.6, 0.7]),
    "nonfinite": (dict(), [0.5, 0.6, math.nan, 0.7]),
    "max-steps": (dict(max_steps=3), [0.5, 0.6, 0.7, 0.8, 0.9]),
    # min_delta: a better f0 that does not count (step 1), one that counts (step 2), patience from the anchor
    "min-delta": (dict(patience=2, min_delta=0.05), [0.5, 0.53, 0.56, 0.57, 0.58, 0.59]),
    "min-delta-rel": (dict(patience=2, min_delta_rel=0.1), [0.5, 0.54, 0.56, 0.6, 0.61, 0.62, 0.7]),
    "min-delta-larger-margin": (dict(patience=2, min_delta=0.01, min_delta_rel=0.1), [0.5, 0.52, 0.56, 0.58, 0.6]),
    "min-delta-exact-tie": (dict(patience=1, min_delta=0.0625), [0.5, 0.5625, 0.7]),  # beats by exactly the margin
    "min-delta-nonfinite": (dict(patience=3, min_delta=0.01), [0.5, 0.6, math.nan, 0.7]),
    "min-delta-gate": (dict(tau=0.5, min_delta=0.01), [0.3, 0.6]),
    "min-delta-snr": (dict(snr_threshold=1e9, patience=2, min_delta=0.01), [0.5, 0.5, 0.5, 0.5]),
}


@pytest.mark.parametrize("name", list(BOOKKEEP_SCRIPTS))
def test_bookkeep_matches_the_reference(ops, dev, name):
    from sicl_fast.calibration.ascent import CalibrationConfig

    kw, f0s = BOOKKEEP_SCRIPTS[name]
    cfg = CalibrationConfig(**{"N": 5, "mu": 0.01, "tau": 0.0, "patience": 0, "max_steps": 8, "scale": 1.0, **kw})
    B = cfg.batch
    ref, got = scripted_state(7, 5, cfg, "cpu"), scripted_state(7, 5, cfg, dev)
    g = torch.Generator().manual_seed(1)
    stopped_at = None
    for step, f0 in enumerate(f0s + [0.9, 0.95]):  # two more calls after the stop must change nothing
        f = f0 + 0.01 * torch.randn(B, generator=g)
        f[0] = f0
        fired = torch.tensor([step % 2], dtype=torch.int32)
        X_next = torch.randn(7, 5, generator=g)
        ref.X_next.copy_(X_next)
        got.X_next.copy_(X_next.to(dev))
        bookkeep_reference(ref, f, fired, cfg)
        ops.bookkeep(got, f.to(dev), fired.to(dev), cfg)
        for r, o in zip(state_tensors(ref), state_tensors(got)):
            assert torch.equal(r, o.cpu()) or torch.allclose(r, o.cpu(), rtol=0, atol=0, equal_nan=True), (step, r, o)
        if stopped_at is None and int(ref.reason) != RUNNING:
            stopped_at = step
    assert stopped_at is not None and stopped_at < len(f0s)  # each script ends in its stop


def run_script(cfg, f0s, dev="cpu", bookkeep=bookkeep_reference) -> list:
    """The state tensors after each step of a script of f0 values (BOOKKEEP_SCRIPTS' other rows and X_next)."""
    st = scripted_state(7, 5, cfg, dev)
    g = torch.Generator().manual_seed(1)
    out = []
    for step, f0 in enumerate(f0s):
        f = f0 + 0.01 * torch.randn(cfg.batch, generator=g)
        f[0] = f0
        st.X_next.copy_(torch.randn(7, 5, generator=g).to(dev))
        bookkeep(st, f.to(dev), torch.tensor([step % 2], dtype=torch.int32, device=dev), cfg)
        out.append([t.cpu().clone() for t in state_tensors(st)])
    return out


@pytest.mark.parametrize("name", [n for n in BOOKKEEP_SCRIPTS if not n.startswith("min-delta")])
def test_the_smallest_margin_is_the_papers_rule(name):
    """min_delta 0 skips the anchor (no op); the smallest positive min_delta takes the anchor path, where f0 counts
    when it beats the anchor by more than 5e-324: for float32 proxies that is any gain, so both give the same state
    bit for bit at every step (the anchor aside: the path without a margin never writes it)."""
    from sicl_fast.calibration.ascent import CalibrationConfig

    kw, f0s = BOOKKEEP_SCRIPTS[name]
    cfg = CalibrationConfig(**{"N": 5, "mu": 0.01, "tau": 0.0, "patience": 0, "max_steps": 8, "scale": 1.0, **kw})
    if not cfg.patience:
        cfg = cfg.replace(patience=2)
    paper, margin = run_script(cfg, f0s + [0.9]), run_script(cfg.replace(min_delta=5e-324), f0s + [0.9])
    for a, b in zip(paper, margin):
        for r, o in zip(a[:-1], b[:-1]):
            assert torch.equal(r, o) or torch.allclose(r, o, rtol=0, atol=0, equal_nan=True)
    assert torch.isinf(paper[-1][-1]).all() and not torch.isinf(margin[-1][-1]).all()


def test_min_delta_costs_no_launch(dev, impl):
    """The fused bookkeeping is two launches with or without min_delta in Triton (the anchor is compiled in or out of
    the first) and one C++ call; the torch reference adds its anchor ops only when min_delta or min_delta_rel is
    set."""
    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.diagnostics.kernel_count import count_kernels

    ops = make_ops(impl, dev).step
    cfg = CalibrationConfig(N=5, mu=0.01, tau=0.0, patience=2, max_steps=8, scale=1.0)
    counts = []
    for c in (cfg, cfg.replace(min_delta=0.01)):
        st = scripted_state(7, 5, c, dev)
        f, fired = torch.full((c.batch,), 0.5, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
        counts.append(count_kernels(lambda: ops.bookkeep(st, f, fired, c)))
    if impl == "torch":
        assert counts[0] < counts[1]
    else:
        assert counts == {"triton": [2, 2], "cpp": [1, 1]}[impl]


# ------------------------------------------------------------------------------------- decoder elementwise work


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def close(got, ref, tol):
    ref = ref.float()
    if got.dtype == torch.bfloat16:  # absolute error in ulps of the largest term (TOL in the module docstring)
        tol = dict(tol, atol=tol["atol"] * max(1.0, float(ref.abs().max())))
    torch.testing.assert_close(got.float().cpu(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [37, 64])
@pytest.mark.parametrize("gemma", [False, True])
def test_residual_norm(dec, dev, dtype, d, gemma):
    from sicl_fast.models import elementwise as ew

    wd = torch.float32 if gemma else dtype  # Gemma's (1 + w) is float32
    x, y = rand(2, 5, d, dtype=dtype, seed=1), rand(2, 5, d, dtype=dtype, seed=2, scale=3.0)
    w, pw = 1 + rand(d, dtype=wd, seed=3, scale=0.2), 1 + rand(d, dtype=wd, seed=4, scale=0.2)
    tol = TOL["elementwise"][dtype]
    for post in (None, pw):
        x1, h = dec.residual_norm(x.to(dev), y.to(dev), None if post is None else post.to(dev), w.to(dev), 1e-6, gemma)
        rx, rh = ew.residual_norm(x, y, post, w, 1e-6, gemma)
        close(x1, rx, tol)
        close(h, rh, tol)
        assert x1.dtype == h.dtype == dtype
    x1, h = dec.residual_norm(x.to(dev), None, None, w.to(dev), 1e-6, gemma)
    assert x1 is not None and torch.equal(x1.cpu(), x)
    close(h, ew.rms_norm(x, w, 1e-6, gemma), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [6, 18])
@pytest.mark.parametrize("qk_norm,gemma", [(False, False), (True, False), (True, True)])
def test_qk_rope_writes_the_buffers(dec, dev, dtype, hd, qk_norm, gemma):
    """q, k, v as views of one fused product (the difference products' layout), k / v into buffers."""
    from sicl_fast.models import elementwise as ew

    B, T, H, Hk = 2, 7, 4, 2
    qkv = rand(B, T, (H + 2 * Hk) * hd, dtype=dtype, seed=5)
    q, k, v = (t.view(B, T, -1, hd) for t in qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1))
    cos, sin = rand(T, 1, hd, dtype=dtype, seed=6), rand(T, 1, hd, dtype=dtype, seed=7)
    wd = torch.float32 if gemma else dtype
    qn = 1 + rand(hd, dtype=wd, seed=8, scale=0.2) if qk_norm else None
    kn = 1 + rand(hd, dtype=wd, seed=9, scale=0.2) if qk_norm else None
    rq, rk = ew.qk_rope(q, k, cos, sin, qn, kn, 1e-6, gemma)
    kb = torch.zeros(B, T, Hk, hd, dtype=dtype, device=dev)
    vb = torch.zeros_like(kb)
    qkv_d = qkv.clone().to(dev)  # the op may rotate q in place
    qd, kd, vd = (t.view(B, T, -1, hd) for t in qkv_d.split([H * hd, Hk * hd, Hk * hd], dim=-1))
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    gq, gk, gv = dec.qk_rope(qd, kd, vd, cos.to(dev), sin.to(dev), to(qn), to(kn), 1e-6, gemma, kb, vb)
    assert gk is kb and gv is vb
    tol = TOL["elementwise"][dtype]
    close(gq, rq, tol)
    close(kb, rk, tol)
    assert torch.equal(vb.cpu(), v)
    gq, gk, gv = dec.qk_rope(qkv.view(B, T, -1, hd)[:, :, :H].contiguous().to(dev), k.contiguous().to(dev),
                             v.contiguous().to(dev), cos.to(dev), sin.to(dev), to(qn), to(kn), 1e-6, gemma)
    close(gq, rq, tol)  # fresh outputs without buffers
    close(gk, rk, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_families_elementwise(dec, dev, dtype):
    """The plain forward's ops with the later families' features (issue 47): Granite's residual multiplier (y_scale),
    OLMo 2's missing pre-norm (w None: the sum itself) with its float32-multiplied post-norm and its q / k norms over
    the whole projection, Phi-3's partial rotary (tables narrower than a head: the rest of each head as it is)."""
    from sicl_fast.models import elementwise as ew

    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    d, tol = 40, TOL["elementwise"][dtype]
    x, y = rand(2, 5, d, dtype=dtype, seed=1), rand(2, 5, d, dtype=dtype, seed=2, scale=3.0)
    w = 1 + rand(d, seed=3, scale=0.2)
    for post, ww, ys, gemma in ((None, w.to(dtype), 0.3, False), (w, None, None, True)):
        x1, h = dec.residual_norm(x.to(dev), y.to(dev), to(post), to(ww), 1e-6, gemma, y_scale=ys)
        rx, rh = ew.residual_norm(x, y, post, ww, 1e-6, gemma, ys)
        close(x1, rx, tol)
        close(h, rh, tol)
    x1, h = dec.residual_norm(x.to(dev), None, None, None, 1e-6, True)
    assert torch.equal(x1.cpu(), x) and torch.equal(h.cpu(), x)
    B, T, H, Hk, hd, rot = 2, 7, 3, 2, 12, 8
    qkv = rand(B, T, (H + 2 * Hk) * hd, dtype=dtype, seed=5)
    cos, sin = rand(T, 1, rot, dtype=dtype, seed=6), rand(T, 1, rot, dtype=dtype, seed=7)
    qn, kn = 1 + rand(H * hd, seed=8, scale=0.2), 1 + rand(Hk * hd, seed=9, scale=0.2)
    for norms in ((None, None), (qn, kn)):
        q, k, v = (t.view(B, T, -1, hd) for t in qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1))
        rq, rk = ew.qk_rope(q, k, cos, sin, *norms, 1e-6, True)
        qd, kd, vd = (t.view(B, T, -1, hd) for t in qkv.clone().to(dev).split([H * hd, Hk * hd, Hk * hd], dim=-1))
        gq, gk, gv = dec.qk_rope(qd, kd, vd, cos.to(dev), sin.to(dev), *map(to, norms), 1e-6, True)
        close(gq, rq, tol)
        close(gk, rk, tol)
        if norms[0] is None:
            assert torch.equal(gq[..., rot:].cpu(), q[..., rot:])  # past the rotary width: as it was


@pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")
@pytest.mark.parametrize("B,T,H,Hk,hd,d", [(3, 37, 3, 1, 18, 37), (9, 130, 9, 3, 64, 576)])
def test_cpp_rope_bit_identical_and_norm_on_many_rows(B, T, H, Hk, hd, d):
    """The C++ rotary does the reference's products and sum one by one: the same bits; its residual norm over
    enough rows to run on every thread (rows are independent: the thread count changes nothing)."""
    from sicl_fast.models import elementwise as ew

    dec = make_ops("cpp").decoder
    qkv = rand(B, T, (H + 2 * Hk) * hd, seed=12)
    q, k, v = (t.view(B, T, -1, hd) for t in qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1))
    cos, sin = rand(T, 1, hd, seed=13), rand(T, 1, hd, seed=14)
    rq, rk = ew.qk_rope(q, k, cos, sin, None, None, 1e-6, False)
    gq, gk, gv = dec.qk_rope(q.clone(), k, v, cos, sin, None, None, 1e-6, False)
    assert torch.equal(gq, rq) and torch.equal(gk, rk) and torch.equal(gv, v)
    x, y, w = rand(B, T, d, seed=15), rand(B, T, d, seed=16, scale=3.0), 1 + rand(d, seed=17, scale=0.2)
    rx, rh = ew.residual_norm(x, y, None, w, 1e-5, False)
    n = cpp_ops.num_threads()
    try:
        for threads in (1, 2):
            cpp_ops.set_num_threads(threads)
            x1, h = dec.residual_norm(x, y, None, w, 1e-5, False)
            assert torch.equal(x1, rx)  # one addition per element
            close(h, rh, TOL["elementwise"][torch.float32])
    finally:
        cpp_ops.set_num_threads(n)


@pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")
def test_cpp_rope_into_a_batch_of_cache_rows_and_per_row_positions():
    """K / V written into the first T of S rows of a batched cache (rows not evenly strided: through a copy), and
    batched decoding's per-row positions (cos / sin [B, 1, 1, hd]: the reference's path)."""
    from sicl_fast.models import elementwise as ew

    dec = make_ops("cpp").decoder
    B, T, S, H, Hk, hd = 3, 5, 9, 4, 2, 8
    q, k, v = rand(B, T, H, hd, seed=20), rand(B, T, Hk, hd, seed=21), rand(B, T, Hk, hd, seed=22)
    cos, sin = rand(T, 1, hd, seed=23), rand(T, 1, hd, seed=24)
    kc, vc = torch.zeros(B, S, Hk, hd), torch.zeros(B, S, Hk, hd)
    gq, gk, gv = dec.qk_rope(q.clone(), k, v, cos, sin, None, None, 1e-6, False, kc[:, :T], vc[:, :T])
    rq, rk = ew.qk_rope(q, k, cos, sin, None, None, 1e-6, False)
    assert torch.equal(gq, rq) and torch.equal(kc[:, :T], rk) and torch.equal(vc[:, :T], v)
    assert not kc[:, T:].any() and not vc[:, T:].any()
    cos, sin = rand(B, 1, 1, hd, seed=25), rand(B, 1, 1, hd, seed=26)  # one decoding position per batch row
    gq, gk, _ = dec.qk_rope(q[:, :1].clone(), k[:, :1], v[:, :1], cos, sin, None, None, 1e-6, False)
    rq, rk = ew.qk_rope(q[:, :1], k[:, :1], cos, sin, None, None, 1e-6, False)
    assert torch.equal(gq, rq) and torch.equal(gk, rk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_name", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated(dec, dev, dtype, act_name):
    from sicl_fast.models import elementwise as ew

    gu = rand(3, 4, 2 * 50, dtype=dtype, seed=10, scale=2.0)
    gate, up = gu.chunk(2, dim=-1)  # halves of one product: rows with a stride of 100
    got = dec.gated(gate.to(dev), up.to(dev), act_name)
    close(got, ew.gated(gate, up, act_name), TOL["elementwise"][dtype])
    assert got.shape == gate.shape and got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(dec, dev, dtype):
    from sicl_fast.models import elementwise as ew

    z = rand(5, 33, dtype=dtype, seed=11, scale=20.0)
    close(dec.softcap_(z.clone().to(dev), 5.0), ew.softcap(z, 5.0), TOL["elementwise"][dtype])


ATTN_CASES = [  # B, T, a (prefix), H, Hk, hd, window, softcap
    (3, 21, 13, 4, 2, 16, None, None),
    (3, 21, 13, 4, 2, 16, 9, 2.0),
    (2, 37, 0, 2, 2, 8, 9, None),
    (1, 5, 40, 6, 3, 24, None, 2.0),
    (2, 17, 19, 4, 1, 16, 24, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES, ids=[f"B{c[0]}T{c[1]}a{c[2]}w{c[6]}cap{c[7]}" for c in ATTN_CASES])
def test_triton_attention_matches_the_math_path(dtype, case):
    """The fused attention (prefix and rows in one launch) against the reference: the math path over the two
    key sets, merged by log-sum-exp, in float32."""
    if why_unavailable("triton"):
        pytest.skip(why_unavailable("triton"))
    from sicl_fast.models.attention import Attention

    B, T, a, H, Hk, hd, window, cap = case
    dev = device_of("triton")
    q, k, v = rand(B, T, H, hd, seed=12), rand(B, T, Hk, hd, seed=13), rand(B, T, Hk, hd, seed=14)
    kp, vp = rand(1, a, Hk, hd, seed=15), rand(1, a, Hk, hd, seed=16)
    ref = Attention("math", 0.3, cap, torch.float32, "cpu")(q, k, v, a, window, (kp, vp) if a else None)
    att = Attention("triton", 0.3, cap, dtype, dev, attention_kernels("triton"))
    to = lambda t: t.to(dev, dtype)  # noqa: E731
    got = att(to(q), to(k), to(v), a, window, (to(kp), to(vp)) if a else None)
    assert got.dtype == dtype
    close(got, ref, TOL["attention"][dtype])
    from sicl_fast.kernels import prefix_attention  # small tiles: several query and key blocks, window bounds

    got = prefix_attention(to(q), to(k), to(v), (to(kp), to(vp)) if a else None, a, window, 0.3, cap, block=16)
    close(got, ref, TOL["attention"][dtype])


CPP_ATTN_CASES = ATTN_CASES + [  # B, T, a, H, Hk, hd, window, softcap: SmolLM2's heads, odd tiles, hd % 16 != 0
    (9, 70, 23, 9, 3, 64, None, None),
    (2, 33, 0, 6, 2, 80, None, None),
    (3, 19, 7, 3, 3, 20, 5, 3.0),
    (2, 40, 0, 8, 2, 256, 13, None),
    (2, 45, 17, 10, 2, 32, None, 1.5),  # G 5: tiles of 20 rows; soft-capping on AVX-512 registers
    (2, 26, 0, 7, 1, 48, 11, None),  # G 7: 14 rows and 2 of padding; hd 48: three 16 x 16 blocks of the keys
]


def test_a_fused_attention_runs_the_kernels_it_is_handed():
    """The 'cpp' and 'triton' attention kernels come in from the ops (ops.attention_kernels), as the decoder's other
    ops do: the model's Attention loads none itself."""
    from sicl_fast.models.attention import Attention

    for impl in ("cpp", "triton"):
        with pytest.raises(SiclError, match=rf"pass kernels=sicl_fast.ops.attention_kernels\('{impl}'\)"):
            Attention(impl, 0.3, None, torch.float32, "cpu")
    assert attention_kernels("math") is None and attention_kernels("sdpa") is None


@pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")
@pytest.mark.parametrize("case", CPP_ATTN_CASES, ids=[f"B{c[0]}T{c[1]}a{c[2]}hd{c[5]}w{c[6]}cap{c[7]}"
                                                      for c in CPP_ATTN_CASES])
def test_cpp_attention_matches_the_math_path(case):
    """The C++ attention (prefix and rows in one call) against the reference (the math path over the two key sets,
    merged by log-sum-exp), float32: q, k, v as views of one fused product, as the decoder passes them; a KV cache's
    keys (prefill at a later start, keys from position 0); the thread count changes nothing but the order of tiles."""
    from sicl_fast.models.attention import Attention

    B, T, a, H, Hk, hd, window, cap = case
    qkv = rand(B, T, (H + 2 * Hk) * hd, seed=12)
    q, k, v = (t.view(B, T, -1, hd) for t in qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1))
    kp, vp = rand(1, a, Hk, hd, seed=15), rand(1, a, Hk, hd, seed=16)
    prefix = (kp, vp) if a else None
    ref = Attention("math", 0.3, cap, torch.float32, "cpu")(q, k, v, a, window, prefix)
    att = Attention("cpp", 0.3, cap, torch.float32, "cpu", cpp_ops)
    n = cpp_ops.num_threads()
    try:
        for threads in (1, 2):
            cpp_ops.set_num_threads(threads)
            close(att(q, k, v, a, window, prefix), ref, TOL["attention"][torch.float32])
    finally:
        cpp_ops.set_num_threads(n)
    # a cache's prefill: rows at positions a .. a+T-1 over keys 0 .. a+T-1 (batch 1)
    kc, vc = torch.cat([kp, k[:1]], 1), torch.cat([vp, v[:1]], 1)
    ref = Attention("math", 0.3, cap, torch.float32, "cpu")(q[:1], kc, vc, a, window, cache_len=a + T)
    close(att(q[:1], kc, vc, a, window, cache_len=a + T), ref, TOL["attention"][torch.float32])
    assert att(q[:, :0], k[:, :0], v[:, :0], a, window, prefix).shape == (B, 0, H, hd)  # no query rows


@cpp_only
@pytest.mark.parametrize("where", ["q", "k", "v", "shared k", "shared v"])
@pytest.mark.parametrize("value", ["nan", "nan with every payload bit set", "+inf"])
@pytest.mark.parametrize("hd,cap", [(16, None), (20, 2.0)], ids=["hd16", "hd20-softcap"])  # AVX-512 / plain loops
def test_cpp_attention_keeps_nan_and_inf(where, value, hd, cap):
    """A NaN or +inf in one row of q, k or v gives the output rows it reaches what the reference gives them (NaN
    through the softmax; before: its sum, NaN, was read as 'no key seen' and the rows came out 0, so a NaN-damaged
    model gave a finite proxy). The rows it does not reach are the clean output, or NaN where the reference's are
    too (a weight of 0 times NaN, for keys the row does not see but its tile reads, in both)."""
    from sicl_fast.models.attention import Attention

    B, T, a, H, Hk = 2, 6, 3, 4, 2
    q, k, v = rand(B, T, H, hd, seed=12), rand(B, T, Hk, hd, seed=13), rand(B, T, Hk, hd, seed=14)
    kp, vp = rand(1, a, Hk, hd, seed=15), rand(1, a, Hk, hd, seed=16)
    clean = Attention("math", 0.3, cap, torch.float32, "cpu")(q, k, v, a, None, (kp, vp))
    reached = torch.zeros(B, T, dtype=torch.bool)  # query row t (position a + t) sees own key j (a + j) when j <= t
    if where == "q":
        poison(q, (1, 2, 1, 3), value)
        reached[1, 2] = True
    elif where in ("k", "v"):
        poison(k if where == "k" else v, (1, 2, 0, 3), value)
        reached[1, 2:] = True
    else:
        poison(kp if where == "shared k" else vp, (0, 1, 1, 3), value)
        reached[:] = True
    ref = Attention("math", 0.3, cap, torch.float32, "cpu")(q, k, v, a, None, (kp, vp))
    got = Attention("cpp", 0.3, cap, torch.float32, "cpu", cpp_ops)(q, k, v, a, None, (kp, vp))
    torch.testing.assert_close(got[reached], ref[reached], equal_nan=True, **TOL["attention"][torch.float32])
    rest, nan = got[~reached], got[~reached].isnan()
    assert bool((nan <= ref[~reached].isnan()).all())
    close(rest[~nan], clean[~reached][~nan], TOL["attention"][torch.float32])


def test_cpp_attention_is_a_plan_choice():
    """impl 'cpp' takes the C++ attention ('auto') on any model: a difference-form pass is float32 whatever the
    weights (a bf16 model's plain forward hands its bf16 rows to the math path); off the CPU, a clear refusal."""
    if not cpp_ops.available():
        pytest.skip("the C++ extension sicl_fast.ops._C is not built")
    from sicl_fast.errors import SiclError
    from sicl_fast.run.plan import BACKENDS, resolve_attention

    kind = BACKENDS["fast"]
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_attention("auto", kind, "cpu", dtype, "cpp")[0] == "cpp"
    with pytest.raises(SiclError, match="runs on the CPU"):
        resolve_attention("cpp", kind, "cuda", torch.float32, "torch")
