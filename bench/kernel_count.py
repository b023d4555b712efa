"""Kernels per ascent step of the fast backend, this checkout against another (an older commit), counted by the
same rules on both sides: this checkout's sicl_fast/diagnostics/kernel_count.py, loaded by its path into each side's
process.

    git worktree add /tmp/old ccb8e43
    python bench/kernel_count.py --other /tmp/old --length 64 --impl triton torch

Each side runs in its own interpreter with its checkout first on sys.path (the editable install hidden, its
kernels/ folder mapped to sicl_fast.kernels as the install does), TRITON_INTERPRET=1 (Triton's CPU interpreter:
the count is the same as on a GPU), loads the embedded SmolLM2-135M in float32, builds the fast backend with
difference products off and the given impl, and counts one static step (N = 8, the prefix fixed:
projection_scope 'demos') in all and in the decoder's forward over the batch; with --diff-matmul bf16 also one
refresh of the difference form's value-row reference (StepForward.refresh at the step's X; --scope prompt runs the
prefix rows in every pass, as the default projection scope does). Prints a markdown table.

    python bench/kernel_count.py --other /tmp/old --impl triton cpp --diff-matmul bf16 --scope prompt
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from other_checkout import PRELUDE  # bench/, first on sys.path when run as a script

HERE = Path(__file__).resolve().parents[1]

WORKER = PRELUDE + r"""
# the module paths before #41: both checkouts have them (sicl_fast.MOVED in a newer one)
import json
import torch
counter_file = sys.argv[2]
spec = importlib.util.spec_from_file_location("kernel_count_rules", counter_file)
rules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rules)
from sicl_fast import CalibrationConfig
from sicl_fast.ascent import Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.benchmark import synthetic_prompt
from sicl_fast.models import load
from sicl_fast.static import StaticStep
lm = load()
be = make_backend("fast", lm, impl=sys.argv[3], diff_matmul=sys.argv[6])
p = synthetic_prompt(lm, int(sys.argv[4]), prefix=8)
cal = Calibrator(be, CalibrationConfig(N=int(sys.argv[5]), tau=0.0, projection_scope=sys.argv[7]))
st = StaticStep(be, cal.config, p, cal.initial_embeddings(p))
st()
total = rules.count_kernels(st)
fwd = st.forward
refresh = None
if getattr(fwd, "refresh_every", 0):  # the difference form's reference, refreshed at the step's X
    fwd.refresh(st.state.X)  # what a first refresh makes once
    refresh = rules.count_kernels(lambda: fwd.refresh(st.state.X))
m, a = be.model, p.demo_start
try:  # the decoder's layers alone, as each checkout's profile counts them
    from sicl_fast.profile import layers_call
    forward = layers_call(st)
except ImportError:  # before the step forward object (1269398 and earlier)
    x, prefix = st.batch[:, :p.demo_end].to(m.dtype), st._prefix()
    forward = lambda: m.forward(x[:, a:], a, prefix, near_row0=True)  # noqa: E731
with torch.no_grad():
    layers = rules.count_kernels(forward)
print(json.dumps({"total": total, "layers": layers, "n_layers": len(m.layers), "L": p.length, "a": a,
                  "refresh": refresh}))
"""


def count(root: Path, impl: str, length: int, N: int, diff: str, scope: str = "demos") -> dict:
    rules = HERE / "sicl_fast" / "diagnostics" / "kernel_count.py"
    out = subprocess.run([sys.executable, "-c", WORKER, str(root), str(rules), impl, str(length), str(N), diff,
                          scope],
                         capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})  # set before the checkout imports triton
    if out.returncode != 0:
        raise SystemExit(f"{root} ({impl}): {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True, help="the other checkout (before)")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--impl", nargs="+", default=["triton", "torch"])
    ap.add_argument("--diff-matmul", default="off")
    ap.add_argument("--scope", default="demos", choices=["demos", "prompt"],
                    help="the projection scope: 'demos' keeps the prefix's K/V, 'prompt' runs its rows every pass")
    args = ap.parse_args(argv)
    print("| checkout | impl | kernels per step | per decoder layer | rest | refresh (steps' worth) | L (prefix) |")
    print("|---|---|---|---|---|---|---|")
    for impl in args.impl:
        for name, root in (("before", args.other.resolve()), ("after", HERE)):
            r = count(root, impl, args.length, args.N, args.diff_matmul, args.scope)
            ref = "-" if r.get("refresh") is None else f"{r['refresh']} ({r['refresh'] / r['total']:.2f})"
            print(f"| {name} ({root.name}) | {impl} | {r['total']} | {r['layers'] / r['n_layers']:.1f} | "
                  f"{r['total'] - r['layers']} | {ref} | {r['L']} ({r['a']}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
