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

With --packed S: the packed step of S slots instead (each without its prefix K/V, the packed step's form), with
bf16 difference products: its kernels a step (impl triton; prompts of 36.. tokens and N 1: the count depends on
neither, the interpreter's time does); then what one slot's change costs, counted (kernels) and timed on the C++
ops (seconds: prompts of --lengths, --N directions, SmolLM2's float32 weights): a new prompt of the replaced one's
length (the layout stays) and a longer one (the pass is laid out again), each its step and the pass rearranged as
each checkout's run_packed does it (the other checkout: a new StaticStep with its own forward and a new
PackedStep), and what a read without a change costs (the other checkout's run_packed rebuilt its PackedStep at
each read). Also the kernels of a step where every slot refreshes its reference, beyond the step's: eager (the
CPU captures nothing), and, in a checkout whose captured layout captures each slot's refresh (issue #53), captured
as a CUDA run captures them, through tests/fake_graphs.py's capture on the CPU (impl torch): one launch a slot.

    python bench/kernel_count.py --other /tmp/h46c_base --packed 8 --lengths 100 200 --N 8
    python bench/kernel_count.py --other /tmp/old --packed 8 --counts-only       # the kernel counts alone
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


WORKER_PACKED = PRELUDE + r"""
import inspect, json, random, time
import torch
counter_file, S, lo, hi, N, with_times = sys.argv[2], *map(int, sys.argv[3:8])
spec = importlib.util.spec_from_file_location("kernel_count_rules", counter_file)
rules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rules)
from sicl_fast import CalibrationConfig
from sicl_fast.backends import make_backend
from sicl_fast.calibration.ascent import Calibrator
from sicl_fast.calibration.packed import PackedStep
from sicl_fast.calibration.static import StaticStep
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from sicl_fast.models import load
lm = load()
own = "own_forward" in inspect.signature(StaticStep.__init__).parameters  # this change's slots: no forward of their own
rng = random.Random(0)

def prompt(L):  # an 8-token prefix, three outputs of up to 4 tokens, a 16-token query
    end, block = L - 16, (L - 24) // 3
    w = min(4, block)
    spans = tuple((8 + (t + 1) * block - w, 8 + (t + 1) * block) for t in range(2)) + ((end - w, end),)
    return Prompt(request=Request(id=f"p{L}", prompt="x" * (L + 1), output_spans=((1, 2),)),
                  input_ids=torch.tensor([rng.randrange(lm.tokenizer.vocab_size) for _ in range(L)]),
                  token_spans=spans, demo_start=8, demo_end=end)

def slot(be, cfg, p):
    kw = {"own_forward": False} if own else {}
    return StaticStep(be, cfg, p, be.embed(p), use_prefix=False, **kw)

def change(be, step, slots, p, cfg):  # slot 1 takes a new prompt: what each checkout's run_packed does
    slots[1] = slot(be, cfg, p)
    if own:
        step.set(slots)
        return step
    return PackedStep(be, slots)

def read(be, step, slots):  # a read without a change
    if own:
        step.set(slots)
        return step
    return PackedStep(be, slots)

out = {}
lengths = [rng.randint(lo, hi) for _ in range(S)]
for impl, n in (("triton", 1), ("cpp", N))[:2 if with_times else 1]:
    be = make_backend("fast", lm, impl=impl, diff_matmul="bf16")
    cfg = Calibrator(be, CalibrationConfig(N=n, tau=0.0, projection_scope="demos")).config
    Ls = [36 + j for j in range(S)] if impl == "triton" else lengths  # the count alone: short prompts
    ps = [prompt(L) for L in Ls]
    same, longer = prompt(Ls[1]), prompt(max(Ls) + 8)  # slot 1's length (the layout stays), a longer one (it moves)
    slots = [slot(be, cfg, p) for p in ps]
    step = PackedStep(be, slots)
    step()
    if impl == "triton":
        out["step"] = rules.count_kernels(step)
        step.calls = [16] * S  # the next call refreshes every slot's reference first (eagerly: the CPU captures none)
        out["refresh_kernels"] = rules.count_kernels(step) - out["step"]
        out["same_kernels"] = rules.count_kernels(lambda: change(be, step, slots, same, cfg))
        out["read_kernels"] = rules.count_kernels(lambda: read(be, step, slots))
        out["longer_kernels"] = rules.count_kernels(lambda: change(be, step, slots, longer, cfg))
        continue
    best = {}

    def timed(name, fn):
        t = time.perf_counter()
        got = fn()
        best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        return got
    for _ in range(3):  # the best of 3 rounds, each in turn
        step = timed("same", lambda: change(be, step, slots, same, cfg))
        step = timed("read", lambda: read(be, step, slots))
        timed("step", step)
        step = timed("longer", lambda: change(be, step, slots, longer, cfg))
        step = change(be, step, slots, same, cfg)  # back to slot 1's length (not timed)
    out.update({f"{k}_s": v for k, v in best.items()}, lengths=lengths, n_layers=len(be.model.layers))
if hasattr(PackedStep, "refresh"):  # this change: a captured layout's refreshes, captured through the fake capture
    sys.path.insert(0, os.path.join(root, "tests"))  # (tests/fake_graphs.py: torch.cuda's graph API on the CPU,
    import pytest  # recording torch ops: impl 'torch')
    from fake_graphs import FakeCuda
    from sicl_fast.run.graphs import Captures
    FakeCuda(pytest.MonkeyPatch())
    be = make_backend("fast", lm, impl="torch", diff_matmul="bf16")
    cfg = Calibrator(be, CalibrationConfig(N=1, tau=0.0, projection_scope="demos")).config
    step = PackedStep(be, [slot(be, cfg, prompt(36 + j)) for j in range(S)], captures=Captures("cpu"))
    step()  # the layout's warm-up
    step.capture()
    step()  # the graph's first replay (checked against the torch ops)
    plain = rules.count_kernels(step)
    for _ in range(3):  # each slot's first refresh in the layout (eager, then captured), its first replay (checked),
        step.calls = [16] * S  # then a replay
        captured = rules.count_kernels(step) - plain
    out["refresh_captured"] = captured
print(json.dumps(out))
"""


def count_packed(root: Path, S: int, lengths: list, N: int, timed: bool = True) -> dict:
    rules = HERE / "sicl_fast" / "diagnostics" / "kernel_count.py"
    out = subprocess.run([sys.executable, "-c", WORKER_PACKED, str(root), str(rules), str(S), *map(str, lengths),
                          str(N), str(int(timed))], capture_output=True, text=True, timeout=7200,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{root} (packed): {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    ap.add_argument("--packed", type=int, default=None, metavar="S", help="the packed step of S slots instead")
    ap.add_argument("--lengths", type=int, nargs=2, default=[100, 200], metavar=("MIN", "MAX"),
                    help="--packed: the timed prompts' lengths, drawn in [MIN, MAX]")
    ap.add_argument("--counts-only", action="store_true", help="--packed: the kernel counts, not the C++ timings")
    args = ap.parse_args(argv)
    if args.packed is not None:
        print("| checkout | kernels a step | a step's refreshes (every slot's): kernels, eager | captured | a slot's "
              "change, same layout: kernels | s | a longer prompt (laid out again): kernels | s | a read, no change: "
              "kernels | s | packed step s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, root in (("before", args.other.resolve()), ("after", HERE)):
            r = count_packed(root, args.packed, args.lengths, args.N, not args.counts_only)
            t = {k: f"{r[k]:.3f}" if k in r else "-" for k in ("same_s", "longer_s", "read_s", "step_s")}
            print(f"| {name} ({root.name}) | {r['step']} | {r['refresh_kernels']} | {r.get('refresh_captured', '-')} "
                  f"| {r['same_kernels']} | {t['same_s']} | {r['longer_kernels']} | {t['longer_s']} | "
                  f"{r['read_kernels']} | {t['read_s']} | {t['step_s']} |", flush=True)
        if not args.counts_only:
            print(f"\n{args.packed} slots of {r['lengths']} tokens (timed, N {args.N}), {r['n_layers']} layers")
        return 0
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
