"""Seconds per ascent step and peak memory: the exact gradient (estimator "grad": one forward and one backward of
row 0) against the zeroth-order step at N = 8 and N = 16, on the embedded SmolLM2-135M, one run, same prompts.

    python bench/grad_step.py --length 128 512 --repeats 3 [--out bench/results_grad_cpu.json]

Rows: the zeroth-order steps on the engine's default CPU setup (`fast` backend, impl auto = the C++ ops, bf16
difference products where the CPU has fast bf16); the grad step on `fast` (float32 plain products, torch ops: the
only differentiable ones), with and without per-layer checkpointing, and on `hf`. Each row: mean and min ms over
`repeats` steps after one warm-up step (sicl_fast.diagnostics.benchmark.bench_step), and the peak extra tensor memory of
one step (the torch profiler's memory events on the CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sicl_fast.backends import make_backend  # noqa: E402
from sicl_fast.diagnostics.benchmark import bench_step, synthetic_prompt  # noqa: E402
from sicl_fast.engine import Engine  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    eng = Engine(backend="hf")
    lm = eng.lm
    base = eng.config(tau=0.0)
    zo = make_backend("fast", lm, loop="eager")  # the eager loop's step, as the exact gradient's runs
    grad_fast = make_backend("fast", lm, grad=True)
    grad_hf = make_backend("hf", lm, grad=True)
    rows_spec = [
        ("ZO forward, N = 8", zo, base.replace(N=8)),
        ("ZO forward, N = 16", zo, base.replace(N=16)),
        ("grad (fast)", grad_fast, base.replace(estimator="grad")),
        ("grad (fast), checkpoint", grad_fast, base.replace(estimator="grad", checkpoint=True)),
        ("grad (hf)", grad_hf, base.replace(estimator="grad")),
    ]
    print(f"# {lm.name}, float32, CPU ({platform.processor() or platform.machine()}), torch threads "
          f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| step | backend | impl | L | rows | ms/step (mean) | ms/step (min) | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for L in args.length:
        prompt = synthetic_prompt(lm, L)
        for label, be, cfg in rows_spec:
            r = bench_step(be, prompt, cfg, repeats=args.repeats)
            r["step"] = label
            out.append(r)
            print(f"| {label} | {be.name} | {r['impl']} | {r['L']} | {r['B']} | {r['ms_mean']:.0f} | "
                  f"{r['ms_min']:.0f} | {r['peak_mb']:.0f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
