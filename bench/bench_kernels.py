"""CPU benchmarks of the hot ops: proxy and perturb+update (C++ extension vs torch reference), and the LM head at
the span positions (chunked log-sum-exp vs full [B, P, V] logits, and the C++ span head), the difference form's
row epilogues norm_rows and gated_rows with the value rows' references (C++ vs torch reference). SmolLM2-135M
shapes (d 576, V 49152). bench/cpp_ops_ab.py compares the C++ ops of two checkouts.

Run (pytest-benchmark; not collected by the normal test run):

    python -m pytest bench/bench_kernels.py --benchmark-only -q \
        --benchmark-columns=min,mean,max,rounds --benchmark-sort=name

Time: pytest-benchmark (wall clock, `rounds` calls after one warm-up). Peak memory: from the torch profiler's
memory events (profile_memory=True): the highest running sum of tensor allocations minus frees during one call,
above the level at its start, stored in each result's extra_info["peak_mb"] and printed at the end. It sees every
torch tensor (the C++ ops' outputs included) but not the C++ code's own small scratch vectors (one [d] row per
thread and three [L] float64 arrays). Build the extension first (python setup.py build_ext --inplace); the C++
cases skip without it. The Triton kernels are benchmarked on a GPU by bench/gpu_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

from sicl_fast.diagnostics.benchmark import peak_mb
from sicl_fast.step.logprobs import vocab_chunked_logprobs
from sicl_fast.models.rows import RowLayout, to_rows
from sicl_fast.ops import cpp_ops, make_ops
from sicl_fast.formats.spans import span_offsets
from sicl_fast.step.spec import StepSpec

D, V = 576, 49152  # SmolLM2-135M
PEAKS: dict[str, float] = {}


def run(benchmark, name: str, fn, rounds: int):
    mb = peak_mb(fn)
    PEAKS[name] = mb
    benchmark.extra_info["peak_mb"] = round(mb, 2)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)


need_cpp = pytest.mark.skipif(not cpp_ops.available(), reason=f"sicl_fast.ops._C not built; {cpp_ops.BUILD_HINT}")


# ---------------------------------------------------------------- proxy
PROXY_CASES = {"B9-P64-T8": (9, [8] * 8), "B33-P512-T16": (33, [32] * 16)}


@pytest.mark.parametrize("impl", ["torch", pytest.param("cpp", marks=need_cpp)])
@pytest.mark.parametrize("case", list(PROXY_CASES))
def test_proxy(benchmark, impl, case):
    B, lengths = PROXY_CASES[case]
    benchmark.group = f"proxy {case}"
    lp = -torch.rand(B, sum(lengths), generator=torch.Generator().manual_seed(0)) * 5
    offs = span_offsets(lengths)
    ops = make_ops(impl).step
    run(benchmark, f"proxy {case} {impl}", lambda: ops.proxy(lp, offs), rounds=50)


# ---------------------------------------------------------------- perturb + update
STEP_CASES = {"N8-fwd": dict(N=8), "N16-fwd": dict(N=16), "N16-central": dict(N=16, estimator="central")}
L, A, B_END = 160, 10, 140  # a prompt of 160 tokens, 130 perturbed rows


@pytest.mark.parametrize("impl", ["torch", pytest.param("cpp", marks=need_cpp)])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_perturb_update(benchmark, impl, case):
    spec = StepSpec(L=L, d=D, a=A, b=B_END, mu=0.01, eta=0.05, kappa=0.2, seed=1, **STEP_CASES[case])
    benchmark.group = f"perturb+update {case} L{L} R{B_END - A} d{D}"
    g = torch.Generator().manual_seed(0)
    X0 = torch.randn(L, D, generator=g)
    X = X0 + 0.01 * torch.randn(L, D, generator=g)
    f = torch.rand(spec.B, generator=g)
    ops = make_ops(impl).step

    def step():
        ops.perturb(X, 3, spec)
        ops.update(X, X0, f, 3, spec)

    run(benchmark, f"perturb+update {case} {impl}", step, rounds=5 if impl == "cpp" else 3)


# ---------------------------------------------------------------- span head
SPAN_B, SPAN_P = 9, 64


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(SPAN_B, SPAN_P, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.05
    t = torch.randint(0, V, (SPAN_P,), generator=g)
    return h, w, t


def full_logits(h, w, t):
    logp = torch.log_softmax(torch.matmul(h, w.t()).float(), dim=-1)  # [B, P, V]
    return logp.gather(-1, t.view(1, -1, 1).expand(h.shape[0], -1, 1)).squeeze(-1)


SPAN_IMPLS = {
    "full-logits": full_logits,
    "vocab-chunked": vocab_chunked_logprobs,  # TorchStepOps's span head
    "cpp": cpp_ops.span_head,  # CppStepOps's: torch's products in chunks of 512, csrc/span_head.cpp's lse_chunk
}


@pytest.mark.parametrize("impl", [pytest.param(n, marks=need_cpp) if n == "cpp" else n for n in SPAN_IMPLS])
def test_span_head(benchmark, head, impl):
    h, w, t = head
    benchmark.group = f"span head B{SPAN_B} P{SPAN_P} d{D} V{V}"
    run(benchmark, f"span head {impl}", lambda: SPAN_IMPLS[impl](h, w, t), rounds=3)


# ---------------------------------------------------------------- the difference form's row epilogues
# SmolLM2 at L = 512, N = 8: B = 9 batch rows of T = 502 tokens (every row a difference from row 0), d = 576, the MLP's
# gate | up stacked (I = 1536)
ROWS_B, ROWS_T, ROWS_I = 9, 502, 1536


@pytest.fixture(scope="module")
def rows_inputs():
    rows = RowLayout.build(0, ROWS_B, ROWS_T, 10)
    g = torch.Generator().manual_seed(0)

    def near(k):  # [R, k] float32: row 0 random, the others it plus a change of about a bf16 ulp
        x = torch.randn(1, ROWS_T, k, generator=g)
        return (x + 1e-2 * torch.randn(ROWS_B, ROWS_T, k, generator=g) * (torch.arange(ROWS_B) > 0).view(-1, 1, 1)
                ).view(rows.R, k)

    def ref(k):  # [V, k] float32: a reference of the value rows (row 0's T rows), as the step passes them
        return torch.randn(rows.values, k, generator=g)

    refs = {"y": ref(D), "h": ref(D), "gu": ref(2 * ROWS_I), "a": ref(ROWS_I)}
    return (rows, near(D), to_rows(near(D), rows, ref=refs["y"]), to_rows(near(2 * ROWS_I), rows, ref=refs["gu"]),
            torch.rand(D) + 0.5, refs)


@pytest.mark.parametrize("impl", ["torch", pytest.param("cpp", marks=need_cpp)])
@pytest.mark.parametrize("op", ["norm_rows", "gated_rows"])
def test_row_epilogues(benchmark, rows_inputs, impl, op):
    """The row epilogues with the value rows' references (what the step passes)."""
    rows, x, y, gu, w, r = rows_inputs
    ops = make_ops(impl).decoder
    fn = {"norm_rows": lambda: ops.norm_rows(x, y, None, None, w, 1e-5, False, rows, r["y"], r["h"]),
          "gated_rows": lambda: ops.gated_rows(gu, None, "silu", rows, r["gu"], r["a"])}[op]
    benchmark.group = f"{op} B{ROWS_B} T{ROWS_T} d{D} I{ROWS_I}"
    run(benchmark, f"{op} {impl}", fn, rounds=5)


def teardown_module(module):
    if PEAKS:
        print("\npeak tensor memory per call (torch profiler):")
        for name, mb in PEAKS.items():
            print(f"  {name:40s} {mb:9.2f} MiB")
