"""The engine on a CUDA GPU against the same engine on the CPU (every test here is marked `cuda` and skipped
without one; the kernel modules' own tests also run on the GPU there, through conftest.TRITON_DEVICE).

    fast backend span log-probs      CUDA (float32 / bfloat16) vs the CPU's float32, every supported family
    Philox directions                the torch reference on CUDA == on the CPU, bit for bit
    kernels in three dtypes          span_logprobs and proxy on CUDA vs the torch reference, fp32 / fp16 / bf16
    seeded calibration               Triton ops + static loop on CUDA vs torch ops on the CPU (same steps, stop,
                                     best step; history and embeddings to float32 tolerance)
    CUDA graphs                      captured step and decode == the uncaptured path on CUDA, bit for bit,
                                     across prompts of one shape, a new shape and a new prompt length; two
                                     lengths in one length bucket share a graph (test_buckets.py's tolerances);
                                     two buckets on one pool, an evicted bucket captured again; the reference
                                     refresh's own graph replayed in place past step 16 (bit for bit)
    refresh products                 a bf16 model's split reference == float32 products (cuBLAS's float32 output);
                                     the split product at the models' inner sizes (k 576 - 14336) against float64
    device auto                      CUDA, with the GPU's run plan
    FP8 and packing                  torch._scaled_mm's FP8 differences track float32; the packed step == one by one
    decoding                         greedy answer on CUDA == on the CPU (float32)

Tolerances: float32 on CUDA vs the CPU 2e-4 absolute on log-probs (TF32 is off; the difference is reduction
order); bfloat16 0.1 (8 mantissa bits through 3 layers of a random model, log-probs of magnitude ~5).
"""
import pytest
import torch

