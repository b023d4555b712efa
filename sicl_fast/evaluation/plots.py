"""The report's figures (PNG), drawn with matplotlib's Agg canvas directly: no pyplot, no global backend change.

Every figure is written atomically (a temporary file in the same folder, then a rename).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from collections.abc import Sequence

from ..errors import require

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _figure(w: float = 6.4, h: float = 4.4):
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.tight_layout()
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def proxy_vs_accuracy(path, series: Sequence[dict], title: str = "") -> Path:
    """One point per task: mean proxy improvement (x) vs accuracy change in points (y), per run with its
    least-squares line. series: [{"name", "tasks": [...], "x": [...], "y": [...], "fit": (slope, intercept)|None}]"""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for i, s in enumerate(series):
        color, marker = _COLORS[i % len(_COLORS)], _MARKERS[i % len(_MARKERS)]
        pts = [(x, y, t) for x, y, t in zip(s["x"], s["y"], s["tasks"]) if _finite(x) and _finite(y)]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=s["name"], zorder=3)
        for x, y, t in pts:
            ax.annotate(t, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", color=color)
        fit = s.get("fit")
        if fit:
            xs = [p[0] for p in pts]
            lo, hi = min(xs), max(xs)
            ax.plot([lo, hi], [fit[0] * lo + fit[1], fit[0] * hi + fit[1]], color=color, linestyle="--",
                    label=f"{s['name']}: y = {fit[0]:.3g} x {'-' if fit[1] < 0 else '+'} {abs(fit[1]):.3g}")
    ax.axhline(0.0, color="#999999", linewidth=0.8)
    ax.set_xlabel("mean proxy improvement (best - initial)")
    ax.set_ylabel("accuracy change (points)")
    ax.set_title(title or "proxy improvement vs accuracy change, per task")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _save(fig, path)


def proxy_histories(path, histories: dict[str, list[list[float]]], title: str = "", max_curves: int = 400) -> Path:
    """Proxy f0 per step: a line per sample (a marker at each step when there are few, so a one-step history shows),
    bold per-task mean (each curve held at its last value); steps are integers on the axis."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    drawn = 0
    for i, (task, hs) in enumerate(histories.items()):
        color = _COLORS[i % len(_COLORS)]
        hs = [h for h in hs if h]
        if not hs:
            continue
        T = max(len(h) for h in hs)
        for h in hs:
            if drawn < max_curves:
                ax.plot(range(len(h)), h, color=color, alpha=0.5, linewidth=1.0, marker="o" if T <= 30 else None,
                        markersize=2.5)
                drawn += 1
        mean = [sum(h[min(t, len(h) - 1)] for h in hs) / len(hs) for t in range(T)]
        ax.plot(range(T), mean, color=color, linewidth=2.4, label=f"{task} (n={len(hs)})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("proxy f")
    ax.set_title(title or "proxy history")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_bars(path, tasks: Sequence[str], columns: dict[str, Sequence[float | None]], title: str = "") -> Path:
    """Grouped bars: accuracy (%) per task for each column (base, calibrated, methods)."""
    fig = _figure(max(6.4, 1.2 + 0.9 * len(tasks) * max(1, len(columns)) / 2), 4.4)
    ax = fig.add_subplot(1, 1, 1)
    k = max(1, len(columns))
    width = 0.8 / k
    for j, (name, vals) in enumerate(columns.items()):
        xs = [i + (j - (k - 1) / 2) * width for i in range(len(tasks))]
        hs = [100.0 * v if _finite(v) else 0.0 for v in vals]
        ax.bar(xs, hs, width=width, color=_COLORS[j % len(_COLORS)], label=name)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(list(tasks), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or "accuracy per task")
    ax.legend(fontsize=7)
    return _save(fig, path)


def estimator_cosines(path, rows: Sequence[dict], title: str = "") -> Path:
    """The estimator study (diagnostics.gradstudy): cos(g, g*) against N (log scale), one line per mu, one panel per
    estimator. rows: gradstudy.summarize's rows (estimator, mu, N, cosine)."""
    estimators = list(dict.fromkeys(r["estimator"] for r in rows))
    fig = _figure(4.2 * max(1, len(estimators)), 4.0)
    for j, est in enumerate(estimators):
        ax = fig.add_subplot(1, len(estimators), j + 1)
        mus = sorted({r["mu"] for r in rows if r["estimator"] == est})
        for i, mu in enumerate(mus):
            pts = sorted((r["N"], r["cosine"]) for r in rows if r["estimator"] == est and r["mu"] == mu
                         and _finite(r["cosine"]))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=_COLORS[i % len(_COLORS)],
                    marker=_MARKERS[i % len(_MARKERS)], label=f"mu = {mu:g}")
        ax.set_xscale("log", base=2)
        ax.axhline(0.0, color="#999999", linewidth=0.8)
        ax.set_xlabel("N (directions)")
        ax.set_ylabel("cos(ZO estimate, exact gradient)")
        ax.set_title(f"{est}" if not title else f"{title} - {est}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)


def budget_curves(path, budget: dict, title: str = "") -> Path:
    """Per task (a line each): mean proxy gain vs steps and vs seconds (log x), and, when the records decoded
    answers along the way, the share of answers changed from the base vs steps. budget: {task: task_curve}
    (sicl_fast.evaluation.budget)."""
    answers = any(row["answers_changed"] is not None for c in budget.values() for row in c["by_step"])
    panels = 3 if answers else 2
    fig = _figure(4.2 * panels, 4.0)
    axes = [fig.add_subplot(1, panels, j + 1) for j in range(panels)]
    for i, (task, c) in enumerate(budget.items()):
        style = dict(color=_COLORS[i % len(_COLORS)], marker=_MARKERS[i % len(_MARKERS)], markersize=3.5)
        axes[0].plot([r["step"] for r in c["by_step"]], [r["mean_gain"] for r in c["by_step"]], label=task, **style)
        axes[1].plot([r["seconds"] for r in c["by_second"]], [r["mean_gain"] for r in c["by_second"]], **style)
        if answers:
            pts = [(r["step"], 100.0 * r["answers_changed"] / r["n_answers"]) for r in c["by_step"]
                   if r["answers_changed"] is not None and r["n_answers"]]
            axes[2].plot([p[0] for p in pts], [p[1] for p in pts], **style)
    labels = [("steps", "mean proxy gain"), ("seconds of calibration", "mean proxy gain"),
              ("steps", "answers changed from the base (%)")]
    from matplotlib.ticker import NullFormatter

    for ax, (x, y) in zip(axes, labels):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor ticks' labels overlap on a short axis
        ax.set_xlabel(x)
        ax.set_ylabel(y)
    axes[0].set_title(title or "proxy gain and answers changed vs budget", fontsize=9)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    return _save(fig, path)


__all__ = ["proxy_vs_accuracy", "proxy_histories", "accuracy_bars", "estimator_cosines", "budget_curves"]
