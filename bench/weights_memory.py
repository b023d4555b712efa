"""A / B: the memory the fast backend's weights take, this checkout against another (the stacked projections held
once, and the difference form's bf16 copies), on the embedded SmolLM2-135M; with --load, the load itself as
`--dtype auto` runs it on CUDA.

    git worktree add /tmp/base 1269398 && cp sicl_fast/ops/_C*.so /tmp/base/sicl_fast/
    python bench/weights_memory.py --other /tmp/base --dtype float32 bfloat16
    python bench/weights_memory.py --other /tmp/base --load smollm2 gemma3-270m --bf16-dir /tmp/smollm2-bf16

Each side in its own interpreter (bench/other_checkout.py): the process's resident memory (RSS, from
/proc/self/status) after loading the model, after building the fast backend with its default plan, and after one
static step of a 128-token prompt (where the difference form's bf16 weights and buffers are made), and the peak
(VmHWM) of the whole run; the model's own parameter bytes for scale. MiB.

--load: each model loaded with dtype 'auto' by each side's own load(), its resolve_dtype told the device is CUDA while
the weights stay on the host (what a CUDA machine's load does before the copy to the GPU): seconds of the load, the
RSS before it, its peak (VmHWM) and the dtype it decided with the reason. --bf16-dir: also a bf16 checkpoint folder
of SmolLM2's weights (written there when absent), the case where deciding from the stored dtype saves a float32 copy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from other_checkout import PRELUDE, run_worker  # bench/, first on sys.path when run as a script

# both workers' start: one thread, and the process's memory figures (VmRSS, VmHWM) in MiB
MEMORY_PRELUDE = PRELUDE + r"""
import torch
torch.set_num_threads(1)


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
"""

WORKER = MEMORY_PRELUDE + r"""
# the module paths before #41: both checkouts have them (sicl_fast.MOVED in a newer one)
import json
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


LOAD_WORKER = MEMORY_PRELUDE + r"""
import json, time


from sicl_fast.models import loading
real = loading.resolve_dtype  # the side's own rule, told the device is CUDA (the weights stay on the host)
loading.resolve_dtype = lambda dtype, dev, *rest: real(dtype, torch.device("cuda"), *rest)
before = status("VmRSS")
t = time.perf_counter()
lm = loading.load(sys.argv[2], dtype="auto", device="cpu")
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "before": before, "peak": status("VmHWM"), "dtype": str(lm.dtype),
                  "why": lm.extra["why"]["dtype"]}))
"""


def bf16_folder(path: Path) -> Path:
    """A bf16 checkpoint folder of the embedded SmolLM2-135M's weights (rounded), written when absent."""
    if not (path / "config.json").is_file():
        from sicl_fast.models import load

        lm = load(dtype="float32", device="cpu")
        lm.model.to(torch.bfloat16).save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
    return path


def load_table(models: list, here: Path, other: Path) -> None:
    """--load: each model loaded by each side (module docstring), side by side."""
    print("| model | side | load s | RSS before MiB | peak MiB | peak - before | dtype | why |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        for name, root in (("A (this)", here), ("B (other)", other)):
            r = run_worker(LOAD_WORKER, root, model)
            print(f"| {Path(model).name} | {name} | {r['seconds']:.2f} | {r['before']:.0f} | {r['peak']:.0f} | "
                  f"{r['peak'] - r['before']:+.0f} | {r['dtype'].replace('torch.', '')} | {r['why']} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="the other checkout (B); A is this one")
    ap.add_argument("--dtype", nargs="+", default=["float32"])
    ap.add_argument("--load", nargs="+", help="measure the 'auto' load of these models instead (names or paths)")
    ap.add_argument("--bf16-dir", help="--load: also a bf16 checkpoint of SmolLM2's weights in this folder")
    args = ap.parse_args()
    here, other = Path(__file__).resolve().parent.parent, Path(args.other).resolve()
    if args.load:
        load_table(args.load + ([str(bf16_folder(Path(args.bf16_dir)))] if args.bf16_dir else []), here, other)
        return 0
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
