"""GPU benchmark of the Triton kernels at real model shapes, printed as Markdown tables (triton.testing.do_bench).

    python bench/gpu_kernels.py                 # checks + full table (a few minutes on an H100)
    python bench/gpu_kernels.py --quick         # Llama shapes only, P = 64
    python bench/gpu_kernels.py --compile-only  # no GPU needed: registers / spills per kernel (sm_90)

(sicl_fast installed: `pip install -e .`; the kernels are its subpackage sicl_fast.kernels.)

Shapes: Llama-3.1-8B (d 4096, V 128256), Qwen3-4B (d 2560, V 151936), Gemma-2-2B (d 2304, V 256000, logit
soft-cap 30); N in {8, 16} directions (forward estimator: B = N + 1 batch rows); P in {64, 512} span positions.
The perturb / update rows: a prompt of L = 4 P tokens with the demonstration block [8, L).

    span_logprobs  Triton (bf16, float32 accumulate)  vs  torch chunked reference (bf16 matmul + float32 LSE)
    proxy          Triton                             vs  torch reference
    perturb        Triton (noise in the kernel)       vs  torch (materialised U: sicl_fast.rng + zo.perturb)
    zo_update      Triton (noise regenerated)         vs  torch (materialised U: zo.update)

Columns: time (ms, do_bench mean), TFLOP/s and % of the bf16 dense peak (span_logprobs: 2 B P V d), GB/s and
% of the memory bandwidth peak (bytes that must move at least once: weights + inputs + outputs). Peaks come from
the device name (H100 SXM / H200 / A100 tables below) or --peak-tflops / --peak-gbps.
Before timing, a few parity checks run on the GPU (bit-identity of the noise with sicl_fast.rng, span_logprobs /
proxy / update against the torch references) and print PASS / FAIL.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MODELS = {
    "Llama-3.1-8B": dict(d=4096, V=128256, softcap=None),
    "Qwen3-4B": dict(d=2560, V=151936, softcap=None),
    "Gemma-2-2B": dict(d=2304, V=256000, softcap=30.0),
}
PEAKS = {  # name fragment -> (bf16 dense TFLOP/s, GB/s)
    "H200": (989.0, 4800.0),
    "H100 PCIe": (756.0, 2000.0),
    "H100": (989.0, 3350.0),
    "A100": (312.0, 2039.0),
    "L40S": (362.0, 864.0),
}


def compile_only() -> int:
    """Compile every kernel for sm_90 (no GPU) and print registers / spills / shared memory."""
    import subprocess
    import tempfile

    import triton

    os.environ["TRITON_INTERPRET"] = "0"
    from sicl_fast.kernels import _aot as aot
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    print("| kernel | registers | spill stores (B) | shared (B) | f32 ops (PTX) |")
    print("|---|---|---|---|---|")
    for name in aot.SPECS:
        k = aot.compile_kernel(name)
        info = ""
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(k.asm["ptx"])
            r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                               capture_output=True, text=True)
            info = r.stderr
        regs = next((ln.split("Used ")[1].split(" registers")[0] for ln in info.splitlines() if "Used " in ln), "?")
        spill = next((ln.split("bytes stack frame, ")[1].split(" bytes spill stores")[0]
                      for ln in info.splitlines() if "spill stores" in ln), "?")
        ops = ", ".join(f"{op} {n}" for op, n in sorted(aot.float_ops(k.asm["ptx"]).items()))
        print(f"| {name} | {regs} | {spill} | {k.metadata.shared} | {ops} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B only, P = 64")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile for sm_90 and report resources")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    ap.add_argument("--no-check", action="store_true", help="skip the GPU parity checks")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-gbps", type=float, default=None)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()

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
    from sicl_fast import rng, zo
    from sicl_fast.logprobs import gather_logprobs_chunked
    from sicl_fast.ops import TorchStepOps
    from sicl_fast.proxy import proxy as torch_proxy
    from sicl_fast.proxy import span_offsets
    from sicl_fast.spec import StepSpec

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
        checks.append(("randn bit-identical to sicl_fast.rng", torch.equal(U.cpu(), rng.directions(3, 5, 4, 7, 1000))))
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
            ref = gather_logprobs_chunked(h.float(), w.float(), t, softcap=30.0)
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

    models = {"Llama-3.1-8B": MODELS["Llama-3.1-8B"]} if args.quick else MODELS
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
                    ms = do_bench(lambda: gather_logprobs_chunked(h, W, t, softcap=cap))
                    add(model, "span_logprobs", N, P, B, "torch chunked", ms, flops, nbytes)
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

    print("| model | op | N | P | B | impl | time (ms) | TFLOP/s | % peak FLOP/s | GB/s | % peak BW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
