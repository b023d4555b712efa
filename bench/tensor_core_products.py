"""What a GPU's tensor cores would do to the products whose precision the calibration reads, emulated on the CPU at
the real inner sizes (issue 53, items 6 and 8; sicl_fast.models.tensor_cores): each form's error against the float64
product, relative to sum |x_i w_i| (the scale a float32 sum's rounding errors are measured in), beside IEEE float32's.

    python bench/tensor_core_products.py                 # SmolLM2, Gemma-2-2B, Llama-3.1-8B; 32 rows, 256 outputs

The forms:
    f32 IEEE       torch.mm in float32 (round to nearest): the CPU's reference products, cuBLAS's with TF32 off
    3 pieces RN    a bf16 weight's float32 product from 3 bf16 pieces of the rows, summed in float32 to nearest: what
                   bench/precision_fidelity.py's bf16-rows-split emulated (sicl_fast.models.reference)
    3 pieces TC    the same with the tensor cores' accumulation modelled (tensor_cores.tc_accumulate: each group of
                   16 products, a bf16 MMA's k, summed exactly and added rounded toward zero): the GPU's, pessimistic
    2 pieces RN    2 bf16 pieces (16 bits of the rows)
    diff bf16      a difference product, bf16 rows and weight, bf16 output: the output rounded once (reductions in
                   float32: models/reductions' scope) against split-K's partial sums rounded to bf16 first (4 splits:
                   what allow_bf16_reduced_precision_reduction permits), relative to |y|'s scale
    tf32x3 TC      the attention's products at the head sizes (k 64 / 128 / 256) and a key tile (k 16 / 32 / 64):
                   Triton's tf32x3 with the accumulation modelled (groups of 8, a tf32 MMA's k), against IEEE

Rows x ~ N(0, 1) (a normed hidden state), weights ~ N(0, 1 / k) in bf16 (their own values: a bf16 model's), seeded.
Prints one markdown table: per inner size, the largest and the mean error of each form.
"""
from __future__ import annotations

import argparse
import sys

import torch


def rel_err(y: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> tuple[float, float]:
    e = (y.double() - exact).abs() / scale
    return float(e.max()), float(e.mean())


def bf16_split_k(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """bf16 x @ w^T with bf16 output, the K sum in `splits` partial sums each rounded to bf16 (a reduced-precision
    split-K reduction), then summed and rounded again."""
    parts = [(xs.double() @ ws.double().t()).to(torch.bfloat16)
             for xs, ws in zip(x.chunk(splits, 1), w.chunk(splits, 1))]
    return sum(p.double() for p in parts).to(torch.bfloat16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=256)
    ap.add_argument("--models", nargs="+", default=["SmolLM2-135M", "Gemma-2-2B", "Llama-3.1-8B"])
    args = ap.parse_args(argv)
    from sicl_fast.kernels._configs import FAMILIES
    from sicl_fast.models import tensor_cores as tc
    from sicl_fast.models.reference import split_bf16_reference

    g = torch.Generator().manual_seed(0)
    print("| model | k | f32 IEEE max / mean | 3 pieces RN | 3 pieces TC | 2 pieces RN | diff bf16, float32 "
          "reduction | diff bf16, 4-way bf16 split-K |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        f = FAMILIES[name]
        for k in dict.fromkeys((f["d"], f["H"] * f["hd"], f["I"])):
            x = torch.randn(args.rows, k, generator=g)
            w = (torch.randn(args.outputs, k, generator=g) / k ** 0.5).to(torch.bfloat16)
            exact = x.double() @ w.double().t()
            scale = x.double().abs() @ w.double().abs().t()
            cells = [rel_err(x @ w.float().t(), exact, scale)]
            for pieces, model in ((3, False), (3, True), (2, False)):
                p = split_bf16_reference(x, pieces).float()
                if model:
                    y = sum(tc.tc_accumulate(p[j], w.float().t(), 16) for j in range(pieces))
                else:
                    y = sum(p[j] @ w.float().t() for j in range(pieces))
                cells.append(rel_err(y, exact, scale))
            xb = x.to(torch.bfloat16)  # a difference product: its output's scale is |y| itself
            yb = xb.double() @ w.double().t()
            ys = yb.abs().amax(1, keepdim=True)
            cells.append(rel_err(yb.to(torch.bfloat16), yb, ys))
            cells.append(rel_err(bf16_split_k(xb, w, 4), yb, ys))
            print(f"| {name} | {k} | " + " | ".join(f"{a:.1e} / {m:.1e}" for a, m in cells) + " |", flush=True)
    print()
    print("| attention product | k | f32 IEEE max / mean | tf32x3 RN | tf32x3 TC |")
    print("|---|---|---|---|---|")
    for what, ks in (("q k^T over a head", (64, 128, 256)), ("p v over a key tile", (16, 32, 64))):
        for k in ks:
            a = torch.randn(args.rows * 4, k, generator=g)
            b = torch.randn(k, args.outputs, generator=g) if what.startswith("q") else \
                torch.rand(args.rows * 4, k, generator=g)
            if not what.startswith("q"):  # p: probabilities in [0, 1], v: values
                a, b = b, torch.randn(k, args.outputs, generator=g)
            exact = a.double() @ b.double()
            scale = a.double().abs() @ b.double().abs()
            cells = [rel_err(a @ b, exact, scale), rel_err(tc.tc_matmul(a, b, "tf32x3"), exact, scale),
                     rel_err(tc.tc_matmul_model(a, b, "tf32x3", 8), exact, scale)]
            print(f"| {what} | {k} | " + " | ".join(f"{m:.1e} / {n:.1e}" for m, n in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
