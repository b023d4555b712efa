"""Length buckets on vs off on the real model: how far a padded run's proxy history lies from the unpadded one's
(docs/performance.md states it; bench/RESULTS.md section 20). Ten few-shot prompts of 33-104 tokens (number words,
capitals; seeded), each calibrated with `--length-buckets off` and with 4 buckets a doubling (padded to its bucket),
--steps steps (tau 0, patience 0), on one engine setting; per prompt the largest |difference| of the two histories,
the first step that differs and the two best steps.

    python bench/buckets_history.py --threads 2 --steps 11 --diff-matmul auto

(--length-mix's random-token prompts have proxies near 1e-5, which hide the differences this measures.)
"""
from __future__ import annotations

import argparse
import random

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--diff-matmul", default="auto", choices=("auto", "off", "bf16", "fp8"))
    args = ap.parse_args(argv)
    from sicl_fast import Engine
    from sicl_fast.models import load

    lm = load(dtype="float32", device="cpu")
    runs = {}
    for buckets in ("off", 4):
        eng = Engine(lm, length_buckets=buckets, threads=args.threads, diff_matmul=args.diff_matmul)
        prompts = [eng.prepare(r) for r in requests()]
        results = eng.calibrate_many(prompts, max_steps=args.steps, tau=0.0, patience=0)
        runs[buckets] = [(p.length, r.history, r.best_step) for p, r in zip(prompts, results)]
        plan = eng.plan
    print(f"# {lm.name}, diff_matmul {plan.diff_matmul}, impl {plan.impl}, threads {plan.threads}, {args.steps} steps")
    print("| L | max abs difference | first step that differs | best step off / 4 |\n|---|---|---|---|")
    worst = 0.0
    for (L, h0, b0), (_, h1, b1) in zip(runs["off"], runs[4]):
        d = [abs(x - y) for x, y in zip(h0, h1)]
        first = next((i for i, x in enumerate(d) if x > 0), "-")
        worst = max(worst, max(d))
        print(f"| {L} | {max(d):.2e} | {first} | {b0} / {b1} |")
    print(f"worst: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
