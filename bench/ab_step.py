"""A / B: one ascent step of this checkout against another checkout of sicl_fast (an older commit), side by side
in one run, rounds interleaved so both see the same machine load.

    git worktree add /tmp/old 893a76d && (cd /tmp/old && python setup.py build_ext --inplace)
    python bench/ab_step.py --other /tmp/old --length 128 512 --backends fast hf --rounds 2 --steps 3

Each side runs in its own interpreter (`python -c`, with the checkout first on sys.path and this environment's
editable install of sicl_fast hidden, so the other checkout's own code is what runs), loads the embedded
SmolLM2-135M, builds the backend with its default (auto) choice of hot-op implementation, and times one step
(`sicl_fast.diagnostics.benchmark.one_step` on the prompt's own embeddings, N = 8, with the run's step forward made once
where the checkout has one) `--steps` times after one warm-up and
keeps the best, in `--rounds` fresh processes per side; the order alternates (A B, B A, A B, ...). Prints the
mean and min over the processes of each side and their ratio B / A.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from other_checkout import PRELUDE, run_worker  # bench/, first on sys.path when run as a script

WORKER = PRELUDE + r"""
# the module paths before #41: both checkouts have them (sicl_fast.MOVED in a newer one)
import json, time
import torch
from sicl_fast import CalibrationConfig
from sicl_fast.ascent import Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.benchmark import one_step, synthetic_prompt
from sicl_fast.models import load
lm = load()
be = make_backend(sys.argv[2], lm)
p = synthetic_prompt(lm, int(sys.argv[3]))
cal = Calibrator(be, CalibrationConfig(N=8, tau=0.0))
X0 = be.embed(p)
times = []
kw = {}
if hasattr(cal, "forward"):  # a checkout whose loop keeps one step forward a run: made once, as Calibrator.run does
    kw["forward"] = cal.forward(p, cal.step_spec(p, X0), X0)
with torch.no_grad():
    one_step(cal, p, X0, X0, **kw)
    for step in range(1, 1 + int(sys.argv[4])):
        t = time.perf_counter()
        one_step(cal, p, X0, X0, step, **kw)
        times.append(time.perf_counter() - t)
dt = min(times)
impl = getattr(getattr(be, "ops", None), "name", "auto (env)")
print(json.dumps({"s": dt, "impl": impl, "L": p.length}))
"""


def run(root: Path, backend: str, length: int, steps: int) -> dict:
    return run_worker(WORKER, root, backend, length, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other checkout (B); A is this one")
    ap.add_argument("--length", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--backends", nargs="+", default=["fast", "hf"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process (its best is kept)")
    args = ap.parse_args()
    here, other = Path(__file__).resolve().parent.parent, Path(args.other).resolve()
    print("| backend | L | A impl | A s/step (mean, min) | B s/step (mean, min) | B / A (mean) |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends:
        for length in args.length:
            a, b = [], []
            for r in range(args.rounds):  # A first in even rounds, B first in odd ones
                for side in ((here, a), (other, b)) if r % 2 == 0 else ((other, b), (here, a)):
                    side[1].append(run(side[0], backend, length, args.steps))
            ma, mb = statistics.mean(r["s"] for r in a), statistics.mean(r["s"] for r in b)
            print(f"| {backend} | {a[0]['L']} | {a[0]['impl']} | {ma:.2f}, {min(r['s'] for r in a):.2f} | "
                  f"{mb:.2f}, {min(r['s'] for r in b):.2f} | {mb / ma:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
