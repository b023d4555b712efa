"""End to end on the real SmolLM2 and the ICLEval excerpts (tests/data/icleval): records of base and sicl (and an
ablation), resume, and the report's numbers checked against the records and scipy; the CLI glue (icleval flags,
report command)."""
from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

import pytest
from scipy import stats as sps

from conftest import ICLEVAL_EXCERPTS
from sicl_fast.engine import Engine
from sicl_fast.errors import SiclWarning
from sicl_fast.evaluation.cli import add_icleval_eval_args, add_report_command, report_from_args, run_icleval_from_args
from sicl_fast.evaluation.methods import run_methods
from sicl_fast.evaluation.report import Run, write_report
from sicl_fast.icleval import load_dir, score

TASKS = ["classifier_order", "generate_order"]
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::sicl_fast.icleval.ICLEvalDataWarning"),
]  # excerpts: not the release sha256


@pytest.fixture(scope="module")
def engine(smol):
    eng = Engine(smol, add_special_tokens=True)
    calls = []
    orig = eng.calibrate

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    eng.calibrate = counting
    eng.calls = calls
    return eng


@pytest.fixture(scope="module")
def run(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("evalrun")
    out = d / "results.jsonl"
    cfg = engine.config(max_steps=2, N=2)
    first = run_methods(engine, ICLEVAL_EXCERPTS, out, methods=["base", "sicl"], config=cfg, tasks=TASKS, limit=1,
                        progress=False)
    head = out.read_text(encoding="utf-8")
    n_first = len(engine.calls)
    second = run_methods(engine, ICLEVAL_EXCERPTS, out, methods=["base", "sicl"], config=cfg, tasks=TASKS, limit=2,
                         progress=False)
    return {"dir": d, "out": out, "cfg": cfg, "first": first, "second": second, "head": head,
            "calls": (n_first, len(engine.calls))}


def _samples():
    data = load_dir(ICLEVAL_EXCERPTS, TASKS)
    return {s.key: s for name in data for s in data[name][:2]}


def test_records(run):
    samples = _samples()
    recs = run["second"]
    assert len(run["first"]) == 4 and len(recs) == 8
    by = {(r["variant"], r["task"], r["uid"]): r for r in recs}
    assert {v for v, _, _ in by} == {"base", "sicl[N=2]"}  # N differs from the model's preset (8)
    for (variant, task, uid), r in by.items():
        s = samples[(task, uid)]
        assert r["correct_base"] == score(s, r["answer_base"])
        assert r["correct_calibrated"] == score(s, r["answer_calibrated"])
        assert r["model"] == "smollm2-135m" and r["label"] == s.label
        if variant == "base":
            assert r["answer_calibrated"] == r["answer_base"] and r["steps"] == 0 and r["initial_proxy"] is None
        else:
            assert r["config"]["N"] == 2 and r["config"]["max_steps"] == 2
            assert r["answer_base"] == by[("base", task, uid)]["answer_base"]
            assert 1 <= r["steps"] <= 2 and len(r["history"]) == r["steps"]
            assert r["history"][0] == r["initial_proxy"] and r["best_proxy"] == max(r["history"])


def test_resume(run, engine):
    out = run["out"]
    n_first, n_second = run["calls"]
    assert n_first == 2 and n_second - n_first == 2  # the second run calibrated only the two new samples
    assert out.read_text(encoding="utf-8").startswith(run["head"])  # records written before are untouched
    # a crash mid-line: the partial line is moved to results.jsonl.bad, nothing done is redone
    before = out.read_text(encoding="utf-8")
    with out.open("a", encoding="utf-8") as fh:
        fh.write('{"task": "classifier_order", "uid": 1, "varia')
    with pytest.warns(SiclWarning, match="1 unreadable line"):
        again = run_methods(engine, ICLEVAL_EXCERPTS, out, methods=["base", "sicl"], config=run["cfg"], tasks=TASKS,
                            limit=2, progress=False)
    assert len(engine.calls) == n_second and out.read_text(encoding="utf-8") == before
    assert (
        out.with_name(out.name + ".bad").read_text(encoding="utf-8")
        == '{"task": "classifier_order", "uid": 1, "varia\n'
    )
    assert sorted(json.dumps(r, sort_keys=True) for r in again) == sorted(json.dumps(r, sort_keys=True)
                                                                           for r in run["second"])
    with pytest.raises(ValueError, match="other settings"):  # same variant name, other settings
        run_methods(
            engine,
            ICLEVAL_EXCERPTS,
            out,
            methods=["sicl"],
            config=run["cfg"].replace(max_steps=3),
            tasks=TASKS,
            limit=2,
            progress=False,
        )


def test_report_matches_records(run):
    recs = run["second"]
    rep = write_report(run["dir"] / "RUN", [Run("smol", recs, str(run["out"]))])
    strict = json.loads((run["dir"] / "RUN" / "report.json").read_text(),
                        parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert strict == rep
    (r,) = rep["runs"]
    v = {x["variant"]: x for x in r["variants"]}["sicl[N=2]"]
    sicl = [x for x in recs if x["variant"] == "sicl[N=2]"]
    for row in v["table"]["tasks"]:
        rs = [x for x in sicl if x["task"] == row["task"]]
        assert row["n"] == len(rs) == 2
        assert row["base"] == sum(x["correct_base"] for x in rs) / 2
        assert row["calibrated"] == sum(x["correct_calibrated"] for x in rs) / 2
        assert row["mean_steps"] == pytest.approx(sum(x["steps"] for x in rs) / 2)
        assert row["mean_seconds"] == pytest.approx(sum(x["seconds"] for x in rs) / 2)
    b = sum(1 for x in sicl if not x["correct_base"] and x["correct_calibrated"])
    c = sum(1 for x in sicl if x["correct_base"] and not x["correct_calibrated"])
    assert (v["mcnemar"]["b"], v["mcnemar"]["c"]) == (b, c)
    if b + c:
        assert v["mcnemar"]["p"] == pytest.approx(sps.binomtest(b, b + c, 0.5, alternative="greater").pvalue)
    else:
        assert v["mcnemar"]["p"] == 1.0
    px = v["proxy"]
    xs = [sum(x["best_proxy"] - x["initial_proxy"] for x in sicl if x["task"] == t) / 2 for t in TASKS]
    assert [t["mean_proxy_improvement"] for t in px["tasks"]] == pytest.approx(xs)
    ys = [t["accuracy_change"] for t in px["tasks"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on a constant input (no accuracy change on any task)
        ref = sps.spearmanr(xs, ys, alternative="greater")
    _same(px["spearman"]["rho"], ref.statistic)
    _same(px["spearman"]["p"], ref.pvalue)
    for p in r["plots"] + rep["figures"]:
        assert (run["dir"] / "RUN" / p).read_bytes()[:8] == PNG


def _same(mine, ref):
    """Equal, or both undefined (NaN in scipy, null in the report)."""
    if ref is None or math.isnan(ref):
        assert mine is None or math.isnan(mine)
    else:
        assert mine == pytest.approx(ref)


def _parser():
    p = argparse.ArgumentParser(prog="sicl-fast")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("icleval")
    e.add_argument("dir")
    e.add_argument("--tasks", nargs="*", default=None)
    e.add_argument("--limit", type=int, default=None)
    e.add_argument("--out", required=True)
    add_icleval_eval_args(e)
    add_report_command(sub)
    return p


def test_cli_ablation_and_report_command(run, engine, capsys):
    d = run["dir"]
    args = _parser().parse_args(["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1",
                                 "--out", str(run["out"]), "--method", "base", "sicl", "--ablate", "gamma",
                                 "--report", str(d / "RUN2"), "--quiet"])
    n = len(engine.calls)
    assert run_icleval_from_args(engine, run["cfg"], args) == 0
    assert len(engine.calls) == n + 1  # only the new variant ran; the rest came from the file
    rep = json.loads((d / "RUN2" / "report.json").read_text())
    names = [v["variant"] for v in rep["runs"][0]["variants"]]
    assert names == ["base", "sicl[N=2]", "sicl[no-gamma,N=2]"]
    abl = rep["runs"][0]["variants"][2]
    assert abl["config"]["gamma"] == 0.0 and abl["config"]["alpha"] == pytest.approx(0.6 / 0.9)
    assert "sicl[no-gamma,N=2]" in capsys.readouterr().out
    mt = rep["runs"][0]["methods"]  # all methods on the same samples: the one the ablation ran on
    assert mt["same_samples"] and mt["n"] == 1 and [r["task"] for r in mt["rows"]] == ["classifier_order"]

    # `sicl-fast report R1 R2 --report RUN3`: two runs given together, Fisher across them (a copy: the same file
    # twice is refused, its p-values would count twice)
    other = d / "copy.jsonl"
    other.write_bytes(Path(run["out"]).read_bytes())
    args = _parser().parse_args(["report", str(run["out"]), str(other), "--report", str(d / "RUN3"),
                                 "--names", "a", "b"])
    assert report_from_args(args) == 0
    rep = json.loads((d / "RUN3" / "report.json").read_text())
    assert [r["name"] for r in rep["runs"]] == ["a", "b"]
    f = rep["fisher"]["sicl[N=2]"]
    ps = [f_p for f_p in f["pvalues"]]
    if ps:
        ref = sps.combine_pvalues(ps, method="fisher")
        assert f["p"] == pytest.approx(ref.pvalue) and f["statistic"] == pytest.approx(ref.statistic)
    else:  # Spearman undefined on both runs (e.g. no accuracy change on any task): nothing to combine
        assert f["excluded"] == ["a", "b"] and f["p"] is None
    md = (d / "RUN3" / "report.md").read_text()
    assert "## a" in md and "## b" in md and "Fisher" in md
    for p in rep["figures"]:
        assert (d / "RUN3" / p).read_bytes()[:8] == PNG


def test_a_fallback_midway_is_in_the_records_settings(tiny_llama, tmp_path, monkeypatch):
    """A captured step that fails its check switches the run to the torch ops (FastBackend.fall_back): icleval's
    records made from then on say so in their settings, the impl and attention they ran with and the fallback, as
    calibrate's do (before: the plan's impl and no fallback, for numbers the torch ops made)."""
    eng = Engine(tiny_llama, add_special_tokens=True, impl="cpp")
    run = eng.run

    def falls_back(*a, **k):
        if eng.plan.fallback is None:
            eng.backend.fall_back("torch", "the captured static step's first replay f0 is off by 0.05")
        return run(*a, **k)
    monkeypatch.setattr(eng, "run", falls_back)
    out = tmp_path / "r.jsonl"
    with pytest.warns(SiclWarning, match="through the torch ops"):
        run_methods(eng, ICLEVAL_EXCERPTS, out, methods=["base", "sicl"], config=eng.config(max_steps=1, N=2),
                    tasks=["classifier_order"], limit=1, progress=False)
    got = {r["method"]: r["settings"] for r in map(json.loads, out.read_text().splitlines())}
    s = got["sicl"]
    assert (s["command"], s["impl"], s["attention"]) == ("icleval", "torch", "math")
    assert s["fallback"] == "torch: the captured static step's first replay f0 is off by 0.05"
