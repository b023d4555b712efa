"""How exact are the fast backend's difference products (bf16, and FP8 e4m3 emulated)? Finite differences
f_i - f_0 of the proxy for one perturbation batch, against a float64 forward of the same batch (SmolLM2-135M,
synthetic prompt); and what they do to the gradient estimate the ascent uses.

    python bench/diff_accuracy.py --length 128 512 --N 8 --seeds 16

Table 1, per length and per path (fast-fp32: every product in float32; fast bf16 / fp8: difference products),
the error of f_0 and the relative error ||d - d64|| / ||d64|| of the differences d_i = f_i - f_0, plus max |d64|.
Table 2, over `--seeds` perturbation batches: the cosine between the ZO gradient estimate g (N directions) from
each path and the one from the float32 path with the same directions, against the Monte-Carlo noise of the
estimate itself: the cosine between the float32 estimates of two different seeds. A path whose cosine to float32
stays far above the noise's does not change the ascent beyond its own randomness.
"""
import argparse
import copy
import statistics

import torch

from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.benchmark import synthetic_prompt
from sicl_fast.models import load
from sicl_fast.ops import IMPLS, TorchStepOps
from sicl_fast.step import zo
from sicl_fast.step.spec import StepSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, nargs="+", default=[128])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--impl", default="auto", choices=IMPLS, help="implementation of the fast paths' hot ops")
    ap.add_argument("--seeds", type=int, default=16, help="perturbation batches of the gradient study")
    args = ap.parse_args()
    lm = load()
    lm64 = copy.copy(lm)
    lm64.model = copy.deepcopy(lm.model).double()
    f64_backend = make_backend("hf", lm64, impl="torch")
    paths = {"fast-fp32": make_backend("fast-fp32", lm, impl=args.impl),
             "fast bf16": make_backend("fast", lm, diff_matmul="bf16", impl=args.impl),
             "fast fp8": make_backend("fast", lm, diff_matmul="fp8", impl=args.impl)}
    print(f"# impl {paths['fast bf16'].ops.name}")
    print("| L | path | abs error of f_0 | rel. error of f_i - f_0 | max abs(f_i - f_0) (float64) |")
    print("|---|---|---|---|---|")
    tables = []
    for length in args.length:
        p = synthetic_prompt(lm, length)
        cfg = CalibrationConfig.for_model(lm, N=args.N)
        X0 = paths["fast-fp32"].embed(p)
        batch = TorchStepOps().perturb(X0, 0, StepSpec.build(cfg, *X0.shape, p.demo_start, p.demo_end))

        def f(backend, x, **kw):
            lp = backend.span_logprobs(x, p, **kw)
            return backend.ops.proxy(lp.float(), p.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q).f.double()

        f64 = f(f64_backend, batch.double())
        d64 = f64[1:] - f64[0]
        for name, backend in paths.items():
            got = f(backend, batch, near_row0=True)
            d = got[1:] - got[0]
            print(f"| {p.length} | {name} | {abs(float(got[0] - f64[0])):.1e} | "
                  f"{float((d - d64).norm() / d64.norm()):.1e} | {float(d64.abs().max()):.1e} |", flush=True)
        grads = {name: [] for name in paths}
        for seed in range(args.seeds):
            spec = StepSpec.build(cfg.replace(seed=seed), *X0.shape, p.demo_start, p.demo_end)
            U = zo.step_directions(0, spec)
            batch = TorchStepOps().perturb(X0, 0, spec)
            for name, backend in paths.items():
                grads[name].append(zo.estimate_gradient(f(backend, batch, near_row0=True), U, spec.mu).flatten())
        cos = lambda a, b: float(torch.dot(a, b) / (a.norm() * b.norm()))  # noqa: E731
        exact = grads["fast-fp32"]
        noise = [cos(exact[s], exact[(s + 1) % len(exact)]) for s in range(len(exact))]
        tables.append(f"| {p.length} | float32, two different seeds (Monte-Carlo noise) | "
                      f"{statistics.mean(noise):.4f} | {min(noise):.4f} |")
        for name in paths:
            if name != "fast-fp32":
                c = [cos(g, r) for g, r in zip(grads[name], exact)]
                tables.append(f"| {p.length} | {name} vs float32, same directions | {statistics.mean(c):.4f} | "
                              f"{min(c):.4f} |")
    print(f"\n| L | gradient estimates (N = {args.N}, {args.seeds} seeds) | mean cosine | min cosine |")
    print("|---|---|---|---|")
    print("\n".join(tables))


if __name__ == "__main__":
    main()
