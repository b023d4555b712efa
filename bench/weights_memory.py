"""A / B: the memory the fast backend's weights take, this checkout against another (the stacked projections held
once, and the difference form's bf16 copies), on the embedded SmolLM2-135M.

    git worktree add /tmp/base 1269398 && cp sicl_fast/_C*.so /tmp/base/sicl_fast/
    python bench/weights_memory.py --other /tmp/base --dtype float32 bfloat16

Each side in its own interpreter (bench/other_checkout.py): the process's resident memory (RSS, from
/proc/self/status) after loading the model, after building the fast backend with its default plan, and after one
static step of a 128-token prompt (where the difference form's bf16 weights and buffers are made), and the peak
(VmHWM) of the whole run; the model's own parameter bytes for scale. MiB.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from other_checkout import PRELUDE, run_worker  # bench/, first on sys.path when run as a script

WORKER = PRELUDE + r"""
# the module paths before #41: both checkouts have them (sicl_fast.MOVED in a newer one)
import json
import torch
torch.set_num_threads(1)


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB


from sicl_fast.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.benchmark import synthetic_prompt
from sicl_fast.models import load
from sicl_fast.static import StaticStep
out = {}
lm = load(dtype=sys.argv[2])
out["params"] = sum(p.numel() * p.element_size() for p in lm.model.parameters()) / 2**20
out["loaded"] = status("VmRSS")
be = make_backend("fast", lm)
out["backend"] = status("VmRSS")
p = synthetic_prompt(lm, 128)
cfg = Calibrator(be, CalibrationConfig(N=8, tau=0.0)).config
st = StaticStep(be, cfg, p, be.embed(p))
st()
out["step"] = status("VmRSS")
out["peak"] = status("VmHWM")
out["diff_matmul"] = be.plan.diff_matmul
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="the other checkout (B); A is this one")
    ap.add_argument("--dtype", nargs="+", default=["float32"])
    args = ap.parse_args()
    here, other = Path(__file__).resolve().parent.parent, Path(args.other).resolve()
    print("| dtype | side | diff_matmul | parameters | RSS loaded | + backend | + one step | peak |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for name, root in (("A (this)", here), ("B (other)", other)):
            r = run_worker(WORKER, root, dtype)
            print(f"| {dtype} | {name} | {r['diff_matmul']} | {r['params']:.0f} | {r['loaded']:.0f} | "
                  f"{r['backend'] - r['loaded']:+.0f} | {r['step'] - r['backend']:+.0f} | {r['peak']:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
