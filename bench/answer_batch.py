"""Query-only answering from one stored calibration: ms per query at each batch size of Engine.answer_many
(sicl_fast.answering.answer.ANSWER_BATCH caps the batch), and the tokens of every batch size against one query at a
time, side by side in one run.

    python bench/answer_batch.py --queries 96 --batch 1 8 16 32 96 [--threads 2] [--out results.json]

The prompt: bench/reuse_latency.py's (8 number-word demonstrations), calibrated once (--max-steps, reuse 'on');
the queries: its next --queries numbers. Each batch size answers every query (one warm-up batch first); batch 1 is
the one-by-one reference whose tokens the others must equal. Prints a table and the machine's load (`uptime`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sicl_fast.answering.answer as answer  # noqa: E402
from reuse_latency import requests  # noqa: E402
from sicl_fast import Engine  # noqa: E402


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=96)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32, 96], help="batch sizes (1 first)")
    ap.add_argument("--max-steps", type=int, default=10, help="steps of the one calibration")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args(argv)
    load = [uptime()]
    eng = Engine(threads=args.threads)
    prompts = [eng.prepare(r, reserve=args.max_new_tokens) for r in requests(8, args.queries)]
    cal = eng.calibrate(prompts[0], reuse="on", max_steps=args.max_steps).calibration
    eng.answer_many(cal, prompts[:4], max_new_tokens=args.max_new_tokens)  # warm-up (and the stored K/V)
    rows, ref = [], None
    print(f"# {eng.lm.name}, {eng.plan.threads} threads, {len(prompts)} queries, {args.max_new_tokens} new tokens")
    print("| batch | ms a query | tokens equal to one by one |\n|---|---|---|")
    for b in args.batch:
        answer.ANSWER_BATCH = b
        t0 = time.perf_counter()
        gens = eng.answer_many(cal, prompts, max_new_tokens=args.max_new_tokens)
        ms = (time.perf_counter() - t0) / len(prompts) * 1e3
        tokens = [g.token_ids for g in gens]
        ref = tokens if ref is None else ref
        same = sum(a == r for a, r in zip(tokens, ref))
        rows.append({"batch": b, "ms_per_query": ms, "tokens_equal": same, "queries": len(prompts)})
        print(f"| {b} | {ms:.1f} | {same} of {len(prompts)} |", flush=True)
    load.append(uptime())
    print("load:", " / ".join(load))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": eng.lm.name, "threads": eng.plan.threads, "load": load,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
