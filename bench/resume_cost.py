"""What a resumed run costs before its model loads (bench/RESULTS.md sections 27 and 33; issue 54, item 2): a
finished `sicl-fast calibrate` run again on its own --out ("nothing to do"), and one refused for its settings,
each in a fresh interpreter with one checkout first on sys.path (bench/other_checkout.py's PRELUDE), the checkouts
in turn, round after round, so that every checkout meets the same load.

    python bench/resume_cost.py --checkouts /tmp/ref/dfa3b65 /tmp/ref/481e2be . --rounds 3

Each checkout first runs the calibration itself (its own --out in a temporary folder, one request, the default
model, --max-steps 1: the first run, which remembers its plan where the checkout has sicl_fast.run.planned). Then
each round runs, per checkout:
  finished   the same command again: nothing to do;
  refused    with --max-steps 2: refused for its settings (a checkout from before the settings check ends it as
             finished, as it did);
  planned    (a checkout with sicl_fast.run.planned) finished, with its plan not remembered: a variable of its own
             in the environment (SICL_RESUME_COST_ROUND, which every plan's key holds) stands for the first resume
             after an edit, an upgrade or on another machine, which plans on the model's architecture.
Recorded: the process's wall time (start to exit), the time in main() and whether transformers was imported, the
load (os.getloadavg) before and after, the date, the CPU and each checkout's commit; a Markdown table, then one
JSON line of everything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from other_checkout import PRELUDE  # noqa: E402

BODY = r"""
import contextlib, io, json, time
t0 = time.perf_counter()
from sicl_fast.commands.cli import main
t1 = time.perf_counter()
said = io.StringIO()
with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
    rc = main(sys.argv[2:])
t2 = time.perf_counter()
print(json.dumps({"rc": rc, "cli_import_s": t1 - t0, "main_s": t2 - t1, "transformers": "transformers" in sys.modules,
                  "said": (said.getvalue().strip().splitlines() or [""])[-1][-200:]}))
"""
REQUEST = {"id": "a", "demos": [{"input": "hello", "output": "world"}, {"input": "he", "output": "wor"}],
           "query": "hello"}
MISS_VARIABLE = "SICL_RESUME_COST_ROUND"


def run(root: Path, argv: list[str], env: dict | None = None) -> dict:
    """One command of the checkout `root` in a new interpreter: its JSON line, with the process's wall time."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PRELUDE + BODY, str(root), *argv], capture_output=True, text=True,
                         timeout=900, env=env)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{root}: {out.stderr.strip()[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": wall}


def commit(root: Path) -> str:
    got = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return got.stdout.strip() + (" + changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", nargs="+", required=True, help="checkout folders (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    args = ap.parse_args()
    roots = [Path(c).resolve() for c in args.checkouts]
    names = [f"{r.name} ({commit(r)})" for r in roots]
    plans = [(r / "sicl_fast" / "run" / "planned.py").is_file() for r in roots]
    work = Path(tempfile.mkdtemp(prefix="resume_cost_"))
    requests = work / "requests.jsonl"
    requests.write_text(json.dumps(REQUEST) + "\n")
    base = ["calibrate", str(requests), "--max-steps", "1"]
    load_before, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M:%S %Z")
    first = [run(r, [*base[:2], "--out", str(work / f"{i}.jsonl"), *base[2:]]) for i, r in enumerate(roots)]
    cases = {i: {"finished": [], "refused": [], "planned": []} for i in range(len(roots))}
    for k in range(args.rounds):
        for i, r in enumerate(roots):
            argv = [*base[:2], "--out", str(work / f"{i}.jsonl"), *base[2:]]
            cases[i]["finished"].append(run(r, argv))
            cases[i]["refused"].append(run(r, [*argv, "--max-steps", "2"]))
            if plans[i]:
                cases[i]["planned"].append(run(r, argv, env={**os.environ, MISS_VARIABLE: f"{time.time()}-{k}"}))
    load_after = os.getloadavg()
    print(f"# {started}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{' / '.join(f'{x:.2f}' for x in load_before)} before and {' / '.join(f'{x:.2f}' for x in load_after)} "
          f"after; {args.rounds} rounds, checkouts in turn")
    print("\n| checkout | resume | the process, s (each round) | in main(), s | transformers imported | said |")
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(names):
        print(f"| {name} | first run | {first[i]['process_s']:.2f} | {first[i]['main_s']:.2f} | "
              f"{first[i]['transformers']} | |")
        for case, got in cases[i].items():
            if not got:
                continue
            mains, walls = [g["main_s"] for g in got], ", ".join(f"{g['process_s']:.2f}" for g in got)
            print(f"| {name} | {case} | {walls} | "
                  f"{min(mains):.2f} - {max(mains):.2f} | {', '.join(sorted({str(g['transformers']) for g in got}))} "
                  f"| {got[-1]['said'][:90]} |")
    line = {"started": started, "load_before": load_before, "load_after": load_after, "checkouts": names,
            "first": first, "cases": {names[i]: c for i, c in cases.items()}, "rounds": args.rounds}
    print("\n" + json.dumps(line))
    if args.out:
        Path(args.out).write_text(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
