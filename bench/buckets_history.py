"""Length buckets on vs off on the real model: how far a padded run's proxy history lies from the unpadded one's,
for each form of the difference products (docs/performance.md states the bound; bench/RESULTS.md section 24). Ten
few-shot prompts of 33-104 tokens (number words, capitals; seeded), each calibrated with `--length-buckets off` and
with 4 buckets a doubling (padded to its bucket), --steps steps (tau 0, patience 0), float32 weights, one engine
setting a form; per prompt the largest |difference| of the two histories, the first step that differs and the two
best steps; per form the worst.

    python bench/buckets_history.py --threads 2 --steps 11 --out bench/results_buckets_history.jsonl

(--length-mix's random-token prompts have proxies near 1e-5, which hide the differences this measures.)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Norway", "Oslo")]


def requests() -> list[dict]:
    """Six number-word prompts of 2-7 demonstrations (an instruction of 1-3 sentences) and four capitals prompts of
    3-9, the same every run."""
    rng = random.Random(0)
    out = []
    for i in range(6):
        demos = [{"input": w, "output": str(WORDS.index(w) + 1)} for w in rng.sample(WORDS, 2 + i)]
        out.append({"id": f"d{i}", "instruction": "Write each number word as a digit." * (1 + i % 3), "demos": demos,
                    "query": "five"})
    for i in range(4):
        demos = [{"input": a, "output": b} for a, b in rng.sample(CAPITALS, 3 + 2 * i)]
        out.append({"id": f"c{i}", "demos": demos, "query": "Spain"})
    return out


def compare(off: list, padded: list) -> tuple[list[dict], float]:
    """Per prompt (L, its bucket's rows, the |difference| of the initial proxies f(X0), the largest of the two
    histories, the first step that differs, the two best steps, both histories), and the worst difference."""
    rows, worst = [], 0.0
    for (L, rows_padded, h0, b0), (_, _, h1, b1) in zip(off, padded):
        d = [abs(x - y) for x, y in zip(h0, h1)]
        first = next((i for i, x in enumerate(d) if x > 0), None)
        worst = max(worst, max(d))
        rows.append({"L": L, "rows": rows_padded, "step0": d[0], "max_abs": max(d), "first_step": first,
                     "best": [b0, b1], "history_off": h0, "history_4": h1})
    return rows, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--diff-matmul", nargs="+", default=["bf16", "off"], choices=("bf16", "fp8", "off"))
    ap.add_argument("--out", default=None, help="append one JSON line a form to this file")
    args = ap.parse_args(argv)
    from sicl_fast import Engine
    from sicl_fast.models import load
    from sicl_fast.run.buckets import Bucket

    lm = load(dtype="float32", device="cpu")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    for diff in args.diff_matmul:
        load_before, t0, runs = os.getloadavg(), time.time(), {}
        for buckets in ("off", 4):
            eng = Engine(lm, length_buckets=buckets, threads=args.threads, diff_matmul=diff, reuse="off")
            prompts = [eng.prepare(r) for r in requests()]
            results = eng.calibrate_many(prompts, max_steps=args.steps, tau=0.0, patience=0)
            runs[buckets] = [(p.length, Bucket.of(p).rows, r.history, r.best_step) for p, r in zip(prompts, results)]
            plan = eng.plan
        rows, worst = compare(runs["off"], runs[4])
        print(f"# {lm.name} float32, diff_matmul {plan.diff_matmul}, impl {plan.impl}, threads {plan.threads}, "
              f"{args.steps} steps, {time.time() - t0:.0f} s, load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
        print("| L | bucket rows | f(X0) difference | max abs difference | first step that differs | best step "
              "off / 4 |\n|---|---|---|---|---|---|")
        for r in rows:
            first = "-" if r["first_step"] is None else r["first_step"]
            print(f"| {r['L']} | {r['rows']} | {r['step0']:.1e} | {r['max_abs']:.2e} | {first}"
                  f" | {r['best'][0]} / {r['best'][1]} |")
        print(f"worst: {worst:.2e}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": lm.name,
                                    "dtype": "float32", "diff_matmul": plan.diff_matmul, "impl": plan.impl,
                                    "threads": plan.threads, "steps": args.steps, "commit": commit,
                                    "load": [load_before, os.getloadavg()], "prompts": rows, "worst": worst}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
