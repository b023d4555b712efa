"""`sicl-fast icleval`: base vs calibrated greedy decoding on ICLEval task files, scored by the benchmark's rules.

Per sample: tokenize as ICLEval does (the tokenizer's default special tokens, which form the fixed prefix; no
truncation), decode greedily up to the task's max_gen_len from X0 (base) and from the calibrated X, score both.
Records go to a resumable JSONL, one whole line per sample, keyed by (task, uid).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..records import ResultWriter
from .convert import tokenize_sample
from .loader import load_dir
from .scoring import max_gen_len, score, should_stop


def _key(rec: dict) -> tuple[str, int]:
    return rec["task"], rec["uid"]


def run_icleval(engine, config, data_dir: str | Path, tasks=None, limit: int | None = None, out_path=None,
                progress: bool = True) -> list[dict]:
    """Run the benchmark; returns every record of the selected samples (those already in out_path included)."""
    from tqdm import tqdm

    data = load_dir(data_dir, tasks)
    samples = [s for name in data for s in (data[name][:limit] if limit is not None else data[name])]
    tok, ctx = engine.lm.tokenizer, engine.lm.max_context
    prompts = {(s.task_file, s.uid): tokenize_sample(s, tok, ctx) for s in samples}  # every error before any work
    records: list[dict] = []
    with ResultWriter(out_path, key=_key) as out:
        todo = [s for s in samples if (s.task_file, s.uid) not in out]
        bar = tqdm(total=len(todo), desc="icleval", unit="sample", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True)
        for s in todo:
            p = prompts[(s.task_file, s.uid)]
            n_new = max_gen_len(s)
            stop = lambda text, s=s: should_stop(s, text)  # noqa: E731 - ICLEval's allowed early stop
            t0 = time.perf_counter()
            base = engine.generate(p, max_new_tokens=n_new, stop_strings=(), stop_fn=stop)
            res = engine.calibrate(p, config)
            cal = base if res.best_step == 0 else engine.generate(
                p, res.embeddings, max_new_tokens=n_new, stop_strings=(), stop_fn=stop)
            rec = {
                "task": s.task_file, "uid": s.uid, "label": s.label,
                "answer_base": base.text, "answer_calibrated": cal.text,
                "correct_base": score(s, base.text), "correct_calibrated": score(s, cal.text),
                "initial_proxy": res.initial_proxy, "best_proxy": res.best_proxy, "steps": res.steps,
                "gated": res.gated, "seconds": round(time.perf_counter() - t0, 3), "history": res.history,
            }
            out.write(rec)
            bar.update(1)
        bar.close()
    from ..records import read_records

    wanted = set(prompts)
    for rec in read_records(out_path):
        if _key(rec) in wanted:
            records.append(rec)
    return records


def accuracy_table(records: list[dict]) -> list[dict]:
    """Per task: n, base and calibrated accuracy, change in points; then 'mean' (macro over tasks) and 'all' (micro)."""
    by_task: dict[str, list[dict]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    rows = []
    for task in sorted(by_task):
        rs = by_task[task]
        n = len(rs)
        rows.append({"task": task, "n": n, "base": sum(r["correct_base"] for r in rs) / n,
                     "calibrated": sum(r["correct_calibrated"] for r in rs) / n,
                     "steps": sum(r["steps"] for r in rs) / n})
    if rows:
        rows.append({"task": "mean", "n": sum(r["n"] for r in rows),
                     "base": sum(r["base"] for r in rows) / len(rows),
                     "calibrated": sum(r["calibrated"] for r in rows) / len(rows),
                     "steps": sum(r["steps"] for r in rows) / len(rows)})
        n = len(records)
        rows.append({"task": "all (micro)", "n": n, "base": sum(r["correct_base"] for r in records) / n,
                     "calibrated": sum(r["correct_calibrated"] for r in records) / n,
                     "steps": sum(r["steps"] for r in records) / n})
    return rows


def print_table(records: list[dict], file=None) -> None:
    file = file or sys.stdout
    print("| task | n | base acc | calibrated acc | change (points) | mean steps |", file=file)
    print("|---|---|---|---|---|---|", file=file)
    for r in accuracy_table(records):
        print(f"| {r['task']} | {r['n']} | {100 * r['base']:.1f} | {100 * r['calibrated']:.1f} | "
              f"{100 * (r['calibrated'] - r['base']):+.1f} | {r['steps']:.1f} |", file=file)
