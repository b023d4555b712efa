"""Accuracy reporting (SPEC 6.5): per subset, per paper task (micro), and over the benchmark (macro and micro)."""
from __future__ import annotations

from typing import Iterable

from .loader import Sample
from .tasks import PAPER_TASKS


def _acc(correct: int, total: int) -> dict:
    return {"correct": correct, "total": total, "accuracy": correct / total if total else float("nan")}


def aggregate(results: Iterable[tuple[Sample, bool]]) -> dict:
    """Summarise (sample, correct) pairs.

    subsets:    keyed "file/task/task_type" (the file is needed: (task, task_type) is not unique across files)
    tasks:      per paper task, correct/total over all of its samples (micro; Dict. Search pools its two files)
    macro:      unweighted mean of the paper-task accuracies present
    micro:      correct/total over every sample
    """
    subsets: dict[str, list[int]] = {}
    tasks: dict[str, list[int]] = {}
    total = [0, 0]
    for sample, ok in results:
        for table, key in ((subsets, f"{sample.task_file}/{sample.task}/{sample.task_type}"),
                           (tasks, sample.spec.paper_task)):
            cell = table.setdefault(key, [0, 0])
            cell[0] += bool(ok)
            cell[1] += 1
        total[0] += bool(ok)
        total[1] += 1
    task_acc = {t: _acc(*tasks[t]) for t in PAPER_TASKS if t in tasks}
    macro = sum(v["accuracy"] for v in task_acc.values()) / len(task_acc) if task_acc else float("nan")
    return {
        "subsets": {k: _acc(*v) for k, v in sorted(subsets.items())},
        "tasks": task_acc,
        "macro": macro,
        "micro": _acc(*total)["accuracy"],
        "n": total[1],
    }
