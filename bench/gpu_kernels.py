"""GPU benchmark of the Triton kernels at real model shapes, printed as Markdown tables (triton.testing.do_bench).

    python bench/gpu_kernels.py                 # checks + full table (a few minutes on an H100)
    python bench/gpu_kernels.py --quick         # Llama shapes only, P = 64
    python bench/gpu_kernels.py --compile-only  # no GPU needed: every launch configuration of every family compiled
                                                # for sm_90 / sm_80: shared memory, registers, spills

(sicl_fast installed: `pip install -e .`; the kernels are its subpackage sicl_fast.kernels.)

Shapes: Llama-3.1-8B (d 4096, V 128256), Qwen3-4B (d 2560, V 151936), Gemma-2-2B (d 2304, V 256000, logit
soft-cap 30); N in {8, 16} directions (forward estimator: B = N + 1 batch rows); P in {64, 512} span positions.
The perturb / update rows: a prompt of L = 4 P tokens with the demonstration block [8, L).

    span_logprobs  Triton (bf16, float32 accumulate)  vs  torch reference (vocab_chunked_logprobs: online LSE)
    proxy          Triton                             vs  torch reference
    perturb        Triton (noise in the kernel)       vs  torch (materialised U: step.rng + step.zo.perturb)
    zo_update      Triton (noise regenerated)         vs  torch (materialised U: zo.update)

The difference form's kernels (sicl_fast.models.rows; one decoder layer's epilogues, its attention and the span head
of a perturbation pass of B = N + 1 rows of T = P tokens after a kept prefix of 16 rows; SmolLM2-135M's shapes
besides: d 576, 9 / 3 heads of 64, I 1536, V 49152), the value rows against their float32 references as a run calls
them, each against the torch reference it replaces:

    norm_rows / rope_rows / gated_rows   Triton (one launch; norm_rows also without references)
                                                                    vs  sicl_fast.models.rows' references
    attention_rows                       Triton (one launch, float32 products at tf32x3; also IEEE and 1 row
                                         a program)                 vs  attention_rows_reference (math path)
    span_logprobs_rows                   Triton (two launches; also 64 x 128 tiles, and without the reference
                                         logits)                    vs  step.logprobs.rows_logprobs

Columns: time (ms, do_bench mean), TFLOP/s and % of the bf16 dense peak (span_logprobs: 2 B P V d), GB/s and
% of the memory bandwidth peak (bytes that must move at least once: weights + inputs + outputs). Peaks come from
the device name (H100 SXM / H200 / A100 tables below) or --peak-tflops / --peak-gbps.
Before timing, a few parity checks run on the GPU (bit-identity of the noise with sicl_fast.step.rng,
span_logprobs / proxy / update against the torch references) and print PASS / FAIL.
"""
from __future__ import annotations

import argparse
import os
import sys

from sicl_fast.kernels._configs import FAMILIES

# the difference form's layer shapes (d, V, final soft-cap, heads H / Hk of hd, MLP I, attention soft-cap, q / k norms)
# of each family: the one table, sicl_fast.kernels._configs.FAMILIES (its real shapes; not the tests' own)
ROWS_MODELS = {name: {"softcap": None, "attn_cap": None, "qk_norm": False, **f} for name, f in FAMILIES.items()
               if f.get("aligned", True)}
MODELS = {k: ROWS_MODELS[k] for k in ("Llama-3.1-8B", "Qwen3-4B", "Gemma-2-2B")}  # the older kernels' shapes
ROWS_PREFIX = 16  # the kept prefix the batch rows attend to
PEAKS = {  # name fragment -> (bf16 dense TFLOP/s, GB/s)
    "H200": (989.0, 4800.0),
    "H100 PCIe": (756.0, 2000.0),
    "H100": (989.0, 3350.0),
    "A100": (312.0, 2039.0),
    "L40S": (362.0, 864.0),
}


