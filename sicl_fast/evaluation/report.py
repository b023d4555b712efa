"""The paper's analysis of per-sample records: tables, tests and figures, written to RUN/ as report.md + report.json.

A *run* is one results file (one model); its records are grouped by *variant* (base, sicl and its ablations, cc,
dcpmi, demo). For every variant:

* the per-task table: n, base accuracy, the variant's accuracy ("calibrated"), relative change in percent
  (100 (cal - base) / base; n/a when base = 0), change in points, mean steps, seconds per sample, samples per
  minute; the mean row is the unweighted mean over tasks (its relative change is computed from the two means),
  the micro row pools samples;
* the one-sided exact McNemar test over all samples (H1: the variant beats the base), with b = #(base wrong,
  variant right), c = #(base right, variant wrong), p = P(X >= b | X ~ Bin(b + c, 1/2));
* for calibration variants: per task the mean proxy improvement (best_proxy - initial_proxy, gated samples count
  as 0) against the accuracy change (points), the one-sided Spearman test over tasks (H1: rho > 0) and the
  least-squares line; the proxy gain per minute (the task's summed improvement over its summed minutes) and how
  many answers the calibration changed (answer_calibrated != answer_base), to compare estimators (sicl vs
  sicl-grad) at their own cost.

For calibration variants also the budget curves (sicl_fast.evaluation.budget): per task the mean proxy gain and
the answers changed as a function of steps and of seconds, and the step where the gain reaches 90% of its final
value. Across runs given together (other models, or one file per stopping rule: min_delta, a time budget), the
answers that differ from the first run's, with its accuracy, steps and seconds beside them, and Fisher's method
combining each calibration variant's one-sided Spearman p-values. With more than one variant, a table compares
the methods' accuracies per task, as in the paper. Figures: proxy improvement vs accuracy change (one per variant,
every run in it), proxy histories, the budget curves, accuracy per task. Everything is written atomically; NaN
becomes null in the JSON.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence

from ..errors import SiclError
from ..icleval.tasks import TASK_FILES
from ..formats.records import read_records, same_file, write_text_atomic
from ..run.settings import record_settings
from . import stats
from .budget import budget_curves, runs_compared

METHOD_ORDER = ("base", "sicl", "sicl-grad", "cc", "dcpmi", "demo")


@dataclass
class Run:
    name: str
    records: list[dict]
    source: str = ""
    meta: dict = field(default_factory=dict)


def load_runs(paths: Sequence[str | os.PathLike], names: Sequence[str] | None = None) -> list[Run]:
    """One Run per results file and settings, named by its model (the records' "model" field) or else by the file's
    stem (or by `names`, one per file). A file holding records of several settings (sicl_fast.run.settings: two
    models, dtypes, difference products, backends, configs, ...) is split into one run per settings, each named with
    what sets it apart, and said so on stderr: records of other settings are never pooled. Records without settings
    (written before records carried them) are a run of their own per model, "settings unknown"."""
    if names is not None and len(names) != len(paths):
        raise SiclError(f"{len(names)} names for {len(paths)} results files")
    if names is not None and not all(n.strip() for n in names):
        raise SiclError("--names: an empty name; give each run a name (or leave --names out: the records' model)")
    for i, p in enumerate(paths):  # the same file twice (by identity: a link or another spelling of its path
        # included) would count its records as two runs' evidence (Fisher's method over runs); a path that is no
        # file is read_records' to name
        twin = next((q for q in paths[:i] if same_file(p, q)), None) if Path(p).is_file() else None
        if twin is not None:
            raise SiclError(f"results file {p}: is {twin} again; give each run's file once")
    runs: list[Run] = []
    used: set[str] = set()
    for i, p in enumerate(paths):
        records = drop_failed(read_records(p, allow_empty=False), str(p))
        check_fields(records, str(p))  # before they are split by their settings, which reads them
        parts = split_by_settings(records)
        if len(parts) > 1:
            print(f"note: {p}: its records were made with {len(parts)} different settings, reported as "
                  f"{len(parts)} runs (never pooled): " + "; ".join(label for _, label, _ in parts), file=sys.stderr)
        for _, label, recs in parts:
            if names is not None:
                name = names[i]
            else:
                models = {r.get("model") for r in recs if r.get("model")}
                name = models.pop() if len(models) == 1 else Path(p).stem
                if name in used:
                    name = f"{name} ({Path(p).stem})"
            name = f"{name} [{label}]" if len(parts) > 1 else name
            k, base = 2, name
            while name in used:
                name, k = f"{base} #{k}", k + 1
            used.add(name)
            runs.append(Run(name=name, records=recs, source=str(p)))
    return runs


def split_by_settings(records: Sequence[dict]) -> list[tuple[dict | None, str, list[dict]]]:
    """The records grouped by their settings (sicl_fast.run.settings.record_settings; those without, by their model;
    settings the one rule, settings_diff, finds equal in one group), in order of first appearance: (settings or None,
    a label naming what sets the group apart from the others, its records)."""
    from ..run.settings import flatten, settings_diff, short_name

    groups: dict = {}
    same: dict = {}  # the JSON of a settings object -> the key of its group: the first one settings_diff finds equal
    for r in records:
        got = record_settings(r)
        if got is None:
            key = ("unknown", str(r.get("model")))
        else:
            text = json.dumps(got, sort_keys=True)
            if text not in same:
                same[text] = next((k for k, (g, _) in groups.items() if g is not None and not settings_diff(g, got)),
                                  ("known", text))
            key = same[text]
        groups.setdefault(key, (got, []))[1].append(r)
    known = [g for g, _ in groups.values() if g is not None]
    differ = sorted({n for g in known[1:] for n in settings_diff(known[0], g)})
    flats = [flatten(g) for g in known]
    # the names that tell most groups apart first; as many of them as make every label its own (3 at least)
    differ.sort(key=lambda n: -len({_label_value(f.get(n)) for f in flats}))
    shown = min(3, len(differ))
    while shown < len(differ) and len({tuple(_label_value(f.get(n)) for n in differ[:shown]) for f in flats}) < len(
            flats):
        shown += 1
    unknown_models = {k[1] for k in groups if k[0] == "unknown"}
    out = []
    for (_, model), (got, recs) in groups.items():
        if got is None:
            label = "settings unknown" + (f", model {model}" if len(unknown_models) > 1 else "")
        else:
            flat = flatten(got)
            parts = [f"{short_name(n)}={_label_value(flat.get(n))}" for n in differ[:shown]]
            more = len(differ) - shown
            label = ", ".join(parts + ([f"+{more} more"] if more > 0 else [])) or "settings recorded"
        out.append((got, label, recs))
    return out


def _label_value(v) -> str:
    """A setting's value in a run's label: a string as it is, unless it reads as another JSON value ("1", "true":
    then quoted, so that it does not read as the number or the bool another run holds)."""
    if v is None:
        return "unset"
    if not isinstance(v, str):
        return json.dumps(v)
    try:
        json.loads(v)
    except ValueError:
        return v
    return json.dumps(v)


# -----------------------------------------------------------------------------------------------------------------
# helpers


def method_of(rec: dict) -> str:
    return rec.get("method", "sicl")


def variant_of(rec: dict) -> str:
    return rec.get("variant", method_of(rec))


def _task_order(tasks) -> list[str]:
    known = {t: i for i, t in enumerate(TASK_FILES)}
    return sorted(set(tasks), key=lambda t: (known.get(t, len(known)), t))


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _rel(base: float, cal: float) -> float:
    if math.isnan(base) or math.isnan(cal) or base == 0:
        return math.nan
    return 100.0 * (cal - base) / base


def group_variants(records: Sequence[dict]) -> OrderedDict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(variant_of(r), []).append(r)

    def rank(name: str):
        m = method_of(groups[name][0])
        return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), name != m, name)

    return OrderedDict((k, groups[k]) for k in sorted(groups, key=rank))


def drop_failed(records: Sequence[dict], where: str = "") -> list[dict]:
    """The records without an "error" (samples whose worker died too often in a Ray run), saying how many left."""
    ok = [r for r in records if "error" not in r]
    if len(ok) < len(records):
        print(f"note: {where}: {len(records) - len(ok)} error record(s) left out of the report (rerun them with a "
              f"new --out, or delete those lines and resume)", file=sys.stderr)
    return ok


NEEDED = ("task", "uid", "correct_base", "correct_calibrated")  # the fields every record of a report has


def check_fields(records: Sequence[dict], where: str = "") -> None:
    """Every record has the fields the report reads (NEEDED), each of its JSON type (methods.record_problem: a
    "false" read as true, or a string among numbers, would be a wrong table or an internal error)."""
    from .methods import record_problem

    for i, r in enumerate(records):
        miss = [k for k in NEEDED if k not in r]
        if miss:
            raise SiclError(f"{where} record {i}: missing field(s) {', '.join(miss)}")
        problem = record_problem(r)
        if problem is not None:
            raise SiclError(f"{where} record {i} ({r['task']}:{r['uid']}): {problem}"
                            if isinstance(r["task"], str) and isinstance(r["uid"], int) else
                            f"{where} record {i}: {problem}")


def check_records(records: Sequence[dict], where: str = "") -> None:
    """Every record has the fields the report reads, of their types (check_fields); one (variant, task, uid) at most
    once; every record of one settings (split_by_settings), and the records of one variant with one setting
    (check_settings)."""
    check_fields(records, where)
    seen = set()
    for i, r in enumerate(records):
        key = (variant_of(r), r["task"], r["uid"])
        if key in seen:
            raise SiclError(f"{where} record {i}: duplicate record for variant {key[0]!r}, {key[1]}:{key[2]}")
        seen.add(key)
    parts = split_by_settings(records)
    if len(parts) > 1:
        raise SiclError(f"{where}: holds records of {len(parts)} settings ({'; '.join(p[1] for p in parts)}); a run "
                        "pools the records of one settings (load_runs splits a file into one run per settings)")
    check_settings(records, where)


def check_settings(records: Sequence[dict], where: str = "") -> None:
    """Refuse a variant of one run whose records were run with other settings (its config, time budget,
    --answer-at, compared by sicl_fast.run.settings.settings_diff, the rule of every resume): pooled, they would read
    as one run of the first record's settings. Runs are split by their records' settings first (load_runs), so this
    finds what those do not tell apart: records without settings (an older version's) or edited by hand. The
    message names each setting that differs with both values. Records without a config are not compared."""
    from ..run.settings import describe_diff
    from .methods import settings_diff, variant_settings

    first: dict[str, tuple[dict, dict]] = {}
    for r in records:
        if not isinstance(r.get("config"), dict):
            continue
        name = variant_of(r)
        if name not in first:
            first[name] = (r, variant_settings(r))
            continue
        r0, want = first[name]
        got = variant_settings(r, want)
        diff = settings_diff(got, want)
        if diff:
            raise SiclError(f"{where}: variant {name!r} holds records run with other settings: "
                            f"{describe_diff(want, got, diff)} ({r0['task']}:{r0['uid']} / {r['task']}:{r['uid']}); "
                            "a report pools one run's records: give each run its own results file")


# -----------------------------------------------------------------------------------------------------------------
# tables and tests


def task_table(records: Sequence[dict]) -> dict:
    """Per-task rows, the mean row (macro over tasks) and the micro row (all samples pooled)."""
    by_task: dict[str, list[dict]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    rows = []
    for t in _task_order(by_task):
        rs = by_task[t]
        n = len(rs)
        base = sum(bool(r["correct_base"]) for r in rs) / n
        cal = sum(bool(r["correct_calibrated"]) for r in rs) / n
        rows.append({"task": t, "n": n, "base": base, "calibrated": cal, "relative_change": _rel(base, cal),
                     "change_points": 100.0 * (cal - base), "mean_steps": _mean(r.get("steps") for r in rs),
                     "mean_seconds": _mean(r.get("seconds") for r in rs), "samples_per_minute": _rate(rs)})
    if not rows:
        return {"tasks": [], "mean": None, "micro": None}
    mb, mc = _mean(x["base"] for x in rows), _mean(x["calibrated"] for x in rows)
    mean = {"task": "mean", "n": sum(x["n"] for x in rows), "base": mb, "calibrated": mc,
            "relative_change": _rel(mb, mc), "change_points": 100.0 * (mc - mb),
            "mean_steps": _mean(x["mean_steps"] for x in rows), "mean_seconds": _mean(x["mean_seconds"] for x in rows),
            "samples_per_minute": None}
    n = len(records)
    ub = sum(bool(r["correct_base"]) for r in records) / n
    uc = sum(bool(r["correct_calibrated"]) for r in records) / n
    micro = {"task": "all (micro)", "n": n, "base": ub, "calibrated": uc, "relative_change": _rel(ub, uc),
             "change_points": 100.0 * (uc - ub), "mean_steps": _mean(r.get("steps") for r in records),
             "mean_seconds": _mean(r.get("seconds") for r in records), "samples_per_minute": _rate(records)}
    return {"tasks": rows, "mean": mean, "micro": micro}


def _rate(records: Sequence[dict]) -> float | None:
    """Samples per minute of wall time spent on them (their `seconds` summed); None without timings. Per minute:
    a calibration takes seconds to minutes, so a rate per second would print as 0.00."""
    total = sum(float(r.get("seconds") or 0.0) for r in records)
    return 60.0 * len(records) / total if total > 0 else None


VERDICT_ALPHA = 0.05


def verdict(b: int, c: int, p_better: float, p_worse: float) -> str:
    """What calibration did to the answers, in words: 'helped' / 'hurt' when the one-sided exact McNemar test of
    that direction has p < VERDICT_ALPHA; otherwise 'no significant change', or 'no change' when no sample went
    from wrong to right or back (b = c = 0)."""
    if b == c == 0:
        return "no change"
    if p_better < VERDICT_ALPHA:
        return "helped"
    if p_worse < VERDICT_ALPHA:
        return "hurt"
    return "no significant change"


def mcnemar(records: Sequence[dict]) -> dict:
    """The exact McNemar test both ways (p: H1 calibrated better; p_worse: H1 calibrated worse) and the verdict."""
    base = [bool(r["correct_base"]) for r in records]
    cal = [bool(r["correct_calibrated"]) for r in records]
    res = stats.mcnemar_exact(base, cal)
    p_worse = stats.mcnemar_exact(cal, base).p
    return {**res.to_dict(), "p_worse": p_worse, "samples": len(records),
            "verdict": verdict(res.b, res.c, res.p, p_worse)}


def has_proxy(records: Sequence[dict]) -> bool:
    return any(r.get("initial_proxy") is not None and r.get("best_proxy") is not None for r in records)


def proxy_analysis(records: Sequence[dict]) -> dict | None:
    """Per task: mean (best_proxy - initial_proxy) and accuracy change; Spearman over tasks; least squares."""
    if not has_proxy(records):
        return None
    by_task: dict[str, list[dict]] = {}
    for r in records:
        if r.get("initial_proxy") is not None and r.get("best_proxy") is not None:
            by_task.setdefault(r["task"], []).append(r)
    rows = []
    for t in _task_order(by_task):
        rs = by_task[t]
        n = len(rs)
        rows.append({"task": t, "n": n,
                     "mean_proxy_improvement": sum(r["best_proxy"] - r["initial_proxy"] for r in rs) / n,
                     "mean_initial_proxy": sum(r["initial_proxy"] for r in rs) / n,
                     "mean_best_proxy": sum(r["best_proxy"] for r in rs) / n,
                     "gated": sum(bool(r.get("gated")) for r in rs),
                     "proxy_gain_per_minute": _ratio(sum(r["best_proxy"] - r["initial_proxy"] for r in rs),
                                                     sum(float(r.get("seconds") or 0.0) for r in rs) / 60.0),
                     "answers_changed": sum(r.get("answer_calibrated") != r.get("answer_base") for r in rs),
                     "stop_reasons": dict(Counter(str(r.get("stop_reason")) for r in rs if r.get("stop_reason"))),
                     "accuracy_change": 100.0 * (sum(bool(r["correct_calibrated"]) for r in rs)
                                                 - sum(bool(r["correct_base"]) for r in rs)) / n})
    x = [r["mean_proxy_improvement"] for r in rows]
    y = [r["accuracy_change"] for r in rows]
    fit = stats.least_squares(x, y)
    return {"tasks": rows, "spearman": stats.spearman_one_sided(x, y).to_dict(),
            "fit": None if fit is None else {"slope": fit[0], "intercept": fit[1]}}


def methods_table(groups: OrderedDict[str, list[dict]]) -> dict:
    """Accuracy per task of the base and of every variant on the samples that every variant has (all methods on
    the same samples, as in the paper's table; with cc / dcpmi / demo that is the classification subset). The
    "base (label scoring)" column (uncalibrated argmax label) appears when baseline records carry it. When the
    variants share no sample, each column uses its own samples (same_samples = False)."""
    keysets = [{(r["task"], r["uid"]) for r in recs} for recs in groups.values()]
    common = set.intersection(*keysets) if keysets else set()
    shared = bool(common)
    base: dict[str, dict] = {}
    scored: dict[str, dict] = {}
    cols: OrderedDict[str, dict[str, float]] = OrderedDict()
    for name, recs in groups.items():
        rs = [r for r in recs if not shared or (r["task"], r["uid"]) in common]
        by_task: dict[str, list[dict]] = {}
        for r in rs:
            by_task.setdefault(r["task"], []).append(r)
            base.setdefault(r["task"], {}).setdefault(r["uid"], bool(r["correct_base"]))
            if "correct_scored_base" in r:
                scored.setdefault(r["task"], {}).setdefault(r["uid"], bool(r["correct_scored_base"]))
        if method_of(recs[0]) != "base":
            cols[name] = {t: sum(bool(r["correct_calibrated"]) for r in v) / len(v) for t, v in by_task.items()}
    columns: OrderedDict[str, dict[str, float]] = OrderedDict()
    columns["base"] = {t: sum(v.values()) / len(v) for t, v in base.items()}
    if scored:
        columns["base (label scoring)"] = {t: sum(v.values()) / len(v) for t, v in scored.items()}
    columns.update(cols)
    tasks = _task_order(base)
    full = [t for t in tasks if all(t in c for c in columns.values())]
    return {"columns": list(columns), "tasks": tasks, "same_samples": shared,
            "n": sum(len(base[t]) for t in tasks),
            "rows": [{"task": t, "n": len(base[t]), **{c: columns[c].get(t) for c in columns}} for t in tasks],
            "mean": {"tasks": full, **{c: (_mean(columns[c][t] for t in full) if full else None) for c in columns}}}


def variant_report(name: str, records: Sequence[dict]) -> dict:
    first = records[0]
    out = {"variant": name, "method": method_of(first), "config": first.get("config"), "n": len(records),
           "table": task_table(records), "mcnemar": mcnemar(records), "proxy": proxy_analysis(records),
           "budget": budget_curves(records, _task_order)}
    if any("correct_scored_base" in r for r in records):
        rs = [r for r in records if "correct_scored_base" in r]
        out["label_scoring_base_accuracy"] = sum(bool(r["correct_scored_base"]) for r in rs) / len(rs)
    return out


def build_report(runs: Sequence[Run]) -> dict:
    """Everything the report shows, as plain data (NaN kept; `write_report` turns it into null)."""
    out_runs = []
    for run in runs:
        check_records(run.records, run.source or run.name)  # the file, where there is one
        groups = group_variants(run.records)
        out_runs.append({"name": run.name, "source": run.source, "n_records": len(run.records),
                         "settings": record_settings(run.records[0]) if run.records else None,
                         "models": sorted({r["model"] for r in run.records if r.get("model")}),
                         "variants": [variant_report(k, v) for k, v in groups.items()],
                         "methods": methods_table(groups) if len(groups) > 1 else None})
    fisher = {}
    names = list(dict.fromkeys(v["variant"] for r in out_runs for v in r["variants"] if v["proxy"] is not None))
    for vn in names:
        items = []
        for r in out_runs:
            for v in r["variants"]:
                if v["variant"] == vn and v["proxy"] is not None:
                    items.append((r["name"], v["proxy"]["spearman"]["p"], v["proxy"]["spearman"]["p_exact"]))
        ps = [(n, p) for n, p, _ in items if p is not None and not math.isnan(p)]
        pe = [(n, p) for n, _, p in items if p is not None and not math.isnan(p)]
        fisher[vn] = {
            "runs": [n for n, _ in ps], "pvalues": [p for _, p in ps],
            "excluded": [n for n, p, _ in items if p is None or math.isnan(p)],
            **stats.fisher_combined([p for _, p in ps]).to_dict(),
            "exact": stats.fisher_combined([p for _, p in pe]).to_dict() if len(pe) == len(items) and pe else None,
        }
    return {"runs": out_runs, "fisher": fisher,
            "compared": runs_compared([(run.name, run.records) for run in runs], _task_order)}


# -----------------------------------------------------------------------------------------------------------------
# Markdown


def _pct(v, signed=False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{100 * v:+.1f}" if signed else f"{100 * v:.1f}"


RATE = "{:.3g}"  # times and rates: three significant digits, so a slow rate never prints as 0.00
GAIN = "{:.3g}"  # proxy gains along a run: from 1e-5 a step (float32 rounding) to 1e-1


def _num(v, fmt="{:.2f}", signed=False) -> str:
    if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
        return "n/a"
    return (("+" if signed and v >= 0 else "") + fmt.format(v))


def _p(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _stops(reasons: dict | None) -> str:
    """{'patience': 7, 'max_steps': 1} -> 'patience 7, max_steps 1' (most frequent first)."""
    if not reasons:
        return "n/a"
    return ", ".join(f"{k} {n}" for k, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _config_line(cfg) -> str:
    if not cfg:
        return ""
    keys = ("estimator", "grad_mode", "N", "mu", "eta", "kappa", "tau", "max_steps", "patience", "alpha", "beta",
            "gamma", "perturb_query")
    if all(k in cfg for k in ("N", "mu")):
        return ", ".join(f"{k}={_fmt(cfg[k])}" for k in keys if k in cfg)
    return ", ".join(f"{k}={_fmt(v)}" for k, v in cfg.items())


def _run_settings_line(st: dict) -> str:
    """The run-level settings of a run (sicl_fast.run.settings) in one line; the config is each variant's line."""
    model = st.get("model") if isinstance(st.get("model"), dict) else {"name": st.get("model")}
    parts = [f"model {model.get('name')} ({model.get('fingerprint')})",
             f"{st.get('dtype')} on {st.get('device')}"]
    parts += [f"{k} {'off' if st.get(k) is None else st.get(k)}"
              for k in ("backend", "impl", "attention", "diff_matmul", "length_buckets", "pack")]
    if st.get("time_budget_s") is not None:
        parts.append(f"time budget {st['time_budget_s']} s")
    if st.get("answers_at"):
        parts.append(f"answers at {st['answers_at']}")
    return ", ".join(parts)


def render_markdown(report: dict) -> str:
    L: list[str] = ["# sicl_fast evaluation report", ""]
    L.append(
        "Runs: " + ", ".join(f"**{r['name']}** (`{r['source']}`, {r['n_records']} records)" for r in report["runs"])
    )
    L.append("")
    for run in report["runs"]:
        L += [f"## {run['name']}", ""]
        if run.get("settings"):
            L += [f"Run settings: {_run_settings_line(run['settings'])}", ""]
        elif "settings" in run:
            L += ["Run settings: unknown (records written before they carried their settings)", ""]
        mt = run.get("methods")
        if mt:
            L += ["### Methods compared (accuracy %, per task)", "",
                  (f"On the {_plural(mt['n'], 'sample')} that every method has." if mt["same_samples"]
                   else "The methods share no sample: each column uses its own samples."), ""]
            L.append("| task | n | " + " | ".join(mt["columns"]) + " |")
            L.append("|---|---|" + "---|" * len(mt["columns"]))
            for row in mt["rows"]:
                L.append(f"| {row['task']} | {row['n']} | " + " | ".join(_pct(row[c]) for c in mt["columns"]) + " |")
            m = mt["mean"]
            L.append(f"| mean ({_plural(len(m['tasks']), 'task')}) | | "
                     + " | ".join(_pct(m[c]) for c in mt["columns"]) + " |")
            L.append("")
        for v in run["variants"]:
            L += [f"### {v['variant']} (method {v['method']}, {_plural(v['n'], 'sample')})", ""]
            if _config_line(v.get("config")):
                L += [f"Settings: {_config_line(v['config'])}", ""]
            L.append("| task | n | base acc (%) | calibrated acc (%) | relative change (%) | change (points) | "
                     "mean steps | s / sample | samples / min |")
            L.append("|---|---|---|---|---|---|---|---|---|")
            tbl = v["table"]
            for row in tbl["tasks"] + [x for x in (tbl["mean"], tbl["micro"]) if x]:
                L.append(
                    f"| {row['task']} | {row['n']} | {_pct(row['base'])} | {_pct(row['calibrated'])} | "
                    f"{_num(row['relative_change'], '{:.1f}', True)} | {_num(row['change_points'], '{:.1f}', True)} | "
                    f"{_num(row['mean_steps'], '{:.1f}')} | {_num(row['mean_seconds'], RATE)} | "
                    f"{_num(row.get('samples_per_minute'), RATE)} |"
                )
            if "label_scoring_base_accuracy" in v:
                L.append(
                    f"\nUncalibrated label scoring on the same samples: {_pct(v['label_scoring_base_accuracy'])}%."
                )
            mc = v["mcnemar"]
            if v["method"] != "base":
                L += ["", f"McNemar (exact, one-sided, H1: {v['variant']} > base): b = {mc['b']} (base wrong, "
                      f"{v['variant']} right), c = {mc['c']} (base right, {v['variant']} wrong), n = {mc['n']}, "
                      f"p = {_p(mc['p'])}; the other way (H1: {v['variant']} < base) p = {_p(mc.get('p_worse'))}. "
                      f"Verdict: **{mc.get('verdict', 'n/a')}**."]
            L.append("")
            px = v.get("proxy")
            if px:
                L.append(
                    "| task | n | mean proxy improvement | mean initial proxy | gated | stops | proxy gain / min | "
                    "answers changed | accuracy change (points) |"
                )
                L.append("|---|---|---|---|---|---|---|---|---|")
                for row in px["tasks"]:
                    L.append(f"| {row['task']} | {row['n']} | {_num(row['mean_proxy_improvement'], '{:.4f}', True)} | "
                             f"{_num(row['mean_initial_proxy'], '{:.4f}')} | {row['gated']} | "
                             f"{_stops(row.get('stop_reasons'))} | "
                             f"{_num(row.get('proxy_gain_per_minute'), RATE)} | {row.get('answers_changed', 'n/a')} | "
                             f"{_num(row['accuracy_change'], '{:.1f}', True)} |")
                sp = px["spearman"]
                fit = px.get("fit")
                L += [
                    "",
                    f"Spearman over {_plural(sp['n'], 'task')} (one-sided, H1: rho > 0): "
                    f"rho = {_num(sp['rho'], '{:.3f}')}, "
                    f"p = {_p(sp['p'])} (t approximation)"
                    + (f", exact permutation p = {_p(sp['p_exact'])}" if sp.get("p_exact") is not None else "")
                    + "."
                    + (
                        f" Least squares: change = {fit['slope']:.4g} x improvement "
                        f"{'-' if fit['intercept'] < 0 else '+'} {abs(fit['intercept']):.4g}."
                        if fit
                        else ""
                    ),
                    "",
                ]
            if v.get("budget"):
                L += _budget_markdown(v["budget"])
        plots = run.get("plots") or []
        if plots:
            L += ["Figures:", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    if report.get("compared"):
        L += _compared_markdown(report["compared"])
    if report.get("fisher") and len(report["runs"]) > 1:
        L += ["## Across runs: Fisher's combined test of the Spearman p-values", ""]
        L.append("| variant | runs | p-values | chi2 statistic | dof | combined p | combined exact p |")
        L.append("|---|---|---|---|---|---|---|")
        for vn, f in report["fisher"].items():
            ex = f.get("exact")
            L.append(
                f"| {vn} | {', '.join(f['runs']) or '-'} | {', '.join(_p(p) for p in f['pvalues']) or '-'} | "
                f"{_num(f['statistic'], '{:.3f}')} | {2 * f['k']} | {_p(f['p'])} | {_p(ex['p']) if ex else 'n/a'} |"
            )
            if f["excluded"]:
                L.append(f"|  | excluded (Spearman undefined): {', '.join(f['excluded'])} | | | | | |")
        L.append("")
    if report.get("figures"):
        L += (
            ["## Proxy improvement vs accuracy change, per task (every run)", ""]
            + [f"![{Path(p).stem}]({p})" for p in report["figures"]]
            + [""]
        )
    L += ["## Definitions", "",
          "* calibrated = the variant's answers; base = greedy decoding from the original prompt (ICLEval's protocol).",
          "* relative change = 100 (calibrated - base) / base; mean row = unweighted mean over tasks.",
          "* McNemar: p = P(X >= b), X ~ Binomial(b + c, 1/2); the other way P(X >= c). Verdict: helped / hurt "
          f"when that one-sided p < {VERDICT_ALPHA}, no change when b = c = 0, else no significant change.",
          "* stops: the calibrations' stop reasons (gate, patience, max_steps, snr); s / sample = mean seconds of "
          "a sample (calibration and decoding); samples / min = samples over their summed minutes.",
          "* proxy improvement = best_proxy - initial_proxy per sample (0 when gated), averaged per task; "
          "Spearman p from the t approximation with n - 2 degrees of freedom (as scipy.stats.spearmanr), "
          "exact permutation p for up to 8 tasks.",
          "* proxy gain / min = summed proxy improvement over summed minutes (calibration and decoding) of the task's "
          "samples; answers changed = samples whose calibrated answer differs from the base answer.",
          "* budget: proxy gain after k steps = best proxy of the first k steps - initial proxy (a run that stopped "
          "earlier keeps its final gain); s = k steps at the run's mean seconds per step (calibration seconds over "
          "steps; the whole run when it stopped earlier); answers changed = answers decoded from the best X after k "
          "steps (icleval --answer-at) that differ from the base answer, not final = those that differ from the "
          "run's final answer; suggested budget = the first step whose mean gain reaches 90% of the final mean gain.",
          "* Fisher: X = -2 sum ln p over runs, chi-squared with 2k degrees of freedom.", ""]
    return "\n".join(L)


def _budget_markdown(budget: dict) -> list[str]:
    """The budget curves of a variant (sicl_fast.evaluation.budget): by step, by second, the suggestion."""
    L = ["Budget: mean proxy gain and answers changed vs steps (and the seconds they took):", "",
         "| task | step | s | mean proxy gain | answers changed | not final |", "|---|---|---|---|---|---|"]
    for task, c in budget.items():
        for row in c["by_step"]:
            of = f" / {row['n_answers']}" if row["answers_changed"] is not None else ""
            L.append(f"| {task} | {row['step']} | {_num(row['mean_seconds'], RATE)} | "
                     f"{_num(row['mean_gain'], GAIN, True)} | {row['answers_changed'] if of else 'n/a'}{of} | "
                     f"{row['answers_not_final'] if of else 'n/a'}{of} |")
    L += ["", "Mean proxy gain vs seconds of calibration:", "", "| task | s | mean proxy gain |", "|---|---|---|"]
    for task, c in budget.items():
        L += [f"| {task} | {_num(row['seconds'], RATE)} | {_num(row['mean_gain'], GAIN, True)} |"
              for row in c["by_second"]]
    L.append("")
    for task, c in budget.items():
        sg = c["suggested"]
        L.append(f"* {task}: " + (f"{100 * sg['share']:.0f}% of the final mean gain "
                                  f"({_num(c['final_gain'], GAIN, True)}) by step {sg['step']}, about "
                                  f"{_num(sg['mean_seconds'], RATE)} s ({_num(c['mean_seconds_per_step'], RATE)} s / "
                                  "step)" if sg else "no gain"))
    return L + [""]


def _compared_markdown(rows: list[dict]) -> list[str]:
    """Later runs against the first on the same samples (sicl_fast.evaluation.budget.runs_compared)."""
    L = [f"## Runs compared with {rows[0]['reference']} (same samples)", "",
         "| variant | run | task | n | answers differ | accuracy (%) | mean steps | calibration s / sample | stops |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pair = lambda xs, fmt: " -> ".join(_num(x, fmt) for x in xs)  # noqa: E731 - first run -> this run
        L.append(f"| {r['variant']} | {r['run']} | {r['task']} | {r['n']} | {r['answers_differ']} | "
                 f"{' -> '.join(_pct(x) for x in r['accuracy'])} | {pair(r['mean_steps'], '{:.1f}')} | "
                 f"{pair(r['mean_seconds'], RATE)} | {_stops(r['stop_reasons'])} |")
    return L + [""]


# -----------------------------------------------------------------------------------------------------------------
# the summary table another document carries (README, RESULTS), generated from the records


def summary_markdown(report: dict) -> str:
    """One row per run and calibration variant (all its samples pooled): accuracy base vs calibrated, the McNemar
    test both ways and its verdict, the tasks calibration helped / hurt / left alone (by the sign of the change),
    how often the gate fired, mean steps and samples per minute."""
    L = ["| model | variant | samples | tasks | base acc (%) | calibrated acc (%) | change (points) | b / c | "
         "p better | p worse | verdict | tasks helped / hurt / same | gated | mean steps | samples / min |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for v in run["variants"]:
            if v["method"] == "base":
                continue
            tasks, micro, mc = v["table"]["tasks"], v["table"]["micro"], v["mcnemar"]
            signs = [(row["change_points"] > 0) - (row["change_points"] < 0) for row in tasks]
            gated = sum(row["gated"] for row in v["proxy"]["tasks"]) if v.get("proxy") else "n/a"
            L.append(f"| {run['name']} | {v['variant']} | {v['n']} | {len(tasks)} | {_pct(micro['base'])} | "
                     f"{_pct(micro['calibrated'])} | {_num(micro['change_points'], '{:.1f}', True)} | "
                     f"{mc['b']} / {mc['c']} | {_p(mc['p'])} | {_p(mc.get('p_worse'))} | {mc.get('verdict', 'n/a')} | "
                     f"{signs.count(1)} / {signs.count(-1)} / {signs.count(0)} | {gated} | "
                     f"{_num(micro['mean_steps'], '{:.1f}')} | {_num(micro.get('samples_per_minute'), RATE)} |")
    return "\n".join(L)


def summary_markers(name: str) -> tuple[str, str]:
    """The two lines between which write_summary_into puts the summary called `name`."""
    return f"<!-- sicl-report:{name}:begin -->", f"<!-- sicl-report:{name}:end -->"


def check_summary_target(path: str | os.PathLike, name: str) -> tuple[str, int, int]:
    """(text, start of the begin marker, start of the end marker) of the Markdown file `path` (a symbolic link is
    read and written through: its target is the file). Refused (SiclError) when it cannot be read or rewritten:
    missing, a directory or anything else that is not a regular file (said as sicl_fast.formats.inputs.open_input
    says it), not UTF-8, read-only or in a folder where the new text cannot be written; or when it lacks the
    markers, holds them out of order or more than once (only one pair could be filled, and the others would stay
    stale), or holds another summary's markers between its own (the table would delete them)."""
    from ..formats.inputs import STDIN, open_input

    begin, end = summary_markers(name)
    if str(path) == STDIN or (Path(path).exists() and not Path(path).is_dir() and not Path(path).is_file()):
        # standard input, a pipe, a device: a stream open_input would read, but not a file to rewrite in place
        raise SiclError(f"--summary-into {path}: is not a regular file; give the Markdown file that holds the "
                        "markers")
    path = Path(path)
    with open_input(path, "--summary-into") as fh:
        try:
            text = fh.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SiclError(f"--summary-into {path}: not UTF-8 text (byte {exc.start})") from None
    target = Path(os.path.realpath(path))
    mode = stat.S_IMODE(target.stat().st_mode)
    if not mode & 0o222 or not os.access(target, os.W_OK):  # the mode bits too: root may write anything
        raise SiclError(f"--summary-into {path}: is read-only (mode {mode:04o}); make it writable (chmod u+w) or "
                        "give another file")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise SiclError(f"--summary-into {path}: its folder {target.parent} is not writable (the new text is written "
                        "beside the file, then renamed over it)")
    counts = (text.count(begin), text.count(end))
    if counts != (1, 1):
        where = "lacks the markers" if counts == (0, 0) else \
            f"holds the begin marker {counts[0]} time(s) and the end marker {counts[1]} time(s)"
        raise SiclError(f"--summary-into {path}: {where}; it needs this pair exactly once, where the table goes:\n"
                        f"{begin}\n{end}")
    i, j = text.find(begin), text.find(end)
    if j < i:
        raise SiclError(f"--summary-into {path}: its end marker comes before its begin marker; put them in order "
                        f"where the table goes:\n{begin}\n{end}")
    inside = sorted(set(re.findall(r"<!-- sicl-report:(.*?):(?:begin|end) -->", text[i + len(begin):j])))
    if inside:
        raise SiclError(f"--summary-into {path}: holds the markers of {', '.join(map(repr, inside))} between its "
                        f"{name!r} markers, which the table would delete; move them out of the pair")
    return text, i, j


def write_summary_into(path: str | os.PathLike, name: str, report: dict, source: str = "") -> None:
    """Replace what lies between the summary's markers in the Markdown file `path` with summary_markdown(report)
    (and a line naming its source), written atomically (check_summary_target's checks first)."""
    begin, _ = summary_markers(name)
    text, i, j = check_summary_target(path, name)
    lines = [begin, ""] + ([f"Generated by `sicl-fast report` from {source}.", ""] if source else [])
    eol = "\r\n" if text[i:].startswith(begin + "\r\n") else "\n"  # the file's own line ends
    table = eol.join(lines + summary_markdown(report).split("\n") + ["", ""])
    write_text_atomic(path, text[:i] + table + text[j:])


# -----------------------------------------------------------------------------------------------------------------
# writing


def _json_safe(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", s).strip("_") or "x"


def make_plots(report: dict, runs: Sequence[Run], out_dir: Path) -> None:
    """Draw the figures into out_dir/plots and list them (relative paths) in the report."""
    from . import plots

    pdir = out_dir / "plots"
    by_name = {r.name: r for r in runs}
    for run in report["runs"]:
        files = []
        groups = group_variants(by_name[run["name"]].records)
        rs = _slug(run["name"])
        mt = run.get("methods")
        if mt:
            tasks = mt["tasks"]
            cols = {c: [row[c] for row in mt["rows"]] for c in mt["columns"]}
        else:
            v = run["variants"][0]
            tasks = [row["task"] for row in v["table"]["tasks"]]
            cols = {"base": [row["base"] for row in v["table"]["tasks"]],
                    v["variant"]: [row["calibrated"] for row in v["table"]["tasks"]]}
        files.append(
            plots.accuracy_bars(pdir / f"accuracy_{rs}.png", tasks, cols, f"accuracy per task - {run['name']}")
        )
        for v in run["variants"]:
            if v["proxy"] is None:
                continue
            hist: dict[str, list[list[float]]] = {}
            for r in groups[v["variant"]]:
                if r.get("history"):
                    hist.setdefault(r["task"], []).append([float(x) for x in r["history"]])
            hist = {t: hist[t] for t in _task_order(hist)}
            files.append(plots.proxy_histories(pdir / f"history_{rs}_{_slug(v['variant'])}.png", hist,
                                               f"proxy history - {run['name']} - {v['variant']}"))
            if v.get("budget"):
                files.append(plots.budget_curves(pdir / f"budget_{rs}_{_slug(v['variant'])}.png", v["budget"],
                                                 f"budget - {run['name']} - {v['variant']}"))
        run["plots"] = [str(Path(f).relative_to(out_dir)) for f in files]
    figures = []
    for vn in report["fisher"]:
        series = []
        for run in report["runs"]:
            for v in run["variants"]:
                if v["variant"] == vn and v["proxy"] is not None:
                    px = v["proxy"]
                    series.append({"name": run["name"], "tasks": [r["task"] for r in px["tasks"]],
                                   "x": [r["mean_proxy_improvement"] for r in px["tasks"]],
                                   "y": [r["accuracy_change"] for r in px["tasks"]],
                                   "fit": (px["fit"]["slope"], px["fit"]["intercept"]) if px["fit"] else None})
        f = plots.proxy_vs_accuracy(pdir / f"proxy_vs_accuracy_{_slug(vn)}.png", series,
                                    f"proxy improvement vs accuracy change - {vn}")
        figures.append(str(Path(f).relative_to(out_dir)))
    report["figures"] = figures


def write_report(out_dir: str | os.PathLike, runs: Sequence[Run], plots: bool = True) -> dict:
    """Build the report of `runs` and write out_dir/report.md, out_dir/report.json and out_dir/plots/*.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(runs)
    if plots:
        make_plots(report, runs, out_dir)
    safe = _json_safe(report)
    text = json.dumps(safe, indent=2, ensure_ascii=False, allow_nan=False)  # strict JSON, before anything is replaced
    write_text_atomic(out_dir / "report.json", text)
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    return safe


def report_from_files(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, names=None,
                      plots: bool = True) -> dict:
    return write_report(out_dir, load_runs(paths, names), plots=plots)


__all__ = ["Run", "load_runs", "group_variants", "task_table", "mcnemar", "proxy_analysis", "methods_table",
           "variant_report", "build_report", "render_markdown", "write_report", "report_from_files", "make_plots"]
