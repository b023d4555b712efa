"""How many times one prompt's calibration enters each sicl_fast source file: its planning, then each step.

    python bench/file_entries.py [--checkouts ROOT ...] [--json FILE]

An *entry* into a file F is a call of a Python function whose code belongs to F while the Python frame that calls
it belongs to another file: a 'call' event of sys.setprofile (a generator resumed counts as a call) whose frame's
file is F and whose caller frame's (frame.f_back's) is not. A function belongs to the file of the module whose
globals it runs in (its `__file__`), so a property getter, a lambda, a staticmethod and a dataclass's generated
`__init__` / `__eq__` (exec'd with the globals of its class's module) belong to the file that defines them. C
functions are not counted and are not callers: a Python function a C function calls (a decorator's wrapper in
torch, a key= lambda of sorted) has as its caller the Python frame beneath the C call. Only files under the checkout's
`sicl_fast/` and `kernels/` folders are counted, keyed by their path from the checkout's root.

The phases of one prompt's `Engine.calibrate` on the fast backend's static step (a tiny random-weight Llama on the
CPU, tau 0, two steps read once): *planning*, from Engine.calibrate's entry to the first call of the static step
(StaticStep.__call__): the entry checks, the step's plan, the step built (or a cached one re-armed); *step k*, from
step k's call to the next one's (the last: to calibrate's return, the read of the state and the result included).
Two scenarios: `static` (length buckets off: the step built for the prompt) and `buckets` (length buckets 4: the
first prompt builds the step of its bucket in the engine's StepCache, a second prompt of another length in the same
bucket re-arms it: `buckets, re-armed`).

Each checkout runs in its own interpreter (bench/other_checkout.py's PRELUDE, one thread) through the public API as
it was at 481e2be (sicl_fast.models.from_transformers, sicl_fast.spans.Prompt, Engine); tests/test_step_plan.py
holds this tree's planning to at most two entries per planning file with the same tracer (trace_calibration).
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the files a prompt's step is planned in (issue 54, item 3): each entered at most twice while a prompt is planned
PLANNING_FILES = ("sicl_fast/calibration/static.py", "sicl_fast/calibration/step_plan.py", "sicl_fast/step/spec.py",
                  "sicl_fast/run/memory.py", "sicl_fast/run/buckets.py", "sicl_fast/step/proxy.py",
                  "sicl_fast/backends/step_forward.py")


def trace_calibration(calibrate, root: str | os.PathLike) -> list[collections.Counter]:
    """[planning, step 1, step 2, ...]: the entries into each file under root/sicl_fast and root/kernels (module
    docstring), by path from root, while calibrate() (one Engine.calibrate of the static loop) runs. A phase ends
    where the static step's next call begins (StaticStep.__call__)."""
    from sicl_fast.calibration.static import StaticStep

    step_code = inspect.unwrap(StaticStep.__call__).__code__
    root = str(Path(root).resolve())
    folders = tuple(os.path.join(root, f) + os.sep for f in ("sicl_fast", "kernels"))
    keys: dict[str, str | None] = {}

    def key(frame) -> str | None:
        """The counted file a frame's code belongs to, by path from root (None: not counted)."""
        path = frame.f_globals.get("__file__") or frame.f_code.co_filename
        if path not in keys:
            full = os.path.realpath(path)
            keys[path] = os.path.relpath(full, root) if full.startswith(folders) else None
        return keys[path]

    phases = [collections.Counter()]

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code is step_code:
            phases.append(collections.Counter())
        here = key(frame)
        if here is not None and (frame.f_back is None or key(frame.f_back) != here):
            phases[-1][here] += 1

    sys.setprofile(profile)
    try:
        calibrate()
    finally:
        sys.setprofile(None)
    return phases


def scenarios(Engine, CalibrationConfig, lm, prompt) -> dict:
    """The scenarios (module docstring): name -> its phases (trace_calibration), on the loaded model lm; prompt(L,
    spans, seed) -> a Prompt of L tokens, demonstrations from row 6, the given output spans."""
    import sicl_fast

    root = Path(sicl_fast.__file__).resolve().parents[1]
    cfg = CalibrationConfig(N=4, tau=0.0, max_steps=2, seed=3)
    out = {}
    eng = Engine(lm, backend="fast", loop="static", sync_every=2, graphs="off", length_buckets="off")
    p = prompt(41, ((10, 14), (20, 26)), 1)
    eng.calibrate(p, cfg)  # the process's first calibration (imports, the ops' first calls) is not the one counted
    out["static"] = trace_calibration(lambda: eng.calibrate(p, cfg), root)
    eng = Engine(lm, backend="fast", loop="static", sync_every=2, graphs="off", length_buckets=4)
    out["buckets"] = trace_calibration(lambda: eng.calibrate(p, cfg), root)
    q = prompt(43, ((9, 12), (21, 27)), 2)  # another length in the same bucket: the cached step re-armed
    out["buckets, re-armed"] = trace_calibration(lambda: eng.calibrate(q, cfg), root)
    return {name: [dict(c) for c in phases] for name, phases in out.items()}


WORKER = r"""
import importlib.util, json, torch
torch.set_num_threads(1)
from sicl_fast import CalibrationConfig, Engine
from sicl_fast.models import from_transformers
from sicl_fast.requests import Request
from sicl_fast.spans import Prompt
from transformers import LlamaConfig, LlamaForCausalLM

spec = importlib.util.spec_from_file_location("file_entries", sys.argv[2])
file_entries = importlib.util.module_from_spec(spec)
spec.loader.exec_module(file_entries)


class Tok:
    eos_token_id = None
    all_special_ids = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


torch.manual_seed(0)
lm = from_transformers(LlamaForCausalLM(LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)), Tok(), name="tiny-llama")


def prompt(L, spans, seed):
    ids = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(seed))
    req = Request(id=f"p{seed}", prompt="x" * (L + 1), output_spans=((1, 2),))
    return Prompt(request=req, input_ids=ids, token_spans=tuple(spans), demo_start=6, demo_end=spans[-1][1])


print(json.dumps(file_entries.scenarios(Engine, CalibrationConfig, lm, prompt)))
"""


def table(results: dict[str, dict]) -> str:
    """A Markdown table: per scenario and file, each checkout's planning entries (and its steps' entries, / between
    steps), rows for PLANNING_FILES and every other file entered more than twice while planning in some checkout."""
    names = list(results)
    lines = ["| scenario | file | " + " | ".join(f"{n}: planning (steps)" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for scenario in next(iter(results.values())):
        counts = {n: results[n][scenario] for n in names}
        extra = sorted({f for c in counts.values() for f, v in c[0].items() if v > 2} - set(PLANNING_FILES))
        for f in (*PLANNING_FILES, *extra):
            cells = [f"{c[0].get(f, 0)} ({' / '.join(str(s.get(f, 0)) for s in c[1:])})" for c in counts.values()]
            lines.append(f"| {scenario} | {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(HERE))
    from other_checkout import PRELUDE, run_worker

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", nargs="+", default=[str(HERE.parent)], metavar="ROOT",
                    help="the checkouts to trace, each in its own interpreter (default: this one)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every phase's counts there")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    results = {}
    for root in args.checkouts:
        root = str(Path(root).resolve())
        results[root] = run_worker(PRELUDE + WORKER, root, Path(__file__).resolve(), timeout=600, env=env)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
