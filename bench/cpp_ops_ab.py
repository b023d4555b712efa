"""A / B of the C++ extension's hot decoder ops: this checkout's sicl_fast.ops._C against another checkout's (built at
sicl_fast/ops/, or at sicl_fast/ before issue #54 moved it), both loaded in one process and called in turn on the
same buffers (so both see the same machine load), at SmolLM2-135M's shapes in one ascent step (N 8: B 9 rows; 9
query / 3 key heads of 64; MLP width 1536).

    mkdir /tmp/old && git archive 638d7b0 | tar -x -C /tmp/old && (cd /tmp/old && python setup.py build_ext --inplace)
    python bench/cpp_ops_ab.py --other /tmp/old --length 256 512

Prints, per op and length, the best of `--repeats` calls of each side (ms), their ratio B / A and the largest
difference between the two outputs. The ops are called through the extensions' raw entry points (numpy buffers),
which is what sicl_fast.ops.cpp_ops passes them; torch's own thread count.
"""
from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import os
import sys
import time

import numpy as np
import torch

B, H, HK, HD, I = 9, 9, 3, 64, 1536


def load_extension(root: str, name: str):
    """The checkout's built extension (sicl_fast/ops/_C*.so; sicl_fast/_C*.so in a checkout from before issue #54),
    imported under `name` (its init function is PyInit__C either way)."""
    found = glob.glob(os.path.join(root, "sicl_fast", "ops", "_C*.so")) or glob.glob(os.path.join(root, "sicl_fast",
                                                                                                 "_C*.so"))
    if not found:
        sys.exit(f"no built extension under {root}/sicl_fast/ops (python setup.py build_ext --inplace there)")
    loader = importlib.machinery.ExtensionFileLoader(name, found[0])
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, found[0], loader=loader))
    loader.exec_module(module)
    return module


def cases(T: int):
    """op name -> (a function of one extension that writes its output, the output tensor's factory)."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B * T, n * HD, generator=g) for n in (H, HK, HK))
    none = torch.empty(0, HK * HD)
    # the MLP's gate | up product in difference form: batch row 0 a value, the others differences from it
    y = torch.cat([torch.randn(T, 2 * I, generator=g), 1e-2 * torch.randn((B - 1) * T, 2 * I, generator=g)])
    y = y.to(torch.bfloat16).view(torch.int16).numpy()
    anchor = np.zeros(B, dtype=np.int64)

    def attention(ext, out):
        ext.attention(q.numpy(), k.numpy(), v.numpy(), none.numpy(), none.numpy(), out.numpy(), B, T, H, HK, B, 0, 0,
                      HD ** -0.5, 0.0, 0)

    def gated_rows(ext, out):
        ext.gated_rows(y, None, 0, anchor, 0, T, out.view(torch.int16).numpy())

    return {"attention": (attention, lambda: torch.empty(B * T, H * HD)),
            "gated_rows": (gated_rows, lambda: torch.empty(B * T, I, dtype=torch.bfloat16))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="the other checkout's root, its extension built in place")
    ap.add_argument("--length", type=int, nargs="+", default=[256, 512], help="token rows T")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"A": load_extension(here, "ab_this._C"), "B": load_extension(args.other, "ab_other._C")}
    print(f"# A: {here}, B: {args.other}; {torch.get_num_threads()} threads")
    print("| op | T | A ms (best) | B ms (best) | B / A | max abs difference |")
    print("|---|---|---|---|---|---|")
    for T in args.length:
        for name, (call, make_out) in cases(T).items():
            if not all(hasattr(ext, name) for ext in sides.values()):
                print(f"| {name} | {T} | - | - | - | not in both extensions |")
                continue
            outs = {s: make_out() for s in sides}
            best = {s: float("inf") for s in sides}
            for _ in range(args.repeats):
                for s, ext in sides.items():
                    t = time.perf_counter()
                    call(ext, outs[s])
                    best[s] = min(best[s], time.perf_counter() - t)
            diff = (outs["A"].float() - outs["B"].float()).abs().max().item()
            print(f"| {name} | {T} | {best['A'] * 1e3:.2f} | {best['B'] * 1e3:.2f} | {best['B'] / best['A']:.2f} "
                  f"| {diff:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
