"""sicl_fast.evaluation without a model: the tests' statistics against scipy, the report's numbers against the
records, the files it writes, ablation variants and the ICLEval classification helpers."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from scipy import stats as sps

from conftest import ICLEVAL_EXCERPTS
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.evaluation import icleval_cls as C
from sicl_fast.evaluation import stats
from sicl_fast.evaluation.ablations import drop_component, make_variants, variant_name
from sicl_fast.evaluation.report import Run, build_report, load_runs, render_markdown, write_report
from sicl_fast.icleval import load_dir, render

FIXTURES = Path(__file__).parent / "fixtures" / "icleval" / "data"
PNG = b"\x89PNG\r\n\x1a\n"


def _strict_json(path: Path):
    def bad(x):
        raise ValueError(f"non-standard JSON constant {x}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=bad)


# ---------------------------------------------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("b,c", [(0, 1), (1, 0), (3, 2), (7, 1), (2, 9), (15, 15), (40, 22)])
def test_mcnemar_matches_binomtest(b, c):
    base = [False] * b + [True] * c + [True] * 5 + [False] * 4
    meth = [True] * b + [False] * c + [True] * 5 + [False] * 4
    res = stats.mcnemar_exact(base, meth)
    assert (res.b, res.c, res.n) == (b, c, b + c)
    assert res.p == pytest.approx(sps.binomtest(b, b + c, 0.5, alternative="greater").pvalue, rel=1e-12, abs=1e-15)


def test_mcnemar_no_discordant_pairs():
    assert stats.mcnemar_exact([True, False], [True, False]).p == 1.0


def test_spearman_matches_scipy():
    rng = random.Random(0)
    cases = [([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [3, 1, 2]), ([0.1, 0.5, 0.2, 0.9], [1, 1, 0, 3])]
    for n in (3, 4, 5, 7, 9, 12):
        x = [rng.random() for _ in range(n)]
        cases.append((x, [v + rng.gauss(0, 0.3) for v in x]))
        cases.append(([rng.randint(0, 3) for _ in range(n)], [rng.randint(0, 3) for _ in range(n)]))  # ties
    for x, y in cases:
        mine = stats.spearman_one_sided(x, y)
        ref = sps.spearmanr(x, y, alternative="greater")
        if math.isnan(ref.statistic):
            assert math.isnan(mine.rho) and math.isnan(mine.p)
            continue
        assert mine.rho == pytest.approx(ref.statistic, abs=1e-12)
        assert mine.p == pytest.approx(ref.pvalue, abs=1e-12)


def test_spearman_exact_p_is_the_permutation_distribution():
    x, y = [0.3, 0.1, 0.7, 0.5], [2.0, 1.0, 5.0, 3.0]
    res = stats.spearman_one_sided(x, y)
    ref = sps.permutation_test((y,), lambda yy: sps.spearmanr(x, yy).statistic, permutation_type="pairings",
                               alternative="greater", n_resamples=math.inf)
    assert res.rho == pytest.approx(1.0)
    assert res.p_exact == pytest.approx(ref.pvalue) == pytest.approx(1 / 24)


def test_spearman_degenerate():
    assert math.isnan(stats.spearman_one_sided([1, 2, 3], [1, 1, 1]).p)
    assert math.isnan(stats.spearman_one_sided([1, 2], [1, 2]).p)


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("ps", [[0.5], [0.01, 0.2], [0.3, 0.8, 0.05], [1.0, 1.0], [0.0, 0.4], [1e-9, 0.5, 0.7, 0.2]])
def test_fisher_matches_scipy(ps):
    mine = stats.fisher_combined(ps)
    ref = sps.combine_pvalues(ps, method="fisher")
    assert mine.statistic == pytest.approx(ref.statistic, rel=1e-12)
    assert mine.p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)


# ---------------------------------------------------------------------------------------------------------------
# report on synthetic records

TASKS = ["classifier_order", "generate_order", "classifier_duplication", "generate_list_number"]  # ICLEval order


def synthetic_records(seed: int, variant: str = "sicl", n: int = 10, method: str = "sicl",
                      model: str | None = None) -> list[dict]:
    rng = random.Random(seed)
    recs = []
    for ti, task in enumerate(TASKS):
        for uid in range(n):
            init = rng.uniform(0.05, 0.5)
            gated = rng.random() < 0.15
            best = init if gated else init + rng.uniform(0, 0.05 * (ti + 1))
            steps = 1 if gated else rng.randint(2, 9)
            hist = (
                [init] + [init + (best - init) * (k + 1) / (steps - 1) for k in range(steps - 1)]
                if steps > 1
                else [init]
            )
            base_ok = rng.random() < 0.4
            cal_ok = base_ok if rng.random() < 0.6 else rng.random() < 0.3 + 0.12 * ti
            recs.append({"task": task, "uid": uid, "label": "x", "answer_base": "a", "answer_calibrated": "b",
                         "correct_base": base_ok, "correct_calibrated": cal_ok,
                         "initial_proxy": None if method != "sicl" else init,
                         "best_proxy": None if method != "sicl" else best, "steps": steps if method == "sicl" else 0,
                         "gated": gated, "seconds": rng.uniform(0.1, 3.0), "history": hist if method == "sicl" else [],
                         "method": method, "variant": variant, "model": model or f"model-{seed}"})
    return recs


def _write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def test_report_numbers_match_the_records(tmp_path):
    recs = synthetic_records(1) + synthetic_records(11, variant="sicl[no-alpha]", model="model-1")
    run = Run(name="m1", records=recs, source="r1.jsonl")
    rep = write_report(tmp_path / "RUN", [run])
    assert (tmp_path / "RUN" / "report.md").read_text().startswith("# sicl_fast evaluation report")
    assert _strict_json(tmp_path / "RUN" / "report.json") == rep
    (r1,) = rep["runs"]
    assert [v["variant"] for v in r1["variants"]] == ["sicl", "sicl[no-alpha]"]
    for v in r1["variants"]:
        rs = [r for r in recs if r["variant"] == v["variant"]]
        rows = {row["task"]: row for row in v["table"]["tasks"]}
        assert list(rows) == TASKS  # ICLEval file order
        for t in TASKS:
            tr = [r for r in rs if r["task"] == t]
            base = sum(r["correct_base"] for r in tr) / len(tr)
            cal = sum(r["correct_calibrated"] for r in tr) / len(tr)
            assert rows[t]["n"] == len(tr)
            assert rows[t]["base"] == pytest.approx(base) and rows[t]["calibrated"] == pytest.approx(cal)
            assert rows[t]["relative_change"] == (pytest.approx(100 * (cal - base) / base) if base else None)
            assert rows[t]["mean_steps"] == pytest.approx(sum(r["steps"] for r in tr) / len(tr))
            assert rows[t]["mean_seconds"] == pytest.approx(sum(r["seconds"] for r in tr) / len(tr))
        mean = v["table"]["mean"]
        assert mean["base"] == pytest.approx(sum(rows[t]["base"] for t in TASKS) / len(TASKS))
        assert mean["calibrated"] == pytest.approx(sum(rows[t]["calibrated"] for t in TASKS) / len(TASKS))
        assert mean["n"] == len(rs)
        b = sum(1 for r in rs if not r["correct_base"] and r["correct_calibrated"])
        c = sum(1 for r in rs if r["correct_base"] and not r["correct_calibrated"])
        mc = v["mcnemar"]
        assert (mc["b"], mc["c"], mc["n"]) == (b, c, b + c)
        assert mc["p"] == pytest.approx(sps.binomtest(b, b + c, 0.5, alternative="greater").pvalue)
        px = v["proxy"]
        xs = [sum(r["best_proxy"] - r["initial_proxy"] for r in rs if r["task"] == t) / 10 for t in TASKS]
        ys = [rows[t]["change_points"] for t in TASKS]
        assert len(set(ys)) > 1 and len(set(xs)) > 1  # a defined correlation
        assert [row["mean_proxy_improvement"] for row in px["tasks"]] == pytest.approx(xs)
        assert [row["accuracy_change"] for row in px["tasks"]] == pytest.approx(ys)
        ref = sps.spearmanr(xs, ys, alternative="greater")
        assert px["spearman"]["rho"] == pytest.approx(ref.statistic)
        assert px["spearman"]["p"] == pytest.approx(ref.pvalue)
        slope, intercept = __import__("numpy").polyfit(xs, ys, 1)
        assert px["fit"]["slope"] == pytest.approx(slope) and px["fit"]["intercept"] == pytest.approx(intercept)
    # the methods table compares both variants with the shared base
    mt = r1["methods"]
    assert mt["columns"] == ["base", "sicl", "sicl[no-alpha]"]
    md = (tmp_path / "RUN" / "report.md").read_text()
    assert "McNemar" in md and "Spearman" in md and "| mean |" in md
    for p in r1["plots"] + rep["figures"]:
        assert (tmp_path / "RUN" / p).read_bytes()[:8] == PNG
        assert p in md
    # accuracy + per variant a history and a budget figure; 1 scatter per variant
    assert len(r1["plots"]) == 5 and len(rep["figures"]) == 2


def test_stops_rates_and_verdicts_match_the_records(tmp_path):
    recs = synthetic_records(5)
    reasons = ["patience", "max_steps", "gate"]
    for i, r in enumerate(recs):
        r["stop_reason"] = reasons[i % 3]
    (v,) = write_report(tmp_path / "RUN", [Run(name="m", records=recs, source="r.jsonl")], plots=False)["runs"][0][
        "variants"]
    for row, prow in zip(v["table"]["tasks"], v["proxy"]["tasks"]):
        rs = [r for r in recs if r["task"] == row["task"]]
        assert row["samples_per_minute"] == pytest.approx(60 * len(rs) / sum(r["seconds"] for r in rs))
        assert prow["stop_reasons"] == {k: sum(r["stop_reason"] == k for r in rs) for k in reasons}
    assert v["table"]["micro"]["samples_per_minute"] == pytest.approx(60 * len(recs) / sum(r["seconds"] for r in recs))
    md = (tmp_path / "RUN" / "report.md").read_text()
    assert "samples / min" in md and "s / sample" in md and "Verdict: **" in md
    b, c = v["mcnemar"]["b"], v["mcnemar"]["c"]
    assert v["mcnemar"]["p_worse"] == pytest.approx(sps.binomtest(c, b + c, 0.5, alternative="greater").pvalue)


def test_slow_rates_do_not_round_to_zero_and_history_steps_are_whole(tmp_path, monkeypatch):
    """Ten minutes a sample and a proxy gain of 1e-4: the table prints 600 s / sample, 0.1 samples / min and a gain
    of 1e-05 / min (three significant digits, never 0.00). Histories of one and two steps: the history figure's
    step ticks are whole numbers and the one-step history is drawn (a marker; a line of one point is invisible)."""
    pytest.importorskip("matplotlib")
    from sicl_fast.evaluation import plots

    recs = synthetic_records(4, n=4)
    for r in recs:
        r.update(seconds=600.0, gated=False, best_proxy=r["initial_proxy"] + 1e-4, steps=2,
                 history=[r["initial_proxy"], r["initial_proxy"] + 1e-4])
    recs[0].update(steps=1, history=[recs[0]["initial_proxy"]], best_proxy=recs[0]["initial_proxy"])
    figs = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or save(fig, path))
    write_report(tmp_path / "RUN", [Run(name="m", records=recs, source="r.jsonl")])
    md = (tmp_path / "RUN" / "report.md").read_text()
    assert f"| {TASKS[1]} | 4 | " in md and "| 600 | 0.1 |" in md.split(f"| {TASKS[1]} | 4 | ")[1].splitlines()[0]
    assert "| 1e-05 |" in md
    (ax,) = next(f for f in figs if f.axes[0].get_title().startswith("proxy history")).axes
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert any(len(line.get_xdata()) == 1 and line.get_marker() not in (None, "None", "") for line in ax.get_lines())


@pytest.mark.parametrize("b,c,want", [(8, 0, "helped"), (0, 8, "hurt"), (3, 2, "no significant change"),
                                      (0, 0, "no change")])
def test_verdict(b, c, want):
    base = [False] * b + [True] * c + [True, False]
    cal = [True] * b + [False] * c + [True, False]
    recs = [{"correct_base": x, "correct_calibrated": y} for x, y in zip(base, cal)]
    from sicl_fast.evaluation.report import mcnemar

    assert mcnemar(recs)["verdict"] == want


def test_report_summary_into_a_markdown_file(tmp_path, capsys):
    from sicl_fast.commands.cli import main

    res = [_write_jsonl(tmp_path / f"r{i}.jsonl", synthetic_records(i) + synthetic_records(i, variant="base",
                                                                                            method="base"))
           for i in (6, 7)]
    readme = tmp_path / "README.md"
    plain = "# title\n\ntext\n"
    readme.write_text(plain)
    assert main(["report", *map(str, res), "--report", str(tmp_path / "RUN"), "--no-plots",
                 "--summary-into", str(readme), "--summary-name", "gpu"]) == 2
    assert "<!-- sicl-report:gpu:begin -->" in capsys.readouterr().err
    assert readme.read_text() == plain and not (tmp_path / "RUN").exists()  # refused before writing anything
    readme.write_text("# title\n\n<!-- sicl-report:gpu:begin -->\nold table\n<!-- sicl-report:gpu:end -->\nafter\n")
    for _ in range(2):  # a second run replaces the table, it does not add one
        assert main(["report", *map(str, res), "--report", str(tmp_path / "RUN"), "--no-plots",
                     "--summary-into", str(readme), "--summary-name", "gpu"]) == 0
    text = readme.read_text()
    assert "old table" not in text and text.endswith("<!-- sicl-report:gpu:end -->\nafter\n")
    rep = _strict_json(tmp_path / "RUN" / "report.json")
    rows = [line for line in text.splitlines() if line.startswith("| model-")]
    assert len(rows) == 2 and text.count("| model |") == 1  # one row per run's calibration variant, no base row
    for line, run in zip(rows, rep["runs"]):
        (v,) = [v for v in run["variants"] if v["method"] != "base"]
        cells = [c.strip() for c in line.strip("|").split("|")]
        micro, mc = v["table"]["micro"], v["mcnemar"]
        assert cells[:4] == [run["name"], "sicl", str(v["n"]), "4"]
        assert float(cells[4]) == pytest.approx(100 * micro["base"], abs=0.05)
        assert float(cells[5]) == pytest.approx(100 * micro["calibrated"], abs=0.05)
        assert cells[7] == f"{mc['b']} / {mc['c']}" and cells[10] == mc["verdict"]
        assert cells[12] == str(sum(row["gated"] for row in v["proxy"]["tasks"]))


def test_fisher_across_runs_from_files(tmp_path):
    paths = [_write_jsonl(tmp_path / f"r{i}.jsonl", synthetic_records(i)) for i in (2, 3, 4)]
    runs = load_runs(paths)
    assert [r.name for r in runs] == ["model-2", "model-3", "model-4"]
    rep = write_report(tmp_path / "RUN", runs)
    ps = [r["variants"][0]["proxy"]["spearman"]["p"] for r in rep["runs"]]
    f = rep["fisher"]["sicl"]
    assert f["pvalues"] == ps and f["k"] == 3
    ref = sps.combine_pvalues(ps, method="fisher")
    assert f["statistic"] == pytest.approx(ref.statistic) and f["p"] == pytest.approx(ref.pvalue)
    assert (tmp_path / "RUN" / "plots" / "proxy_vs_accuracy_sicl.png").read_bytes()[:8] == PNG


def test_report_with_baselines_and_nan(tmp_path):
    """Baseline variants (no proxies) and a degenerate Spearman: strict JSON with null, 'n/a' in the Markdown."""
    recs = synthetic_records(5, variant="cc", method="cc") + synthetic_records(5, variant="base", method="base")
    for r in recs:
        if r["method"] == "cc":
            r["correct_scored_base"] = r["uid"] % 2 == 0
        if r["method"] == "base":
            r["correct_calibrated"] = r["correct_base"]
    flat = synthetic_records(6)
    for r in flat:
        r["best_proxy"] = r["initial_proxy"]  # no improvement anywhere: Spearman undefined
    rep = write_report(tmp_path / "RUN", [Run("a", recs, "a.jsonl"), Run("b", flat, "b.jsonl")])
    _strict_json(tmp_path / "RUN" / "report.json")
    va = {v["variant"]: v for v in rep["runs"][0]["variants"]}
    assert list(va) == ["base", "cc"] and va["cc"]["proxy"] is None
    assert va["base"]["mcnemar"] == {"b": 0, "c": 0, "n": 0, "p": 1.0, "p_worse": 1.0, "samples": len(recs) // 2,
                                     "verdict": "no change"}
    mt = rep["runs"][0]["methods"]
    assert mt["columns"] == ["base", "base (label scoring)", "cc"] and mt["same_samples"] and mt["n"] == 40
    row = mt["rows"][0]
    cc0 = [r for r in recs if r["method"] == "cc" and r["task"] == row["task"]]
    assert row["cc"] == pytest.approx(sum(r["correct_calibrated"] for r in cc0) / len(cc0))
    assert row["base (label scoring)"] == pytest.approx(sum(r["correct_scored_base"] for r in cc0) / len(cc0))
    assert rep["fisher"]["sicl"]["excluded"] == ["b"] and rep["fisher"]["sicl"]["p"] is None
    assert "n/a" in (tmp_path / "RUN" / "report.md").read_text()


def test_report_reads_plain_run_icleval_records(tmp_path):
    """Records of earlier single-method runs (no method / variant / model fields) are the 'sicl' variant."""
    keep = ("task", "uid", "label", "answer_base", "answer_calibrated", "correct_base", "correct_calibrated",
            "initial_proxy", "best_proxy", "steps", "gated", "seconds", "history")
    recs = [{k: r[k] for k in keep} for r in synthetic_records(8)]
    (run,) = load_runs([_write_jsonl(tmp_path / "plain.jsonl", recs)])
    assert run.name == "plain"
    rep = write_report(tmp_path / "RUN", [run])
    (v,) = rep["runs"][0]["variants"]
    assert v["variant"] == "sicl" and v["proxy"] is not None and v["mcnemar"]["samples"] == len(recs)


@pytest.mark.parametrize("field,value,needle", [
    # issue 54 item 4: hand-edited records were internal errors (TypeError, AttributeError), or read wrong: "false"
    # counted as a correct answer
    ("correct_base", "false", "field 'correct_base' must be true or false, got \"false\""),
    ("task", ["a"], "record 0: field 'task' must be a string"),
    ("uid", {"a": 1}, "record 0: field 'uid' must be an integer"),
    ("steps", "3", "(classifier_order:0): field 'steps' must be an integer"),
    ("initial_proxy", "0.1", "field 'initial_proxy' must be a number"),
    ("history", ["a", "b"], "field 'history' must be a list of numbers"),
    ("variant", 5, "field 'variant' must be a string"),
    ("config", "x", "field 'config' must be an object"),
    ("answers_at", {"x": "a"}, "field 'answers_at': 'x' is not a step count"),
])
def test_report_refuses_a_field_of_the_wrong_type_in_one_line(tmp_path, capsys, field, value, needle):
    from sicl_fast.commands.cli import main

    recs = synthetic_records(4, n=2)
    recs[0][field] = value
    path = _write_jsonl(tmp_path / "r.jsonl", recs)
    assert main(["report", str(path), "--report", str(tmp_path / "RUN"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error: " in err and needle in err, err


def test_a_resume_moves_a_record_of_the_wrong_types_aside(tmp_path):
    # issue 54 item 4: a hand-edited answers_at was an internal error (int('x')) on every later resume
    from sicl_fast.evaluation.methods import record_key
    from sicl_fast.formats.records import ResultWriter

    recs = synthetic_records(5, n=2)
    recs[1]["answers_at"] = {"x": "a"}
    path = _write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.warns(UserWarning, match="1 unreadable line"), ResultWriter(path, key=record_key) as out:
        assert out.resumed == len(recs) - 1 and record_key(recs[1] | {"answers_at": {}}) not in out


def test_a_settings_model_that_is_no_object_is_shown_as_it_is(tmp_path):
    recs = synthetic_records(6, n=2)
    for r in recs:
        r["settings"] = {"command": "icleval", "model": "by-hand", "dtype": "float32"}
    (run,) = load_runs([_write_jsonl(tmp_path / "r.jsonl", recs)])
    assert "model by-hand (None), float32" in render_markdown(build_report([run]))


def test_report_refuses_one_file_twice_and_an_empty_name(tmp_path, capsys):
    # issue 54 item 4: the same file given twice (or through a link) was two runs, its p-values counted twice by
    # Fisher's method; an empty --names was a run without a name
    from sicl_fast.commands.cli import main

    path = _write_jsonl(tmp_path / "r.jsonl", synthetic_records(2, n=2))
    (tmp_path / "link.jsonl").symlink_to(path)
    for argv, needle in (([str(path), str(tmp_path / "link.jsonl")], "link.jsonl: is " + str(path) + " again"),
                         ([str(path), str(tmp_path / "." / "r.jsonl")], "r.jsonl again"),
                         ([str(path), "--names", " "], "--names: an empty name")):
        assert main(["report", *argv, "--report", str(tmp_path / "RUN"), "--no-plots"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err
    assert not (tmp_path / "RUN").exists()


def test_report_refuses_duplicates(tmp_path):
    recs = synthetic_records(7)
    with pytest.raises(ValueError, match="duplicate"):
        build_report([Run("x", recs + recs[:1])])


def test_report_refuses_one_variant_run_with_other_settings(tmp_path, capsys):
    """#40: records of `sicl` run with --max-steps 2 (uids 0-2) and --max-steps 3 --seed 5 (uids 3-4) were pooled
    into one run, exit 0; icleval refuses the same mix on resume, and so does the report, naming each setting."""
    from sicl_fast.commands.cli import main

    recs = synthetic_records(3, n=5)
    for r in recs:
        r["config"] = {"N": 2, "max_steps": 2} if r["uid"] < 3 else {"N": 2, "max_steps": 3, "seed": 5}
    path = _write_jsonl(tmp_path / "mixed.jsonl", recs)
    assert main(["report", str(path), "--report", str(tmp_path / "RUN"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "variant 'sicl' holds records run with other settings" in err
    assert "max_steps 2 / 3" in err and "seed 0 / 5" in err and "own results file" in err
    assert not (tmp_path / "RUN" / "report.md").exists()
    for r in recs:  # one setting, the time budget, a failed sample's record (no budget, no answers): one run
        r["config"] = {"N": 2, "max_steps": 2}
        r["time_budget_s"] = 1.5
    build_report([Run("ok", recs + [{**recs[0], "uid": 99, "error": "lost"}])])
    recs[-1]["time_budget_s"] = 3.0
    with pytest.raises(ValueError, match=r"--time-budget 1.5 / 3.0"):
        build_report([Run("budgets", recs)])


def test_summary_into_a_folder_a_missing_file_or_markers_twice_is_one_line(tmp_path, capsys):
    """#40: `--summary-into DIR` said "no file DIR"; a file holding the markers twice had its first pair filled
    and the second left stale, exit 0; --summary-name without --summary-into was ignored."""
    from sicl_fast.commands.cli import main

    res = _write_jsonl(tmp_path / "r.jsonl", synthetic_records(6))
    begin, end = "<!-- sicl-report:s:begin -->", "<!-- sicl-report:s:end -->"
    twice = tmp_path / "twice.md"
    twice.write_text(f"{begin}\nold\n{end}\ntext\n{begin}\nold\n{end}\n")
    cases = [(tmp_path, "is a directory, not a file"), (tmp_path / "none.md", "--summary-into not found"),
             (twice, "holds the begin marker 2 time(s) and the end marker 2 time(s)")]
    for target, needle in cases:
        assert main(["report", str(res), "--report", str(tmp_path / "RUN"), "--no-plots", "--summary-into",
                     str(target), "--summary-name", "s"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err.split("\n<!--")[0], err  # the markers to copy on lines of their own
    assert twice.read_text().count("old") == 2 and not (tmp_path / "RUN").exists()  # refused before writing
    assert main(["report", str(res), "--report", str(tmp_path / "RUN"), "--summary-name", "s"]) == 2
    assert "--summary-name s has no effect without --summary-into" in capsys.readouterr().err
    for bad in ("a -->", "a\nb"):  # issue 48's probe: taken, and "-->" ended the marker's comment early
        assert main(["report", str(res), "--report", str(tmp_path / "RUN"), "--summary-into", str(twice),
                     "--summary-name", bad]) == 2
        assert f"--summary-name {bad!r}: use letters, digits" in capsys.readouterr().err


def test_summary_into_a_link_a_read_only_file_or_foreign_markers(tmp_path, capsys):
    """Issue 48: a read-only file was an internal error after the report was written (as root: replaced, its mode
    lost); a symbolic link was replaced by a regular file and its target left stale; another summary's markers
    between the pair were deleted without a word."""
    import os

    from sicl_fast.commands.cli import main

    res = _write_jsonl(tmp_path / "r.jsonl", synthetic_records(6))
    begin, end = "<!-- sicl-report:s:begin -->", "<!-- sicl-report:s:end -->"
    target = tmp_path / "doc.md"
    target.write_text(f"{begin}\nold\n{end}\n")
    (tmp_path / "link.md").symlink_to(target)
    nested = tmp_path / "nested.md"
    nested.write_text(f"{begin}\n<!-- sicl-report:other:begin -->\nkeep\n<!-- sicl-report:other:end -->\n{end}\n")
    target.chmod(0o444)

    def report(into) -> int:
        return main(["report", str(res), "--report", str(tmp_path / "RUN"), "--no-plots", "--summary-into",
                     str(into), "--summary-name", "s"])

    for into, needle in ((target, "is read-only (mode 0444); make it writable"),
                         (nested, "holds the markers of 'other' between its 's' markers, which the table would "
                                  "delete; move them out of the pair")):
        assert report(into) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "RUN").exists() and "keep" in nested.read_text()  # refused before any work
    target.chmod(0o640)
    assert report(tmp_path / "link.md") == 0
    assert (tmp_path / "link.md").is_symlink() and "| model |" in target.read_text()  # written through the link
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o640)  # its mode kept
    # found by the probe: a hard link's other name kept the old text; CRLF files got "\n" lines in the table
    os.link(target, tmp_path / "other_name.md")
    target.write_bytes(f"{begin}\r\nold\r\n{end}\r\n".encode())
    assert report(target) == 0
    text = (tmp_path / "other_name.md").read_bytes()
    assert b"| model |" in text and text.count(b"\n") == text.count(b"\r\n")


# ---------------------------------------------------------------------------------------------------------------
# ablation variants


def test_ablation_variants():
    preset = CalibrationConfig(N=8)
    cfg = preset.replace(max_steps=3)
    c = drop_component(cfg, "alpha")
    assert (c.alpha, c.beta, c.gamma) == pytest.approx((0.0, 0.75, 0.25))
    c = drop_component(cfg, "gamma")
    assert (c.alpha, c.beta, c.gamma) == pytest.approx((0.6 / 0.9, 0.3 / 0.9, 0.0))
    vs = make_variants(cfg, preset, ablate=["beta", "perturb-query"], sweep_N=[4, 8], sweep_mu=[0.008])
    assert [v.name for v in vs] == ["sicl", "sicl[no-beta]", "sicl[perturb-query]", "sicl[N=4]", "sicl[mu=0.008]"]
    assert vs[2].config.perturb_query and vs[3].config.N == 4 and vs[4].config.mu == 0.008
    assert all(v.config.max_steps == 3 for v in vs)
    assert [v.name for v in make_variants(cfg, preset, sweep_N=[2], reference=False)] == ["sicl[N=2]"]
    assert variant_name(cfg.replace(perturb_query=True), preset) == "sicl[perturb-query]"


# ---------------------------------------------------------------------------------------------------------------
# ICLEval classification helpers


def _cls_samples():
    data = load_dir(FIXTURES, ["classifier_duplication", "classifier_format"], check_sha256=False)
    data.update(load_dir(ICLEVAL_EXCERPTS, ["classifier_order"], check_sha256=False))
    return data


def test_content_free_queries_and_contexts():
    data = _cls_samples()
    for _name, samples in data.items():
        for s in samples[:3]:
            assert C.label_text(s) in C.labels_for(s)
            for cf in C.CONTENT_FREE_INPUTS:
                q = C.content_free_query(s, cf)
                p = render(C.with_query(s, q)).prompt  # still a valid ICLEval prompt (spans, ending)
                assert p.startswith(C.examples_text(s)) and p.endswith(s.prompt[s.prompt.rfind("\nOutput:"):])
            ctx = C.scoring_context(s)
            assert not ctx.endswith(" ") and ctx.endswith("Output:")
    s = data["classifier_duplication"][0]
    assert C.content_free_query(s, "N/A") == "Input: N/A\nOutput:"
    assert C.content_free_query(s, "") == "Input: \nOutput:"
    f = data["classifier_format"][0]
    assert C.content_free_query(f, "[MASK]") == "Input: [MASK]\nOutput: "
    if "classifier_order" in data:
        o = data["classifier_order"][0]
        assert C.content_free_query(o, "N/A") == "Input: \nString1: N/A\nString2: N/A\nOutput:"
    assert C.dcpmi_premise(s, "delimiter") == "Output:"
    assert C.dcpmi_premise(s, "demos") == s.raw["examples"] + "Output:"


def test_demo_blocks_and_reordering():
    data = _cls_samples()
    for samples in data.values():
        s = samples[0]
        blocks = C.demo_blocks(s)
        assert len(blocks) == s.spec.demos and "".join(blocks) == s.raw["examples"]
        order = list(range(len(blocks)))[::-1]
        r = C.reordered(s, order)
        rr = render(r)
        assert r.raw["examples"] == "".join(blocks[::-1])
        assert sorted(rr.span_texts()) == sorted(render(s).span_texts())  # same demonstrations, new order
    with pytest.raises(ValueError):
        C.reordered(s, [0, 0, 1])


# ---------------------------------------------------------------------------------------------------------------
# issue 31: the budget curves and runs compared


def budget_record(uid, history, seconds, answers_at=None, base="a", final="b", task="classifier_order", **kw):
    rec = {"task": task, "uid": uid, "variant": "sicl", "method": "sicl", "correct_base": False,
           "correct_calibrated": final == "b", "answer_base": base, "answer_calibrated": final,
           "initial_proxy": history[0], "best_proxy": max(history), "steps": len(history), "gated": False,
           "history": history, "calibration_seconds": seconds, "seconds": seconds + 1.0, "stop_reason": "max_steps"}
    if answers_at is not None:
        rec["answers_at"] = answers_at
    return {**rec, **kw}


def test_budget_curves_by_hand():
    from sicl_fast.evaluation.budget import budget_curves, runs_compared

    # run 0: 4 steps in 2 s, gains 0, 0.1, 0.1, 0.4; run 1: stopped after 2 steps in 4 s, gains 0, 0.2
    recs = [budget_record(0, [0.5, 0.6, 0.55, 0.9], 2.0, {"1": "a", "2": "b"}),
            budget_record(1, [0.3, 0.5], 4.0, {"1": "a"}, final="c")]
    (curve,) = budget_curves(recs).values()
    rows = {r["step"]: r for r in curve["by_step"]}
    assert list(rows) == [1, 2, 4]
    assert rows[1]["mean_gain"] == 0 and rows[2]["mean_gain"] == pytest.approx((0.1 + 0.2) / 2)
    assert rows[4]["mean_gain"] == pytest.approx((0.4 + 0.2) / 2)
    assert rows[2]["mean_seconds"] == pytest.approx((1.0 + 4.0) / 2) and rows[4]["mean_seconds"] == 3.0
    # after 1 step both answers are the base's; after 2, run 0 has "b" (its final), run 1 ended: its final "c"
    assert (rows[1]["answers_changed"], rows[1]["answers_not_final"], rows[1]["n_answers"]) == (0, 2, 2)
    assert (rows[2]["answers_changed"], rows[2]["answers_not_final"]) == (2, 0)
    by_second = {round(r["seconds"], 6): r["mean_gain"] for r in curve["by_second"]}
    # at 2 s: run 0 ran 4 steps (0.5 s each), run 1 one step (2 s each): (0.4 + 0) / 2
    assert by_second[2] == pytest.approx(0.2) and by_second[4.0] == pytest.approx(0.3)
    # 90% of the final mean gain 0.3 is 0.27: first reached at step 4
    assert curve["suggested"] == {"share": 0.9, "step": 4, "mean_seconds": 3.0}
    assert budget_curves([{**recs[0], "history": []}]) is None  # base / baseline records carry no history
    other = [budget_record(0, [0.5, 0.6], 1.0, final="b", stop_reason="time_budget"),
             budget_record(1, [0.3, 0.5], 4.0, final="b")]
    (row,) = runs_compared([("paper", recs), ("budget", other)])
    assert (row["run"], row["reference"], row["n"], row["answers_differ"]) == ("budget", "paper", 2, 1)
    assert row["mean_steps"] == [3.0, 2.0] and row["mean_seconds"] == [3.0, 2.5]
    assert row["accuracy"] == [0.5, 1.0] and row["stop_reasons"] == {"max_steps": 1, "time_budget": 1}
    assert runs_compared([("paper", recs)]) is None


def test_each_run_of_a_split_file_has_a_label_of_its_own():
    """A file split into runs labels each by what sets it apart, never two alike: a string that reads as a number
    is quoted (pack "1" beside pack 1; before: "pack=1; pack=1", the second run "#2"), and where more than 3 names
    differ, as many are shown as tell the runs apart, the ones that tell most apart first (before: the first 3 by
    name, and two runs that differed only in a fourth read the same, "+1 more")."""
    from sicl_fast.evaluation.report import split_by_settings

    base = {"format": 1, "command": "icleval", "impl": "cpp", "attention": "cpp", "dtype": "float32", "pack": 1}
    rec = {"task": "t", "correct_base": True, "correct_calibrated": True}

    def labels(*settings):
        return [label for _, label, _ in split_by_settings([{**rec, "uid": i, "settings": {**base, **s}}
                                                            for i, s in enumerate(settings)])]
    assert labels({}, {"pack": "1"}) == ["pack=1", 'pack="1"']
    other = {"impl": "x", "attention": "y", "dtype": "z"}
    got = labels({}, other, {**other, "pack": 2})
    assert len(set(got)) == 3, got
    assert "pack=1" in got[1] and "pack=2" in got[2] and "more" not in got[1] + got[2], got


def test_runs_are_split_by_the_one_rule_and_empty_settings_are_none(tmp_path):
    """Issue 54, lesser points: two runs whose settings differ only by true and 1 are told apart by what differs
    ("checkpoint=true", "checkpoint=1"; 481e2be: "settings recorded; settings recorded", as the grouping and the
    rule disagreed), 1 and 1.0 are one run (the rule finds them equal, and so does a resume), and a record whose
    settings are {} has settings unknown: a resume says it was written without its settings (481e2be: "holds
    records of sicl-fast None")."""
    from sicl_fast.errors import SiclError
    from sicl_fast.evaluation.report import split_by_settings
    from sicl_fast.run.settings import check_resume, settings_diff

    base = {"format": 1, "command": "icleval", "config": {"checkpoint": False, "mu": 1.0}}
    rec = {"task": "t", "uid": 0, "correct_base": True, "correct_calibrated": True}

    def with_config(uid, **config):
        return {**rec, "uid": uid, "settings": {**base, "config": {**base["config"], **config}}}

    records = [with_config(0, checkpoint=True), with_config(1, checkpoint=1), with_config(2, checkpoint=True)]
    parts = split_by_settings(records)
    assert [(label, len(recs)) for _, label, recs in parts] == [("checkpoint=true", 2), ("checkpoint=1", 1)]
    assert settings_diff(records[0]["settings"], records[1]["settings"]) == ["config.checkpoint"]
    parts = split_by_settings([with_config(0, mu=1), with_config(1, mu=1.0)])
    assert [len(recs) for _, _, recs in parts] == [2]
    empty = {**rec, "settings": {}}
    assert [label for _, label, _ in split_by_settings([empty])] == ["settings unknown"]
    with pytest.raises(SiclError, match=r"holds 1 record\(s\) written without their settings"):
        check_resume([empty], base, "--out o.jsonl")
