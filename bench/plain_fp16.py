"""The plain float16 ascent against the difference form (the float16 warning's figures, bench/RESULTS.md section 25):
on the two short SmolLM2 prompts of tests/test_precision.py, the float32 gain of the X each path returns, as a share
of plain float32's, after a seeded run of --steps steps (tau 0, patience 0), one thread. bf16 beside it, as the
precision study's (RESULTS 17) reference.

    python bench/plain_fp16.py --steps 6
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

PROMPTS = [
    {"id": "numbers", "instruction": "Write each number word as a digit.",
     "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"}, {"input": "three", "output": "3"},
               {"input": "nine", "output": "9"}], "query": "five"},
    {"id": "capitals", "demos": [{"input": "France", "output": "Paris"}, {"input": "Italy", "output": "Rome"},
                                 {"input": "Japan", "output": "Tokyo"}], "query": "Spain"},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # the plain paths' warning is what this measures
    from sicl_fast import Engine
    from sicl_fast.models import load

    torch.set_num_threads(1)
    ref = Engine(load(dtype="float32", device="cpu"), backend="fast-fp32", threads=1)
    engines = {"fp32": ref}
    for dtype in ("float16", "bfloat16"):
        lm = load(dtype=dtype, device="cpu")
        engines[f"{dtype}-plain"] = Engine(lm, diff_matmul="off", threads=1)
        engines[f"{dtype}-rows"] = Engine(lm, threads=1)
    print("| prompt | path | float32 gain | of fp32's | s |\n|---|---|---|---|---|")
    for request in PROMPTS:
        prompt = ref.prepare(request)
        f0 = float(ref.proxy(prompt).f[0])
        gains = {}
        for name, eng in engines.items():
            t0 = time.perf_counter()
            res = eng.calibrate(eng.prepare(request), max_steps=args.steps, tau=0.0, patience=0)
            gains[name] = float(ref.proxy(prompt, embeds=res.embeddings.float()).f[0]) - f0
            print(f"| {request['id']} | {name} | {gains[name]:.3e} | {100 * gains[name] / gains['fp32']:.1f} % | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
