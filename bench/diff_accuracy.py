"""How exact are the fast backend's bf16 difference products? Finite differences f_i - f_0 of the proxy for one
perturbation batch, against a float64 forward of the same batch (SmolLM2-135M, synthetic prompt).

    python bench/diff_accuracy.py --length 128 512 --N 8

Prints, per length and per path (fast-fp32: every product in float32; fast: bf16 difference products), the error
of f_0 and the relative error ||d - d64|| / ||d64|| of the differences d_i = f_i - f_0, plus max |d64|.
"""
import argparse
import copy

import torch

from sicl_fast.ascent import CalibrationConfig
from sicl_fast.backends import make_backend
from sicl_fast.benchmark import synthetic_prompt
from sicl_fast.models import load
from sicl_fast.ops import IMPLS, TorchOps
from sicl_fast.spec import StepSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, nargs="+", default=[128])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--impl", default="auto", choices=IMPLS, help="implementation of the fast paths' hot ops")
    args = ap.parse_args()
    lm = load()
    lm64 = copy.copy(lm)
    lm64.model = copy.deepcopy(lm.model).double()
    ref = make_backend("hf", lm64, impl="torch")
    paths = {"fast-fp32": make_backend("fast-fp32", lm, impl=args.impl),
             "fast": make_backend("fast", lm, diff_matmul="bf16", impl=args.impl)}
    print(f"# impl {paths['fast'].ops.name}")
    print("| L | path | abs error of f_0 | rel. error of f_i - f_0 | max abs(f_i - f_0) (float64) |")
    print("|---|---|---|---|---|")
    for length in args.length:
        p = synthetic_prompt(lm, length)
        cfg = CalibrationConfig.for_model(lm, N=args.N)
        X0 = paths["fast-fp32"].embed(p)
        batch = TorchOps().perturb(X0, 0, StepSpec.build(cfg, *X0.shape, p.demo_start, p.demo_end))

        def f(backend, x, **kw):
            lp = backend.span_logprobs(x, p, **kw)
            return backend.ops.proxy(lp.float(), p.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q).f.double()

        f64 = f(ref, batch.double())
        d64 = f64[1:] - f64[0]
        for name, backend in paths.items():
            got = f(backend, batch, near_row0=True)
            d = got[1:] - got[0]
            print(f"| {p.length} | {name} | {abs(float(got[0] - f64[0])):.1e} | "
                  f"{float((d - d64).norm() / d64.norm()):.1e} | {float(d64.abs().max()):.1e} |", flush=True)


if __name__ == "__main__":
    main()
