"""Calibrate once, answer many: per-query latency with the calibration store against a fresh calibration per query,
side by side in one run (issue #25, item 7; results go to bench/RESULTS.md).

    python bench/reuse_latency.py                                  # SmolLM2, 8 demonstrations, 100 queries
    python bench/reuse_latency.py --queries 100 --case fired       # + a config whose projection fires: --reuse on
    python bench/reuse_latency.py --queries 3 --max-steps 2        # a smoke run

One fixed prompt (an instruction and `--demos` demonstrations: number words -> digits) and `--queries` different
queries (number words from zero up, past ninety-nine when more are asked; never a demonstration's). Phases, each
on a fresh engine (its own store), in this order:

  reuse      Engine(reuse='auto'): every query calibrates through the store and decodes its answer; the first query
             pays the calibration (its latency is reported apart), the others reuse it
  batch      the same queries answered from the stored calibration by one Engine.answer_many call
  fresh      Engine(reuse='off'): every query calibrated on its own, then decoded (the baseline); --fresh-limit N
             times only the first N queries (then only the answers of those are compared)

Reported: per-query latency p50 / p95 (steady state: the queries after the first), mean, the first query's cost,
total wall time, the speed-up of the p50, answers identical to the fresh ones (when the reuse was exact), bytes the
store holds per entry (its rows; with the K/V attached where the query-only path keeps them), and the machine's load
(`uptime`) before and after. With --case fired, the config is `--fired-eta` / `--fired-kappa`, under which the
whole-matrix projection fires, and the run uses reuse 'on': the share of answers that differ from the fresh ones.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from sicl_fast import Engine
from sicl_fast.answering.answer import answer_result

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def words(n: int) -> str:
    """The English words of 0 <= n < 10**6: 'forty-two', 'three hundred five', 'one thousand two hundred'."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    unit, name = (100, "hundred") if n < 1000 else (1000, "thousand")
    head = f"{words(n // unit)} {name}"
    return head if n % unit == 0 else f"{head} {words(n % unit)}"


DEMOS = [31, 7, 58, 12, 94, 3, 66, 40, 85, 19, 27, 73]
MAX_QUERIES = 10**6 - len(DEMOS)


def requests(demos: int, queries: int) -> list[dict]:
    """One request per query: `queries` distinct numbers from 0 up (past 99 when needed), the demonstrations' own
    numbers left out."""
    shown = DEMOS[:demos]
    asked = list(itertools.islice((n for n in itertools.count() if n not in shown), queries))
    return [{"id": f"q{n}", "instruction": "Write each number word as a number in digits.",
             "demos": [{"input": words(d), "output": str(d)} for d in shown], "query": words(n)} for n in asked]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        return "?"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def per_query(engine: Engine, prompts, cfg, reuse: str, max_new: int) -> tuple[list[float], list[str], list]:
    """(seconds, answers, results) of calibrate + decode per prompt."""
    secs, answers, results = [], [], []
    for p in prompts:
        t0 = time.perf_counter()
        res = engine.calibrate(p, cfg, reuse=reuse)
        gen = answer_result(engine, res, p, max_new, ("\n",))
        secs.append(time.perf_counter() - t0)
        answers.append(gen.answer)
        results.append(res)
    return secs, answers, results