def compile_only(jobs: int, archs=(90, 80)) -> int:
    """No GPU: every launcher's configuration at every family's shapes (sicl_fast.kernels._configs.family_cases: each
    dtype, length, N, estimator and flag set of FAMILIES) compiled for each arch as the JIT specialises it, through
    the compile cache (`jobs` child interpreters for what it lacks). Prints, per arch, each kernel's cases with the
    most registers, stack (a spill) and shared memory, then every problem (_configs.problems); exit status 1 when
    there is one."""
    import time

    from sicl_fast.kernels import _configs as C

    cases = list(dict.fromkeys(c for name in C.FAMILIES for c in C.family_cases(name)))
    bad = []
    for arch in archs:
        t0 = time.perf_counter()
        got = C.compile_cases(cases, arch, jobs=jobs)
        print(f"\n## sm_{arch}: {len(cases)} launch configurations of {len(C.FAMILIES)} families "
              f"({time.perf_counter() - t0:.0f} s with the compile cache {C.cache_dir()})\n")
        print("| kernel | cases | registers (max) | stack B (max) | shared B (max) | at most shared |")
        print("|---|---|---|---|---|---|")
        for spec in C._aot.SPECS:
            mine = [(c, r) for c, r in got.items() if c.spec == spec and not r.get("error")]
            if not mine:
                continue
            top = max(mine, key=lambda cr: cr[1]["shared"])
            print(f"| {spec} | {len(mine)} | {max(r['regs'] for _, r in mine)} | {max(r['stack'] for _, r in mine)} | "
                  f"{top[1]['shared']:,} | {top[0].what} |")
        for c, r in got.items():
            bad += C.problems(c, r, arch)
    print("\n" + ("\n".join(f"- PROBLEM: {p}" for p in bad) if bad else "No problem: every configuration compiles "
                                                                         "within the block's shared memory, without "
                                                                         "a spill on sm_90."))
    return 1 if bad else 0


