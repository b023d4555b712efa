"""Choosing a calibration budget from the records: what a run had gained after k steps and after t seconds, how
many answers had changed by then, and how runs with other stopping rules (min_delta, a time budget) compare.

    budget_curves(records)      per task, from each calibration record's proxy history, its calibration seconds
                                and (icleval --answer-at) the answers decoded along the way:
                                  by step k: mean proxy gain max(history[:k]) - history[0] (a run that stopped
                                    before k keeps its final gain), mean seconds to get there (k steps at the run's
                                    mean seconds per step, its whole time when it stopped before), answers changed
                                    from the base answer and answers that still differ from the final one (of the
                                    records whose answer after k steps is known: decoded there, or final)
                                  by second t: mean proxy gain after floor(t / seconds per step) steps
                                  the suggestion: the first step whose mean gain reaches SHARE of the final mean
                                    gain, and its mean seconds
    runs_compared(runs)         for two or more runs on the same samples (one results file per stopping rule),
                                per calibration variant and task, against the first run: answers that differ,
                                accuracy, mean steps and calibration seconds, stop reasons

Seconds per step are the run's calibration seconds over its steps (the record's `calibration_seconds`, else its
`seconds`, which also holds the decoding): the steps of one run cost the same, the first one also carries the
setup. Records without a history (base, baselines) are left out.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

STEP_MARKS = (1, 2, 5, 10, 20, 50, 100, 250, 500, 1000)
SECOND_MARKS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
SHARE = 0.9  # the suggested budget: where the mean gain reaches this share of the final mean gain


def gain_after(history: Sequence[float], k: int) -> float:
    """The best-so-far proxy gain after k >= 1 steps (the run's final gain when it ran fewer)."""
    return max(history[:max(1, k)]) - history[0]


def seconds_per_step(rec: dict) -> float:
    seconds = rec.get("calibration_seconds", rec.get("seconds")) or 0.0
    return float(seconds) / len(rec["history"])


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def answer_after(rec: dict, k: int) -> str | None:
    """The answer from the best X after k steps: decoded there (answers_at), or the final answer when the run had
    ended by then; None when unknown."""
    at = rec.get("answers_at") or {}
    if str(k) in at:
        return at[str(k)]
    return rec.get("answer_calibrated") if k >= len(rec["history"]) else None


def _answers(rs: Sequence[dict], k: int) -> dict:
    """Of the records whose answer after k steps is known: how many, changed from the base, not yet the final."""
    have = [(r, a) for r in rs if (a := answer_after(r, k)) is not None]
    return {"n_answers": len(have),
            "answers_changed": sum(a != r.get("answer_base") for r, a in have) if have else None,
            "answers_not_final": sum(a != r.get("answer_calibrated") for r, a in have) if have else None}


def task_curve(rs: Sequence[dict]) -> dict:
    """The curves of one task's calibration records (module docstring)."""
    last = max(len(r["history"]) for r in rs)
    asked = {int(k) for r in rs for k in (r.get("answers_at") or {})}
    steps = sorted({k for k in STEP_MARKS if k <= last} | {k for k in asked if k <= last} | {last})
    pace = [seconds_per_step(r) for r in rs]

    def at_step(k: int) -> dict:
        return {"step": k, "mean_gain": _mean([gain_after(r["history"], k) for r in rs]),
                "mean_seconds": _mean([min(k, len(r["history"])) * s for r, s in zip(rs, pace)]), **_answers(rs, k)}

    longest = max(len(r["history"]) * s for r, s in zip(rs, pace))
    seconds = [t for t in SECOND_MARKS if t < longest]
    if len(seconds) < 3:  # short runs: halvings of the longest instead
        seconds = [longest * 2.0**-j for j in range(6, 0, -1)]
    seconds.append(longest)
    by_second = [{"seconds": t, "mean_gain": _mean([gain_after(r["history"], int(t / s) if s > 0 else len(r["history"]))
                                                    for r, s in zip(rs, pace)])} for t in seconds]
    final = _mean([gain_after(r["history"], last) for r in rs])
    suggested = None
    if final > 0:
        k = next(k for k in range(1, last + 1) if _mean([gain_after(r["history"], k) for r in rs]) >= SHARE * final)
        suggested = {"share": SHARE, "step": k, "mean_seconds": at_step(k)["mean_seconds"]}
    return {"n": len(rs), "mean_seconds_per_step": _mean(pace), "final_gain": final,
            "by_step": [at_step(k) for k in steps], "by_second": by_second, "suggested": suggested}


def budget_curves(records: Sequence[dict], task_order=sorted) -> dict | None:
    """{task: task_curve} over the records that hold a proxy history; None when none does."""
    by_task: dict[str, list[dict]] = {}
    for r in records:
        if r.get("history"):
            by_task.setdefault(r["task"], []).append(r)
    return {t: task_curve(by_task[t]) for t in task_order(by_task)} or None


def runs_compared(runs: Sequence[tuple[str, Sequence[dict]]], task_order=sorted) -> list[dict] | None:
    """One row per (calibration variant, later run, task) on the samples both runs hold, against the first run
    (module docstring); None with fewer than two runs or nothing in common."""
    if len(runs) < 2:
        return None
    (first, _ref), rows = runs[0], []
    keyed = [(name, {(r.get("variant", r.get("method", "sicl")), r["task"], r["uid"]): r for r in recs
                     if r.get("history")}) for name, recs in runs]
    ref_keys = keyed[0][1]
    for name, recs in keyed[1:]:
        common = sorted(set(ref_keys) & set(recs), key=lambda k: (k[0], k[1], str(k[2])))
        for variant in dict.fromkeys(k[0] for k in common):
            tasks = task_order({k[1] for k in common if k[0] == variant})
            for task in tasks:
                pairs = [(ref_keys[k], recs[k]) for k in common if k[:2] == (variant, task)]
                a, b = [p[0] for p in pairs], [p[1] for p in pairs]
                rows.append({
                    "variant": variant, "run": name, "reference": first, "task": task, "n": len(pairs),
                    "answers_differ": sum(x.get("answer_calibrated") != y.get("answer_calibrated") for x, y in pairs),
                    "accuracy": [_mean([bool(r["correct_calibrated"]) for r in rs]) for rs in (a, b)],
                    "mean_steps": [_mean([len(r["history"]) for r in rs]) for rs in (a, b)],
                    "mean_seconds": [_mean([seconds_per_step(r) * len(r["history"]) for r in rs]) for rs in (a, b)],
                    "stop_reasons": dict(Counter(str(r.get("stop_reason")) for r in b if r.get("stop_reason")))})
    return rows or None


__all__ = ["STEP_MARKS", "SECOND_MARKS", "SHARE", "gain_after", "seconds_per_step", "task_curve", "budget_curves",
           "runs_compared", "answer_after"]