def stats(secs: list[float]) -> dict:
    steady = secs[1:] or secs
    return {"first_s": secs[0], "p50_s": statistics.median(steady), "p95_s": pct(steady, 0.95),
            "mean_s": statistics.fmean(steady), "total_s": sum(secs), "n": len(secs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--demos", type=int, default=8)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=None, help="default: the preset's (250, patience 5)")
    ap.add_argument("--N", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--fresh-limit", type=int, default=None, help="time the fresh baseline on the first N queries")
    ap.add_argument("--case", choices=["exact", "fired"], default="exact")
    ap.add_argument("--fired-eta", type=float, default=10.0)
    ap.add_argument("--fired-kappa", type=float, default=0.99)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if not 1 <= args.queries <= MAX_QUERIES:
        ap.error(f"--queries must be between 1 and {MAX_QUERIES}, got {args.queries}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = uptime()
    base = Engine(model=args.model)
    over = {"max_steps": args.max_steps, "N": args.N, "seed": args.seed}
    if args.case == "fired":
        over.update(eta=args.fired_eta, kappa=args.fired_kappa, grad_mode="normalize")
    cfg = base.config(**over)
    reqs = requests(args.demos, args.queries)
    prompts = [base.prepare(r, reserve=args.max_new_tokens) for r in reqs]
    mode = "on" if args.case == "fired" else "auto"

    eng = Engine(base.lm, reuse=mode)
    t0 = time.perf_counter()
    r_secs, r_answers, r_results = per_query(eng, prompts, cfg, mode, args.max_new_tokens)
    r_wall = time.perf_counter() - t0
    cal = next((r.calibration for r in r_results if r.calibration is not None and r.calibration.scope == "stem"), None)
    t0 = time.perf_counter()
    batch = eng.answer_many(cal, prompts, max_new_tokens=args.max_new_tokens) if cal is not None else None
    batch_s = time.perf_counter() - t0 if batch is not None else None
    entry_bytes_kv = cal.nbytes if cal is not None else None  # the K/V is attached by the first answer
    entry_bytes = cal.nbytes - (cal.kv.nbytes if cal.kv is not None else 0) if cal is not None else None

    fresh_n = args.fresh_limit or len(prompts)
    eng_off = Engine(base.lm)
    t0 = time.perf_counter()
    f_secs, f_answers, f_results = per_query(eng_off, prompts[:fresh_n], cfg, "off", args.max_new_tokens)
    f_wall = time.perf_counter() - t0

    same = sum(a == b for a, b in zip(r_answers, f_answers))
    exact = [r.exact for r in r_results]
    out = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "device": str(base.lm.device),
                    "load_before": load_before, "load_after": uptime()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([sys.executable, *sys.argv]),
        "model": base.lm.name, "backend": base.backend.name, "impl": base.backend.ops.name, "case": args.case,
        "reuse_mode": mode, "demos": args.demos, "queries": len(prompts),
        "prompt_tokens": [p.length for p in prompts][:3],
        "config": {k: getattr(cfg, k) for k in ("N", "max_steps", "patience", "eta", "kappa", "seed")},
        "calibration": cal.summary() if cal is not None else None,
        "exact_share": sum(exact) / len(exact), "reuse_kinds": {k: [r.reuse for r in r_results].count(k)
                                                                for k in sorted({r.reuse for r in r_results})},
        "reuse": {**stats(r_secs), "wall_s": r_wall},
        "batch": None if batch is None else {"seconds": batch_s, "per_query_s": batch_s / len(prompts),
                                             "same_as_per_query": sum(g.answer == a for g, a in zip(batch, r_answers))},
        "fresh": {**stats(f_secs), "wall_s": f_wall},
        "speedup_p50": statistics.median(f_secs[1:] or f_secs) / statistics.median(r_secs[1:] or r_secs),
        "answers_compared": min(len(r_answers), len(f_answers)), "answers_identical": same,
        "answers_differing_share": 1 - same / max(1, min(len(r_answers), len(f_answers))),
        "store_entry_bytes": entry_bytes, "store_entry_bytes_with_kv": entry_bytes_kv,
    }
    r, f = out["reuse"], out["fresh"]
    print(f"# {out['model']} ({out['backend']}, {out['impl']}), {args.demos} demonstrations, {len(prompts)} queries, "
          f"case {args.case} (reuse {mode}); {out['machine']['load_before']}")
    print("| | first query s | p50 s | p95 s | mean s | total s |")
    print("|---|---|---|---|---|---|")
    for name, x in (("reuse", r), ("fresh", f)):
        print(f"| {name} | {x['first_s']:.3f} | {x['p50_s']:.4f} | {x['p95_s']:.4f} | {x['mean_s']:.4f} | "
              f"{x['total_s']:.2f} |")
    if batch is not None:
        print(f"| answer_many (one batch) | | {out['batch']['per_query_s']:.4f} per query | | | {batch_s:.2f} |")
    print(f"p50 speed-up {out['speedup_p50']:.1f}x; answers identical {same} of {out['answers_compared']}; "
          f"exact share {out['exact_share']:.2f}; store entry {entry_bytes} B ({entry_bytes_kv} B with K/V)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