from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.engine import Engine
from sicl_fast.models import from_transformers
from conftest import needs_default_model
from test_fast_backend import SUPPORTED_FAMILIES, CharTokenizer, build, make_prompt, perturbed
from test_graphs import moved
from test_static import BASE, assert_same_result
from sicl_fast.kernels._configs import FAMILIES

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True, scope="module")
def no_tf32():
    """float32 products in float32 (TF32 would make the CUDA float32 path a 10-bit one)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def on_cuda(lm_cpu, dtype=torch.float32):
    """The same random-weight model, copied to CUDA in `dtype`."""
    import copy

    model = copy.deepcopy(lm_cpu.model).to("cuda", dtype)
    return from_transformers(model, CharTokenizer(), name=f"{lm_cpu.name}-cuda-{dtype}")


@pytest.fixture(scope="module")
def cpu_models():
    return {f: build(f) for f in SUPPORTED_FAMILIES}


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 0.1)])
def test_fast_span_logprobs_on_cuda_match_the_cpu(cpu_models, family, dtype, atol):
    ref_be = make_backend("fast-fp32", cpu_models[family], impl="torch")
    # fast-fp32: float32 products throughout (the 'fast' backend's bf16 difference products are another test's)
    be = make_backend("fast-fp32" if dtype == torch.float32 else "fast", on_cuda(cpu_models[family], dtype))
    assert be.ops.name == "triton"
    for a in (0, 6, 14):  # no prefix; a prefix; a span starting right at the prefix's end
        p = make_prompt(a, seed=a)
        X = perturbed(ref_be.embed(p), a)
        want = ref_be.span_logprobs(X, p, near_row0=True)
        got = be.span_logprobs(X.cuda(), p, near_row0=True)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=atol)


def test_philox_directions_on_cuda_equal_the_cpu_bit_for_bit():
    from sicl_fast.step import rng

    for seed, step, shape in ((0, 0, (3, 5, 37)), (2**32 - 1, 7, (2, 3, 129)), (12345, 2**31 + 5, (1, 1, 1000))):
        cpu = rng.directions(seed, step, *shape)
        gpu = rng.directions(seed, step, *shape, device="cuda")
        assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 0.05)])
def test_span_head_and_proxy_kernels_in_each_dtype(K, dtype, atol):
    from conftest import span_logprobs_oracle
    from sicl_fast.step.proxy import proxy

    g = torch.Generator().manual_seed(0)
    B, P, d, V = 9, 37, 96, 1000
    h = (torch.randn(B, P, d, generator=g) * 0.5).to("cuda", dtype)
    w = (torch.randn(V, d, generator=g) * 0.1).to("cuda", dtype)
    t = torch.randint(0, V, (P,), generator=g).cuda()
    want = span_logprobs_oracle(h.float(), w.float(), t)
    got = K.span_logprobs(h, w, t)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    offsets = torch.tensor([0, 5, 6, 20, 37])
    lp = want.to(dtype)
    ref, out = proxy(lp.float().cpu(), offsets), K.proxy(lp, offsets.cuda())
    torch.testing.assert_close(out.f.cpu(), ref.f, rtol=1e-5, atol=1e-6)


def test_seeded_calibration_on_cuda_matches_the_cpu(cpu_models):
    cfg = CalibrationConfig(**{**BASE, "max_steps": 6})
    p = make_prompt(6, seed=1)
    ref = Calibrator(make_backend("fast-fp32", cpu_models["llama"], impl="torch"), cfg).run(p)
    eng = Engine(on_cuda(cpu_models["llama"]), backend="fast-fp32", graphs="off")
    got = eng.calibrate(p, cfg)
    assert (got.steps, got.stop_reason, got.best_step, got.projections) == (ref.steps, ref.stop_reason,
                                                                             ref.best_step, ref.projections)
    torch.testing.assert_close(torch.tensor(got.history), torch.tensor(ref.history), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.embeddings.cpu(), ref.embeddings, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_equal_the_uncaptured_path_on_cuda(cpu_models, dtype):
    lm = on_cuda(cpu_models["gemma2"], dtype)
    eager = Engine(lm, backend="fast", graphs="off", sync_every=3)
    graphed = Engine(lm, backend="fast", graphs="on", sync_every=3, graph_cache=2, length_buckets="off")
    cfg = CalibrationConfig(**{**BASE, "max_steps": 7})
    prompts = [make_prompt(6, seed=1), moved(6, seed=2), make_prompt(0, seed=3), make_prompt(6, seed=1)]
    for p in prompts:  # a shape, the same shape again, a new shape, the first shape
        assert_same_result(graphed.calibrate(p, cfg), eager.calibrate(p, cfg))
    assert graphed.steps.cache.stats == {"builds": 2, "hits": 2}
    for n, tokens in ((48, 12), (30, 6), (20, 9)):  # three prompt lengths, one decode graph
        X = eager.backend.embed(make_prompt(6, seed=n))[:n]
        assert graphed.backend.generate(X, None, tokens).token_ids == eager.backend.generate(X, None, tokens).token_ids
    assert graphed.backend.decoders.stats == {"builds": 1, "hits": 2}


def test_length_buckets_share_one_graph_on_cuda(cpu_models):
    """Two prompt lengths in one bucket: one capture (the graphs' shared pool), each run within test_buckets.py's
    tolerances of the uncaptured, unpadded run."""
    from conftest import synthetic_prompt
    from test_buckets import assert_close_run
    from test_fast_backend import V

    lm = on_cuda(cpu_models["gemma2"])
    eager = Engine(lm, backend="fast", graphs="off", length_buckets="off", sync_every=3)
    graphed = Engine(lm, backend="fast", graphs="on", sync_every=3)
    assert graphed.plan.length_buckets == 4 and graphed.plan.graph_cache == 16
    cfg = CalibrationConfig(**{**BASE, "max_steps": 7})
    prompts = [synthetic_prompt(41, [(10, 14), (20, 26)], 6, V, seed=1),  # test_buckets.py's pair: one bucket
               synthetic_prompt(43, [(9, 12), (21, 27)], 6, V, seed=2)]
    assert len({graphed.steps.bucket(graphed.backend, cfg, p) for p in prompts}) == 1
    for p in prompts:
        assert_close_run(graphed.calibrate(p, cfg), eager.calibrate(p, cfg))
    assert graphed.steps.cache.stats == {"builds": 1, "hits": 1}


def test_two_buckets_share_one_pool_and_an_evicted_one_is_captured_again_on_cuda(cpu_models):
    """Two prompts in two length buckets: two steps captured, each with its refresh's graph, all on the StepCache's
    one memory pool; with room for one step, the first bucket's step is dropped for the second and captured again
    when its prompt comes back, and gives the same run. Each run within test_buckets.py's tolerances of the
    uncaptured, unpadded run."""
    from conftest import synthetic_prompt
    from test_buckets import assert_close_run
    from test_fast_backend import V

    lm = on_cuda(cpu_models["gemma2"])
    eager = Engine(lm, backend="fast", graphs="off", length_buckets="off", sync_every=3)
    graphed = Engine(lm, backend="fast", graphs="on", sync_every=3)
    cfg = CalibrationConfig(**{**BASE, "max_steps": 7})
    prompts = [synthetic_prompt(41, [(10, 14), (20, 26)], 6, V, seed=1),  # rows 28
               synthetic_prompt(60, [(10, 14), (20, 40)], 6, V, seed=2)]  # rows 40
    assert len({graphed.steps.bucket(graphed.backend, cfg, p) for p in prompts}) == 2
    for p in prompts:
        assert_close_run(graphed.calibrate(p, cfg), eager.calibrate(p, cfg))
    assert graphed.steps.cache.stats == {"builds": 2, "hits": 0}
    pool = graphed.steps.pool
    for st, run in graphed.steps.cache.entries.values():
        assert run.pool is pool and st.forward._refresh_graph[1].pool is pool
    small = Engine(lm, backend="fast", graphs="on", sync_every=3, graph_cache=1)
    first = small.calibrate(prompts[0], cfg)
    small.calibrate(prompts[1], cfg)
    assert_same_result(small.calibrate(prompts[0], cfg), first)
    assert small.steps.cache.stats == {"builds": 3, "hits": 0} and len(small.steps.cache) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_refresh_replays_in_place_between_step_replays_on_cuda(cpu_models, dtype):
    """Past REFRESH_EVERY steps (20 here, a refresh after step 16): the captured run, whose reference refresh is a
    graph of its own replayed between two step replays, equals the uncaptured run bit for bit; a replay of that
    graph writes the reference the eager refresh writes, in the same tensors. bf16 weights: the refresh's products
    from bf16 pieces with float32 accumulation (torch.mm's out_dtype), no float32 copy of a weight."""
    from sicl_fast.run.graphs import CapturedStep

    lm = on_cuda(cpu_models["llama"], dtype)
    eager = Engine(lm, backend="fast", graphs="off", length_buckets="off", sync_every=4)
    graphed = Engine(lm, backend="fast", graphs="on", length_buckets="off", sync_every=4)
    cfg = CalibrationConfig(**{**BASE, "max_steps": 20})
    p = make_prompt(6, seed=1)
    assert_same_result(graphed.calibrate(p, cfg), eager.calibrate(p, cfg))
    (st, run), = graphed.steps.cache.entries.values()
    fwd = st.forward
    assert isinstance(run, CapturedStep) and fwd.refresh_every == 16 and fwd._refresh_graph[0] is st.state.X
    ref, z = fwd._reference(st.state.X)
    kept = [t.data_ptr() for t in fwd.ref.tensors()]
    fwd.refresh(st.state.X)  # the graph's replay
    assert [t.data_ptr() for t in fwd.ref.tensors()] == kept
    assert all(torch.equal(a, b) for a, b in zip(fwd.ref.tensors(), ref.tensors())) and torch.equal(fwd.z_ref, z)


def test_a_bf16_models_split_reference_equals_float32_products_on_cuda(cpu_models, monkeypatch):
    """cuBLAS's bf16 products of the rows' bf16 pieces, accumulated in float32, against the reference made with a
    float32 copy of the weights: within test_refresh.py's 1e-5 of each tensor's largest element."""
    from sicl_fast.models import reference

    lm = on_cuda(cpu_models["llama"], torch.bfloat16)
    be = make_backend("fast", lm)
    p = make_prompt(6)
    fwd = be.step_forward(p, "pass", 4, be.embed(p))
    X = be.embed(p)
    assert reference.splits(X.device)
    split = fwd._reference(X)
    monkeypatch.setattr(reference, "SPLIT", "off")
    copied = fwd._reference(X)
    for a, b in zip(split[0].tensors() + [split[1]], copied[0].tensors() + [copied[1]]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


INNER = sorted({k for name in ("SmolLM2-135M", "Gemma-2-2B", "Llama-3.1-8B")
                for k in (FAMILIES[name]["d"], FAMILIES[name]["H"] * FAMILIES[name]["hd"], FAMILIES[name]["I"])})


@pytest.mark.parametrize("k", INNER)
def test_the_split_reference_product_at_the_models_inner_sizes_on_cuda(k):
    """A bf16 weight's float32 product from 3 bf16 pieces of the rows (cuBLAS's bf16 product with a float32 output,
    reductions in float32: sicl_fast.models.reductions) at the inner sizes of SmolLM2's, Gemma-2-2B's and
    Llama-3.1-8B's four products, against the float64 product, relative to sum |x_i w_i|: within 16x the error of
    cuBLAS's IEEE float32 product of the same operands plus 2e-6. The emulated tensor-core accumulation (truncating, a
    group of 16 products at a time) gives 1.2e-6 at k 14336 and 2e-8 in float32's round to nearest
    (bench/tensor_core_products.py, RESULTS 31): a GPU that truncates more than modelled fails here, one that rounds
    as modelled passes."""
    from sicl_fast.models import reference
    from sicl_fast.models.reductions import full_reductions
    from sicl_fast.ops import make_ops

    g = torch.Generator().manual_seed(k)
    x = torch.randn(32, k, generator=g).cuda()
    w = (torch.randn(256, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    with full_reductions():  # as the reference pass runs its products (tests/test_reductions.py)
        split = reference.reference_product(make_ops("triton", "cuda").decoder, x, w)
    ieee = torch.mm(x, w.float().t())  # TF32 off (no_tf32)
    err = lambda y: float(((y.double() - exact).abs() / scale).max())  # noqa: E731
    assert err(split) <= 16 * err(ieee) + 2e-6, (err(split), err(ieee))


@needs_default_model
def test_device_auto_is_cuda_with_the_gpus_plan():
    """device 'auto' picks CUDA here, and the default model's run plan is the GPU's (docs/gpu.md): the fast backend,
    the Triton ops, the difference form, the static loop read every 8 steps, captured in graphs per length bucket."""
    from sicl_fast.models import load
    from sicl_fast.models.loading import resolve_device

    assert resolve_device("auto") == (torch.device("cuda"), "auto: CUDA is available")
    eng = Engine(load())
    plan = eng.plan
    assert eng.lm.device.type == "cuda" and plan.backend == "fast" and plan.impl == "triton"
    assert plan.diff_matmul == "bf16" and plan.loop == "static" and plan.sync_every == 8 and plan.graphs
    assert plan.length_buckets == 4


def test_fp8_differences_take_scaled_mm_on_cuda(cpu_models, monkeypatch):
    """On sm_89+ the FP8 differences go through torch._scaled_mm and track float32 as the CPU's emulation does
    (tests/test_diff_products.py's bounds)."""
    from sicl_fast.models.transformer import DIFF_MATMUL

    if "fp8" not in DIFF_MATMUL:
        pytest.skip("this tree has no FP8 differences")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need sm_89 or later")
    calls, real = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    exact = make_backend("fast-fp32", cpu_models["llama"], impl="torch")
    fp8 = make_backend("fast", on_cuda(cpu_models["llama"]), diff_matmul="fp8")
    p = make_prompt(6)
    X = perturbed(exact.embed(p), 6, B=7, scale=0.02)
    ref, got = exact.span_logprobs(X, p), fp8.span_logprobs(X.cuda(), p, near_row0=True).cpu()
    assert calls
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0.05)
    d_ref, d_got = ref[1:] - ref[:1], got[1:] - got[:1]
    assert 0 < float((d_got - d_ref).norm() / d_ref.norm()) < 0.3


def test_packed_step_on_cuda_equals_one_by_one(cpu_models):
    """test_packed.py's prompts (one gates at step 0, slots refilled) packed three at a time with the Triton ops on
    CUDA: each result as the prompt's own calibration, to test_packed.py's tolerances."""
    from conftest import reference_backend
    from sicl_fast.calibration.packed import run_packed
    from test_packed import ITEMS, assert_close_result

    be = reference_backend("fast", on_cuda(cpu_models["llama"]), diff_matmul="off", prefix_cache=False,
                           impl="triton")
    refs = [Calibrator(be, cfg).run(p) for p, cfg in ITEMS]
    got = [None] * len(ITEMS)
    assert run_packed(be, ITEMS, pack=3, sync_every=2, on_result=got.__setitem__) == []
    for g, r in zip(got, refs):
        assert_close_result(g, r)


def test_decoding_on_cuda_matches_the_cpu(cpu_models):
    cpu = make_backend("fast-fp32", cpu_models["qwen3"], impl="torch")
    gpu = Engine(on_cuda(cpu_models["qwen3"]), backend="fast-fp32", graphs="on").backend
    X = cpu.embed(make_prompt(6, seed=4))
    assert gpu.generate(X.cuda(), None, 16).token_ids == cpu.generate(X, None, 16).token_ids
