"""Ray scaling on one machine: `sicl-fast icleval` on 16 ICLEval prompts (SmolLM2-135M, 5 calibration steps each),
with --ray --workers 1 and --workers 2 (and, with --local, in one process without Ray), side by side in one run.

    python bench/ray_scaling.py [--data ../shared/icleval/data] [--out bench/ray_runs] [--local]

The prompts: the first 16 samples of classifier_order (about 320-330 tokens; answers of at most 5 tokens): the
shortest prompts with the shortest answers of the ICLEval files (the others run 220-2150 tokens, answers up to 256).

Each configuration is a fresh `sicl-fast` process (its wall time includes starting Ray and loading the model in
every actor), writing its own records; the records of the three runs are then compared (all fields but `seconds`).
Prints a Markdown table for bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TASKS = ["classifier_order"]
PER_TASK = 16
KNOBS = ["--method", "sicl", "--max-steps", "5", "--patience", "0", "--tau", "0", "--quiet"]
RAY = [("--ray --workers 1", ["--ray", "--workers", "1"]), ("--ray --workers 2", ["--ray", "--workers", "2"])]
LOCAL = ("one process (no Ray)", [])


def run(data: str, out: Path, extra: list[str]) -> float:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sicl_fast.cli", "icleval", data, "--tasks", *TASKS, "--limit", str(PER_TASK),
           "--out", str(out), *KNOBS, *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "icleval" / "data"))
    ap.add_argument("--out", default="bench/ray_runs")
    ap.add_argument("--local", action="store_true", help="also run in one process without Ray")
    args = ap.parse_args()
    configs = ([LOCAL] if args.local else []) + RAY
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows, recs = [], {}
    for i, (name, extra) in enumerate(configs):
        path = outdir / f"run{i}.jsonl"
        wall = run(args.data, path, extra)
        rs = [json.loads(x) for x in path.read_text().splitlines()]
        recs[name] = {(r["task"], r["uid"]): {k: v for k, v in r.items() if k != "seconds"} for r in rs}
        work = sum(r["seconds"] for r in rs)
        rows.append((name, len(rs), wall, 60.0 * len(rs) / wall, work))
        print(f"{name}: {len(rs)} prompts, {wall:.1f} s", file=sys.stderr, flush=True)
    ref = recs[configs[0][0]]
    same = all(r == ref for r in recs.values())
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"records equal across runs (all fields but seconds): {same}")
    print("| run | prompts | wall s | prompts / min | sum of per-prompt seconds |")
    print("|---|---|---|---|---|")
    for name, n, wall, ppm, work in rows:
        print(f"| {name} | {n} | {wall:.1f} | {ppm:.2f} | {work:.1f} |")


if __name__ == "__main__":
    main()