def rows_section(add, dev, do_bench, models, Ns, Ts, torch_too: bool = True, check: bool = True) -> list:
    """The difference form's kernels (module docstring) at each model of `models` (ROWS_MODELS entries), N in Ns
    (B = N + 1), T in Ts: rows of `add` (time, TFLOP/s, GB/s), and [(what, ok)] parity checks against the references
    when `check`. dev: a CUDA device (or the CPU under TRITON_INTERPRET=1 with a stand-in do_bench: the smoke test).
    As a run calls them: the value rows (batch row 0) against their float32 references (each product's input and
    output reference, the span head's reference logits); 'no reference': the values rounded as they are."""
    import math

    import torch

    from sicl_fast import kernels as K
    from sicl_fast.step.logprobs import rows_logprobs
    from sicl_fast.models.attention import Attention, attention_rows_reference
    from sicl_fast.models.rows import (RowLayout, gated_rows_reference, norm_rows_reference, rope_rows_reference,
                                       to_rows)

    checks = []

    def near(R, k, B, T, scale=1.0):  # [R, k] float32: row 0's tokens random, the other rows near them
        x = scale * torch.randn(1, T, k, device=dev)
        return (x + 1e-2 * scale * torch.randn(B, T, k, device=dev) * (torch.arange(B, device=dev) > 0).view(-1, 1, 1)
                ).view(R, k)

    def ref_of(x, T):  # a float32 reference of x's value rows (batch row 0's T rows) [T, k], a few per cent away
        v = x[:T]
        return v + 0.03 * v.abs().mean() * torch.randn_like(v)

    def form_close(got, ref):  # difference-form outputs: within a bf16 ulp (tests/test_rows_ops.py's bound, roughly)
        got, ref = got.float(), ref.float()
        return bool(((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-5).all())

    for model, m in models.items():
        d, H, Hk, hd, I = m["d"], m["H"], m["Hk"], m["hd"], m["I"]
        W = (torch.randn(m["V"], d, device=dev) * 0.02).to(torch.bfloat16)
        for N in Ns:
            B = N + 1
            for T in Ts:
                rows = RowLayout.build(0, B, T, ROWS_PREFIX, device=dev)
                R = rows.R
                w = torch.rand(d, device=dev) + 0.5
                x, yf = near(R, d, B, T), near(R, d, B, T)
                y_ref, h_ref = ref_of(yf, T), ref_of(x, T)
                y, y0 = to_rows(yf, rows, ref=y_ref), to_rows(yf, rows)
                nb = R * d * (4 + 2 + 4 + 2) + 2 * T * d * 4
                add(model, "norm_rows", N, T, B, "triton", do_bench(
                    lambda: K.norm_rows(x, y, None, w, w, 1e-6, False, rows, y_ref, h_ref)), None, nb)
                add(model, "norm_rows", N, T, B, "triton, no reference", do_bench(
                    lambda: K.norm_rows(x, y0, None, w, w, 1e-6, False, rows)), None, nb - 2 * T * d * 4)
                if torch_too:
                    add(model, "norm_rows", N, T, B, "torch reference",
                        do_bench(lambda: norm_rows_reference(x, y, None, w, w, 1e-6, False, rows, y_ref, h_ref)), None,
                        nb)
                if check:
                    got = K.norm_rows(x, y, None, w, w, 1e-6, False, rows, y_ref, h_ref)
                    ref = norm_rows_reference(x, y, None, w, w, 1e-6, False, rows, y_ref, h_ref)
                    checks.append((f"{model} norm_rows vs reference", torch.allclose(got[0], ref[0], rtol=1e-5,
                                                                                      atol=1e-5)
                                   and form_close(got[1], ref[1])))
                x = y = y0 = yf = y_ref = h_ref = None
                n_qkv = (H + 2 * Hk) * hd
                f = near(R, n_qkv, B, T)
                qkv_ref = ref_of(f, T)
                qkv = to_rows(f, rows, ref=qkv_ref)
                f = None
                pos = torch.arange(ROWS_PREFIX + T, device=dev, dtype=torch.float32)[:, None] / (
                    1 + torch.arange(hd // 2, device=dev))[None]
                cos, sin = torch.cat([pos.cos()] * 2, 1), torch.cat([pos.sin()] * 2, 1)
                qn = kn = (torch.rand(hd, device=dev) + 0.5) if m["qk_norm"] else None
                k_out, v_out = (torch.empty(R, Hk, hd, device=dev) for _ in range(2))
                nb = R * n_qkv * (2 + 4) + T * n_qkv * 4
                rope = lambda: K.rope_rows(qkv, None, rows, cos, sin, qn, kn, 1e-6, False, H, Hk, k_out,  # noqa: E731
                                           v_out, qkv_ref)
                add(model, "rope_rows", N, T, B, "triton", do_bench(rope), None, nb)
                if torch_too:
                    add(model, "rope_rows", N, T, B, "torch reference", do_bench(
                        lambda: rope_rows_reference(qkv, None, rows, cos, sin, qn, kn, 1e-6, False, H, Hk, k_out,
                                                    v_out, qkv_ref)), None, nb)
                if check:
                    q = rope()
                    k_ref, v_ref = torch.empty_like(k_out), torch.empty_like(v_out)
                    q_ref = rope_rows_reference(qkv, None, rows, cos, sin, qn, kn, 1e-6, False, H, Hk, k_ref, v_ref,
                                                qkv_ref)
                    checks.append((f"{model} rope_rows vs reference", all(
                        torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in ((q, q_ref), (k_out, k_ref),
                                                                                (v_out, v_ref)))))
                qkv = qkv_ref = None
                f = near(R, 2 * I, B, T)
                gu_ref, a_ref = ref_of(f, T), ref_of(near(R, I, B, T), T)
                gu = to_rows(f, rows, ref=gu_ref)
                f = None
                nb = R * I * (4 + 2) + T * I * 4 * 3
                add(model, "gated_rows", N, T, B, "triton", do_bench(
                    lambda: K.gated_rows(gu, None, "silu", rows, gu_ref, a_ref)), None, nb)
                if torch_too:
                    add(model, "gated_rows", N, T, B, "torch reference",
                        do_bench(lambda: gated_rows_reference(gu, None, "silu", rows, gu_ref, a_ref)), None, nb)
                if check:
                    got = K.gated_rows(gu, None, "silu", rows, gu_ref, a_ref)
                    ref = gated_rows_reference(gu, None, "silu", rows, gu_ref, a_ref)
                    checks.append((f"{model} gated_rows vs reference (a bf16 ulp)", form_close(got, ref)))
                gu = gu_ref = a_ref = None
                # attention: the batch rows over a kept prefix, causal among their own keys
                q = near(R, H * hd, B, T).view(R, H, hd)
                k, v = (near(R, Hk * hd, B, T).view(R, Hk, hd) for _ in range(2))
                prefix = tuple(torch.randn(1, ROWS_PREFIX, Hk, hd, device=dev) for _ in range(2))
                scale, cap = hd ** -0.5, m["attn_cap"]
                ref_attn = Attention("math", scale, cap, torch.float32, dev)
                o_ref = ref_of(attention_rows_reference(ref_attn, q, k, v, rows, None, prefix, dtype=torch.float32), T)
                flops = 4.0 * H * hd * B * (T * ROWS_PREFIX + T * (T + 1) / 2)
                nb = R * (H + 2 * Hk) * hd * 4 + R * H * hd * 2 + T * H * hd * 4
                for impl, kw in (("triton (tf32x3)", {}), ("triton ieee", {"precision": "ieee"}),
                                 ("triton 1 row a program", {"rows_per_program": 1})):
                    add(model, "attention_rows", N, T, B, impl, do_bench(
                        lambda kw=kw: K.attention_rows(q, k, v, rows, prefix, scale, cap, None, o_ref, **kw)), flops,
                        nb)
                if torch_too:
                    add(model, "attention_rows", N, T, B, "torch reference (math)", do_bench(
                        lambda: attention_rows_reference(ref_attn, q, k, v, rows, None, prefix, o_ref)), flops, nb)
                if check:
                    ref = attention_rows_reference(ref_attn, q, k, v, rows, None, prefix, o_ref).float()
                    for impl, kw in (("tf32x3", {}), ("ieee", {"precision": "ieee"})):
                        got = K.attention_rows(q, k, v, rows, prefix, scale, cap, None, o_ref, **kw).float()
                        err = float(((got - ref).abs() - ref.abs() * 2 ** -7).max())
                        checks.append((f"{model} attention_rows ({impl}) vs reference: {err:.2e} beyond a bf16 ulp",
                                       err <= 1e-5))
                q = k = v = prefix = o_ref = None
                # span head: P = T / 4 span positions of the pass; the value row's reference logits [1, P, V]
                P = max(1, T // 4)
                span = RowLayout.build(0, B, P, 0, device=dev)
                hf = near(B * P, d, B, P, scale=2.0)
                h_ref = ref_of(hf, P)
                z_ref = (h_ref @ W.float().t()).view(1, P, m["V"])
                hid = to_rows(hf, span, ref=h_ref).view(B, P, d)
                hid0 = to_rows(hf, span).view(B, P, d)
                hf = h_ref = None
                tgt = torch.randint(0, m["V"], (P,), device=dev)
                flops, nb = 2.0 * B * P * m["V"] * d, m["V"] * d * 2 + B * P * d * 2 + B * P * 4 + P * m["V"] * 4
                for impl, kw in (("triton", {}), ("triton 64 x 128", {"config": {"BLOCK_V": 128}})):
                    add(model, "span_logprobs_rows", N, P, B, impl, do_bench(
                        lambda kw=kw: K.span_logprobs_rows(hid, W, tgt, span.anchor, m["softcap"], z_ref,
                                                           span.value_slot, **kw)), flops, nb)
                add(model, "span_logprobs_rows", N, P, B, "triton, no reference", do_bench(
                    lambda: K.span_logprobs_rows(hid0, W, tgt, span.anchor, softcap=m["softcap"])), flops,
                    nb - P * m["V"] * 4)
                if torch_too:
                    add(model, "span_logprobs_rows", N, P, B, "torch reference", do_bench(
                        lambda: rows_logprobs(hid, W, tgt, span.anchor, m["softcap"], z_ref, span.value_slot)), flops,
                        nb)
                if check:
                    got = K.span_logprobs_rows(hid, W, tgt, span.anchor, m["softcap"], z_ref, span.value_slot)
                    ref = rows_logprobs(hid, W, tgt, span.anchor, m["softcap"], z_ref, span.value_slot)
                    checks.append((f"{model} span_logprobs_rows vs rows_logprobs (1e-4)",
                                   torch.allclose(got, ref, rtol=0, atol=1e-4) and not math.isnan(float(got.sum()))))
                hid = hid0 = z_ref = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        W = None
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B only, P = 64")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile every launch configuration at every "
                    "family's shapes for sm_90 and sm_80 and report resources and problems")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="--compile-only: compiles at once")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    ap.add_argument("--no-check", action="store_true", help="skip the GPU parity checks")
    ap.add_argument("--rows-only", action="store_true", help="only the difference form's kernels")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbps", type=float, default=None)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.jobs)

    import torch

    if not torch.cuda.is_available():
        print("No CUDA device: bench/gpu_kernels.py times the Triton kernels on a GPU. Nothing to do here "
              "(try --compile-only, or bench/bench_kernels.py for the CPU).")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to time the compiled kernels.")
        return 1

    import triton
    from triton.testing import do_bench

    from sicl_fast import kernels as K
    from sicl_fast.step import rng, zo
    from sicl_fast.step.logprobs import vocab_chunked_logprobs
    from sicl_fast.ops import TorchStepOps
    from sicl_fast.step.proxy import proxy as torch_proxy
    from sicl_fast.formats.spans import span_offsets
    from sicl_fast.step.spec import StepSpec

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak_t, peak_bw = next((v for k, v in PEAKS.items() if k in name), (None, None))
    peak_t = args.peak_tflops or peak_t
    peak_bw = args.peak_gbps or peak_bw
    print(f"# Triton kernels on {name} (triton {triton.__version__}, torch {torch.__version__})\n")
    print(f"peaks used: {peak_t} TFLOP/s bf16 dense, {peak_bw} GB/s\n")

    if not args.no_check:
        checks = []
        U = K.randn(3, 5, 4, 7, 1000, device=dev)
        checks.append(("randn bit-identical to sicl_fast.step.rng",
                       torch.equal(U.cpu(), rng.directions(3, 5, 4, 7, 1000))))
        X = torch.randn(40, 128, device=dev)
        X0 = X + 0.1 * torch.randn_like(X)
        for est in ("forward", "central"):
            s = StepSpec(L=40, d=128, a=5, b=35, N=4, mu=0.05, eta=0.5, kappa=0.99, seed=1, estimator=est)
            ref = zo.perturb(X.cpu(), rng.directions(1, 2, 4, 30, 128), s)
            checks.append((f"perturb ({est}) bit-identical to zo.perturb", torch.equal(K.perturb(X, 2, s).cpu(), ref)))
        f = torch.rand(5, device=dev)
        s = StepSpec(L=40, d=128, a=5, b=35, N=4, mu=0.05, eta=0.5, kappa=0.99, seed=1)
        got, fired = K.zo_update(X, X0, f, 2, s)
        ref, fr = zo.update(X.cpu(), X0.cpu(), f.cpu(), rng.directions(1, 2, 4, 30, 128), s)
        checks.append(("zo_update vs zo.update (1e-5)", bool(fired.item()) == fr
                       and torch.allclose(got.cpu(), ref, rtol=1e-5, atol=1e-6)))
        for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-3)):
            h = torch.randn(3, 17, 200, device=dev).to(dt)
            w = (torch.randn(5003, 200, device=dev) * 0.1).to(dt)
            t = torch.randint(0, 5003, (17,), device=dev)
            out = K.span_logprobs(h, w, t, softcap=30.0)
            ref = vocab_chunked_logprobs(h.float(), w.float(), t, softcap=30.0)
            checks.append((f"span_logprobs {dt} vs float32 reference ({tol})",
                           torch.allclose(out, ref, rtol=0, atol=tol)))
        lp = -torch.rand(9, 100, device=dev) * 5
        offs = span_offsets([10] * 10)
        a, b = K.proxy(lp, offs), torch_proxy(lp, offs)
        checks.append(("proxy vs reference (1e-5)", torch.allclose(a.f, b.f, rtol=1e-5, atol=1e-7)
                       and torch.allclose(a.R, b.R, rtol=1e-5, atol=1e-7)))
        for what, ok in checks:
            print(f"- {'PASS' if ok else 'FAIL'}: {what}")
        print()

    def pct(x, peak):
        return f"{100 * x / peak:.1f}%" if peak else "-"

    rows = []

    def add(model, op, N, P, B, impl, ms, flops=None, nbytes=None):
        tf = flops / ms / 1e9 if flops else None
        gbps = nbytes / ms / 1e6 if nbytes else None
        rows.append((model, op, N, P, B, impl, f"{ms:.3f}", f"{tf:.1f}" if tf else "-", pct(tf, peak_t) if tf else "-",
                     f"{gbps:.0f}" if gbps else "-", pct(gbps, peak_bw) if gbps else "-"))

    models = {} if args.rows_only else {"Llama-3.1-8B": MODELS["Llama-3.1-8B"]} if args.quick else MODELS
    Ps = (64,) if args.quick else (64, 512)
    for model, m in models.items():
        d, V, cap = m["d"], m["V"], m["softcap"]
        W = (torch.randn(V, d, device=dev) * 0.02).to(torch.bfloat16)
        for N in (8, 16):
            B = N + 1
            for P in Ps:
                # span_logprobs
                h = torch.randn(B, P, d, device=dev).to(torch.bfloat16)
                t = torch.randint(0, V, (P,), device=dev)
                flops = 2.0 * B * P * V * d
                nbytes = V * d * 2 + B * P * d * 2 + B * P * 4
                ms = do_bench(lambda: K.span_logprobs(h, W, t, softcap=cap))
                add(model, "span_logprobs", N, P, B, "triton", ms, flops, nbytes)
                if not args.no_torch:
                    ms = do_bench(lambda: vocab_chunked_logprobs(h, W, t, softcap=cap))
                    add(model, "span_logprobs", N, P, B, "torch vocab-chunked", ms, flops, nbytes)
                h = None  # its memory freed before the next shape (the timed lambdas are done with it)
                # proxy
                lp = -torch.rand(B, P, device=dev) * 5
                offs = span_offsets([P // 8] * 8).to(dev)
                ms = do_bench(lambda: K.proxy(lp, offs, check_values=False))
                add(model, "proxy", N, P, B, "triton", ms, None, B * P * 4 + B * 4 * 13)
                if not args.no_torch:
                    ms = do_bench(lambda: torch_proxy(lp, offs))
                    add(model, "proxy", N, P, B, "torch", ms, None, B * P * 4 + B * 4 * 13)
                # perturb + update
                L, a = 4 * P, 8
                X0 = torch.randn(L, d, device=dev) * 0.02
                X = X0 + 1e-3 * torch.randn_like(X0)
                f = torch.rand(B, device=dev)
                spec = StepSpec(L=L, d=d, a=a, b=L, N=N, mu=0.004, eta=0.05, kappa=0.2, seed=1)
                out = torch.empty(B, L, d, device=dev)
                ms = do_bench(lambda: K.perturb(X, 3, spec, out=out))
                add(model, "perturb", N, P, B, "triton", ms, None, L * d * 4 + B * L * d * 4)
                ms = do_bench(lambda: K.zo_update(X, X0, f, 3, spec))
                add(model, "zo_update", N, P, B, "triton", ms, None, 3 * L * d * 4)
                if not args.no_torch:
                    ops = TorchStepOps()
                    ms = do_bench(lambda: ops.perturb(X, 3, spec), rep=20)
                    add(model, "perturb", N, P, B, "torch (U stored)", ms, None, L * d * 4 + B * L * d * 4)
                    ms = do_bench(lambda: ops.update(X, X0, f, 3, spec), rep=20)
                    add(model, "zo_update", N, P, B, "torch (U stored)", ms, None, 3 * L * d * 4)
                out = X = X0 = None
                torch.cuda.empty_cache()
        W = None
        torch.cuda.empty_cache()

    rows_models = {k: ROWS_MODELS[k] for k in ("SmolLM2-135M", "Llama-3.1-8B")} if args.quick else ROWS_MODELS
    checks = rows_section(add, dev, do_bench, rows_models, (8,) if args.quick else (8, 16), (256,) if args.quick
                          else (256, 1024), torch_too=not args.no_torch, check=not args.no_check)
    for what, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {what}")
    print("\n(the difference form's rows: P is the tokens a batch row runs, T; span_logprobs_rows: its span "
          "positions, T / 4)\n")

    print("| model | op | N | P | B | impl | time (ms) | TFLOP/s | % peak FLOP/s | GB/s | % peak BW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
