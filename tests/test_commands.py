"""Every CLI command end to end, with a requests file where it takes one, on a tiny random-weight model folder
(`--model DIR`, tests/tiny_gguf.py): the commands' plumbing in seconds. The real model runs them in test_cli.py,
test_profile.py, test_gradstudy.py and test_serve.py; `cache` is tested in test_model_cache.py."""
from __future__ import annotations

import json

import pytest

from conftest import ICLEVAL_EXCERPTS
from sicl_fast.commands.cli import COMMANDS, build_parser, main

REQS = [{"id": "a", "demos": [{"input": "hello", "output": "world"}, {"input": "he", "output": "wor"}],
         "query": "hello"},
        {"id": "b", "prompt": "Colours.\ngrass: green\nsky: blue\nsnow:", "output_spans": [[16, 21], [27, 31]],
         "demos_start": 9}]
# where each command runs end to end (a new command without a test fails test_every_command_is_run)
TESTED = {
    "demo": "here",
    "proxy": "here",
    "calibrate": "here",
    "icleval": "here",
    "report": "here",
    "bench": "here",
    "profile": "here",
    "gradstudy": "here",
    "serve": "test_serve.py::test_cli_serve_end_to_end",
    "cache": "test_model_cache.py::test_cache_command",
    "plan": "test_cli.py::test_plan_and_bench_read_the_run_plan",
}


@pytest.fixture
def reqs(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQS))
    return str(path)


def test_every_command_is_run():
    assert set(COMMANDS) == set(TESTED)


def test_proxy_and_calibrate(tiny_model_dir, reqs, tmp_path, capsys):
    model = ["--model", str(tiny_model_dir)]
    assert main(["proxy", reqs, *model]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in lines] == ["a", "b"] and all(0 < r["proxy"] < 1 for r in lines)
    out = tmp_path / "out.jsonl"
    argv = ["calibrate", reqs, "--out", str(out), *model, "--max-steps", "3", "--tau", "0", "--N", "2",
            "--generate", "--max-new-tokens", "2", "--stop", "x"]
    assert main(argv) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b"] and all(r["steps"] == 3 and "answer_calibrated" in r for r in recs)
    assert main(argv) == 0 and "nothing to do: all 2 requests are already in" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["plan", "--mu", "0.5"], ["plan", "--max-steps", "7"], ["plan", "--seed", "3"], ["plan", "--perturb-query"],
    ["plan", "--store", "DIR"], ["plan", "--store-mib", "5"], ["plan", "--alpha", "1"],
    ["proxy", "r.jsonl", "--diff-matmul", "off"],  # the proxy runs one row: no difference products
])
def test_a_command_refuses_the_flags_it_does_not_use(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    flag = [a for a in argv if a.startswith("--")][0]
    assert f"sicl-fast {argv[0]}: error: unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, who", [
    (["calibrate", "r.jsonl", "--out", "o.jsonl", "--length-buckets", "5", "3"], "sicl-fast calibrate"),
    (["cache", "list", "extra"], "sicl-fast cache list"),
])
def test_arguments_left_over_are_refused_by_their_command(argv, who, capsys):
    """A value too many ('--length-buckets 5 3') is refused by the command given it, which --help then explains
    (before: 'sicl-fast: error: unrecognized arguments: 3', the program's, whose --help lists commands)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"{who}: error: unrecognized arguments: {argv[-1]}"), err


def test_plan_takes_the_flags_that_change_the_plan(tiny_model_dir, capsys):
    argv = ["plan", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--backend", "fast",
            "--impl", "torch", "--diff-matmul", "off", "--loop", "eager", "--sync-every", "2", "--graphs", "off",
            "--pack", "1", "--threads", "1", "--estimator", "grad", "--reuse", "on"]
    assert main(argv) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert {k: rows[k] for k in ("backend", "impl", "diff_matmul", "loop", "sync_every", "graphs", "pack", "threads",
                                 "estimator", "reuse")} == {
        "backend": "fast", "impl": "torch", "diff_matmul": "off", "loop": "eager", "sync_every": "2", "graphs": "off",
        "pack": "1", "threads": "1", "estimator": "grad", "reuse": "on"}


def test_demo(tiny_model_dir, capsys):
    argv = ["demo", "--model", str(tiny_model_dir), "--max-steps", "2", "--tau", "0", "--max-new-tokens", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "proxy before:" in out and "answer after:" in out and "(2 steps, stopped by max_steps" in out


def test_bench_has_one_backends_flag_and_no_empty_column(tiny_model_dir, capsys):
    base = ["bench", "--model", str(tiny_model_dir), "--length", "400", "--backends", "fast", "hf", "--repeats", "1",
            "--N", "2"]
    assert main(base) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert "calib s" not in lines[0] and len(lines) == 4
    assert all(cell.strip() for row in lines for cell in row.strip("|").split("|"))  # every cell filled
    assert main([*base, "--calibration-steps", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert "calib s" in lines[0] and all(cell.strip() for row in lines for cell in row.strip("|").split("|"))
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert [o for a in bench._actions for o in a.option_strings if "backend" in o] == ["--backends"]


def test_profile_a_requests_file(tiny_model_dir, reqs, capsys):
    """`sicl-fast profile REQUESTS.jsonl` (its first request) failed with a TypeError: read_requests became a
    generator."""
    assert main(["profile", reqs, "--model", str(tiny_model_dir), "--repeats", "1", "--N", "2", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["info"]["backend"] == "fast" and out["step_ms"] > 0
    # as measured: each round's whole step, then each phase
    assert "  round 1/1: whole step " in captured.err and "  decoder layers: " in captured.err


def no_load(monkeypatch) -> None:
    """From now on a model load fails the test: what follows must end before one."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("sicl_fast.engine.load", boom)


def refused(capsys, *needles) -> None:
    """One error line (exit 2 was checked by the caller) that says to use another --out, with every needle."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": error: " in x]
    assert len(lines) == 1 and "use another --out" in lines[0], err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


def test_gradstudy(tiny_model_dir, reqs, tmp_path, capsys, monkeypatch):
    """Issue 48, defect 5: a resume said nothing to do only after loading the model, and took another grid or dtype
    without a word (one table pooled two grids)."""
    out = tmp_path / "study.jsonl"
    args = ["gradstudy", reqs, "--out", str(out), "--model", str(tiny_model_dir), "--study-N", "2", "--study-mu",
            "0.004", "--seeds", "1", "--points", "0", "--tau", "0"]
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == 2 and "| forward |" in capsys.readouterr().out
    assert json.loads(out.read_text().splitlines()[0])["settings"]["grid"]["Ns"] == [2]
    no_load(monkeypatch)
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "nothing to do: all 2 requests are already in" in captured.err and "| forward |" in captured.out
    assert main([*args, "--study-N", "2", "4"]) == 2
    refused(capsys, "--study-N [2] / [2, 4]")
    assert main([*args, "--dtype", "bfloat16"]) == 2
    refused(capsys, 'dtype "float32" / "bfloat16"')
    report = tmp_path / "study-report"  # issue 54, item 4: a refused resume makes no --report folder
    assert main([*args, "--dtype", "bfloat16", "--report", str(report)]) == 2
    refused(capsys, 'dtype "float32" / "bfloat16"')
    assert not report.exists()


def test_calibrate_resume_refuses_other_settings_before_the_model_loads(tiny_model_dir, reqs, tmp_path, capsys,
                                                                         monkeypatch):
    """Issue 48, defects 1 and 4: a rerun on the same --out with another --max-steps, --seed, --dtype, --diff-matmul,
    --pack or impl added records of the new settings to the old ones without a word, and one asking for --generate /
    --export said nothing to do (no answers, no exports); records held no settings. Now each record holds them and a
    resume of other settings is refused in one line naming them, before the model loads and without touching the
    file; records without settings are refused too."""
    out, first = tmp_path / "o.jsonl", tmp_path / "first.jsonl"
    first.write_text(open(reqs).readline())
    argv = ["calibrate", reqs, "--out", str(out), "--model", str(tiny_model_dir), "--tau", "0", "--N", "2",
            "--max-steps", "2"]
    assert main([*argv[:1], str(first), *argv[2:]]) == 0  # one of the two requests: a run to resume
    st = json.loads(out.read_text())["settings"]
    assert st["command"] == "calibrate" and st["model"]["fingerprint"].startswith("file:")
    assert (st["dtype"], st["backend"], st["pack"], st["config"]["max_steps"], st["config"]["N"]) == (
        "float32", "fast", 1, 2, 2)
    assert st["outputs"] == {"generate": False, "max_new_tokens": None, "stop": None, "export": False}
    before = out.read_text()
    capsys.readouterr()
    no_load(monkeypatch)
    cases = [(["--max-steps", "3"], "max_steps 2 / 3"), (["--seed", "5"], "seed 0 / 5"),
             (["--dtype", "bfloat16"], 'dtype "float32" / "bfloat16"'), (["--diff-matmul", "fp8"], "diff_matmul"),
             (["--pack", "2"], "pack 1 / 2"), (["--generate"], "--generate false / true"),
             (["--export", str(tmp_path / "emb")], "--export false / true")]
    if st["impl"] != "torch":
        cases.append((["--impl", "torch"], f'impl "{st["impl"]}" / "torch"'))
    for extra, named in cases:
        assert main([*argv, *extra]) == 2, extra
        refused(capsys, named, "(the file's / this run's)")
        assert out.read_text() == before and not (tmp_path / "emb").exists()
    monkeypatch.undo()
    assert main(argv) == 0  # the same settings: resumed
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b"] and recs[1]["settings"] == st
    no_load(monkeypatch)
    assert main(argv) == 0 and "nothing to do" in capsys.readouterr().err
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "settings"}) + "\n" for r in recs))
    assert main(argv) == 2
    refused(capsys, "2 record(s) written without their settings")


def test_icleval_resume_and_report_never_pool_other_settings(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Issue 48, defects 2 and 3: an icleval resume ignored the weights' dtype, the difference products, the backend
    and the impl, and `report` pooled records of two dtypes or two models in one run. A resume of other settings is
    refused before the model loads; report splits a file into one run per settings, named by what differs, and
    records without settings (an older version's) into one run per model."""
    task = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--model",
            str(tiny_model_dir), "--max-steps", "1", "--N", "2", "--quiet"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main([*task, "--out", str(a)]) == 0 and main([*task, "--out", str(b), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    no_load(monkeypatch)
    rec = json.loads(a.read_text())
    cases = [(["--dtype", "bfloat16"], "dtype"), (["--diff-matmul", "fp8"], "diff_matmul"),
             (["--backend", "fast-fp32"], 'backend "fast" / "fast-fp32"')]
    if rec["settings"]["impl"] != "torch":
        cases.append((["--impl", "torch"], "impl"))
    for extra, named in cases:
        assert main([*task, "--out", str(a), *extra]) == 2, extra
        refused(capsys, named)
    other = {**rec, "model": "other", "settings": {**rec["settings"], "model": {"name": "other", "fingerprint": "x"}}}
    old = [{k: v for k, v in r.items() if k != "settings"} for r in (rec, {**rec, "model": "older"})]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(a.read_text() + b.read_text() + "".join(json.dumps(r) + "\n" for r in [other, *old]))
    assert main(["report", str(mixed), "--report", str(tmp_path / "rep"), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "its records were made with 5 different settings, reported as 5 runs (never pooled)" in err
    runs = json.loads((tmp_path / "rep" / "report.json").read_text())["runs"]
    names, name = [r["name"] for r in runs], rec["model"]
    assert [r["n_records"] for r in runs] == [1] * 5 and len(set(names)) == 5
    assert "dtype=float32" in names[0] and "dtype=bfloat16" in names[1] and "model=other" in names[2]
    assert names[3:] == [f"{name} [settings unknown, model {name}]", "older [settings unknown, model older]"]
    assert runs[0]["settings"] == rec["settings"] and runs[3]["settings"] is None


def test_icleval_then_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "icl.jsonl"
    assert main(["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out", str(out),
                 "--model", str(tiny_model_dir), "--max-steps", "1", "--N", "2", "--quiet"]) == 0
    assert "| classifier_order | 1 |" in capsys.readouterr().out
    assert main(["report", str(out), "--report", str(tmp_path / "rep"), "--no-plots"]) == 0
    assert "classifier_order" in capsys.readouterr().out and (tmp_path / "rep" / "report.md").is_file()


def test_stopping_rules_answers_along_the_way_and_their_report(tiny_model_dir, reqs, tmp_path, capsys):
    """--min-delta and --time-budget on calibrate, demo and icleval (min_delta stopping patience earlier than
    without it); icleval --answer-at; the report's budget curves and the runs compared (issue 31)."""
    model = ["--model", str(tiny_model_dir), "--tau", "0", "--N", "2"]
    out = tmp_path / "cal.jsonl"
    assert main(["calibrate", reqs, "--out", str(out), *model, "--max-steps", "5", "--time-budget", "0"]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["steps"] == 1 and r["stop_reason"] == "time_budget" for r in recs)
    assert main(["demo", *model, "--max-steps", "9", "--min-delta", "1", "--patience", "2",
                 "--max-new-tokens", "1"]) == 0
    assert "(3 steps, stopped by patience" in capsys.readouterr().out
    task = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "generate_order", "--limit", "2",
            *model, "--max-steps", "4", "--patience", "0", "--quiet"]
    paper, budget = tmp_path / "paper.jsonl", tmp_path / "budget.jsonl"
    assert main([*task, "--out", str(paper), "--answer-at", "1", "2", "9"]) == 0
    assert main([*task, "--out", str(budget), "--time-budget", "0"]) == 0
    # with patience on, min_delta makes it stop where the paper's rule goes on (the tiny model's proxy creeps up)
    patient, delta = tmp_path / "patient.jsonl", tmp_path / "delta.jsonl"
    assert main([*task, "--out", str(patient), "--patience", "2", "--max-steps", "6"]) == 0
    assert main([*task, "--out", str(delta), "--patience", "2", "--max-steps", "6", "--min-delta", "1e-3"]) == 0
    capsys.readouterr()
    for r in map(json.loads, paper.read_text().splitlines()):
        assert r["steps"] == 4 and sorted(r["answers_at"]) == ["1", "2"]  # 9 > max_steps
        assert r["answers_at"]["1"] == r["answer_base"] and r["calibration_seconds"] <= r["seconds"]
    for r in map(json.loads, budget.read_text().splitlines()):
        assert r["steps"] == 1 and r["stop_reason"] == "time_budget" and r["time_budget_s"] == 0
    steps = {(r["task"], r["uid"]): r["steps"] for r in map(json.loads, patient.read_text().splitlines())}
    for r in map(json.loads, delta.read_text().splitlines()):
        assert r["stop_reason"] == "patience" and r["steps"] < steps[r["task"], r["uid"]]
        assert r["config"]["min_delta"] == 1e-3
    # a resumed file run with another budget is refused
    assert main([*task, "--out", str(budget), "--time-budget", "5"]) == 2
    assert "--time-budget 0.0 / 5.0 (the file's / this run's)" in capsys.readouterr().err
    # and one with other answers along the way: it said "nothing to do" and reported without the answers at 3
    assert main([*task, "--out", str(paper), "--answer-at", "9", "2", "1"]) == 0  # the same counts
    assert "nothing to do" in capsys.readouterr().err
    assert main([*task, "--out", str(paper), "--answer-at", "3"]) == 2
    assert "--answer-at [1, 2] / [3] (the file's / this run's)" in capsys.readouterr().err
    assert main(["report", str(paper), str(budget), "--names", "paper", "budget", "--report",
                 str(tmp_path / "rep")]) == 0
    md = capsys.readouterr().out
    assert "| classifier_order | 1 |" in md and "## Runs compared with paper (same samples)" in md
    assert "| sicl[N=2] | budget | classifier_order | 2 |" in md and "| 4.0 -> 1.0 |" in md and "time_budget 2" in md
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    curve = rep["runs"][0]["variants"][0]["budget"]["classifier_order"]
    assert [row["step"] for row in curve["by_step"]] == [1, 2, 4]
    assert curve["by_step"][0]["mean_gain"] == 0 and curve["by_step"][0]["answers_changed"] == 0
    assert curve["by_step"][-1]["n_answers"] == 2  # the final answers
    assert (tmp_path / "rep" / "plots" / "budget_paper_sicl_N=2.png").is_file()


def test_min_delta_rel_on_the_command_line(tiny_model_dir, reqs, tmp_path):
    """--min-delta-rel: patience counts a step only when it beats the last counted proxy by that fraction, so it
    stops runs whose proxy creeps up, which the paper's rule (and patience alone) lets run to --max-steps."""
    argv = ["calibrate", reqs, "--model", str(tiny_model_dir), "--tau", "0", "--N", "2", "--max-steps", "12",
            "--patience", "2"]
    runs = {}
    for name, extra in (("paper", []), ("rel", ["--min-delta-rel", "1e-3"])):
        out = tmp_path / f"{name}.jsonl"
        assert main([*argv, "--out", str(out), *extra]) == 0
        runs[name] = [json.loads(x) for x in out.read_text().splitlines()]
    for paper, rel in zip(runs["paper"], runs["rel"]):
        assert rel["stop_reason"] == "patience" and rel["steps"] < paper["steps"]


def test_budget_measurement_script(tiny_model_dir, tmp_path):
    """bench/budget_measure.sh (issue 31's measurement) end to end on one sample of one file, on the tiny model."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "LIMIT": "1", "DATA": str(ICLEVAL_EXCERPTS), "OUT": str(tmp_path / "b"),
           "TASKS": "generate_order", "EXTRA": f"--model {tiny_model_dir} --max-steps 3 --tau 0 --N 2",
           "SICL": f"{sys.executable} -m sicl_fast.cli"}
    done = subprocess.run(["bash", str(root / "bench" / "budget_measure.sh")], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "b" / "report" / "report.md").read_text()
    assert "## Runs compared with paper (same samples)" in md and "| budget=2s | generate_order | 1 |" in md
    assert len((tmp_path / "b" / "load.txt").read_text().splitlines()) == 3


def test_budget_measurement_script_defaults(tmp_path):
    """Run from a checkout with neither DATA nor SICL set, bench/budget_measure.sh reads the README's ICLEval clone
    (ICLEval/data/tasks_data) with the checkout's .venv/bin/sicl-fast; without the clone it stops before any run
    with one line that says how to get it."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "budget_measure.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("DATA", "SICL", "SICL_ICLEVAL_DIR")}
    env.update(LIMIT="1", OUT="out")
    fake = tmp_path / ".venv" / "bin" / "sicl-fast"  # records its arguments, one call a line
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho "$@" >> calls.txt\n')
    fake.chmod(0o755)

    def run():
        return subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)

    missing = run()
    assert missing.returncode == 2 and not (tmp_path / "calls.txt").exists()
    assert "no ICLEval task files (*.json) in ICLEval/data/tasks_data" in missing.stderr
    assert "git clone https://github.com/RUCBM/ICLEval" in missing.stderr
    data = tmp_path / "ICLEval" / "data" / "tasks_data"
    data.mkdir(parents=True)
    (data / "generate_order.json").write_text("[]")
    done = run()
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    want = [["icleval", "ICLEval/data/tasks_data"]] * 3 + [["report", "out/paper.jsonl"]]  # the three runs, the report
    assert [c.split()[:2] for c in calls] == want


def test_icleval_refuses_a_step_too_big_before_opening_its_output(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Issue 54, item 4 (defect 4's pattern: a file opened before a refusal): icleval checked only the samples'
    tokens before opening --out, so a step too big for memory was refused by the first calibration, the results file
    already made (481e2be: a 0-byte --out). Now every calibrating variant's step is checked first (as calibrate's
    are), and the refusal leaves nothing behind."""
    out = tmp_path / "icl.jsonl"
    monkeypatch.setattr("sicl_fast.run.checks.available_memory", lambda device: 1 << 10)
    assert main(["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out", str(out),
                 "--model", str(tiny_model_dir), "--max-steps", "1", "--N", "2", "--quiet"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    assert len(lines) == 1 and "one ascent step needs about" in lines[0] and "of memory free; lower N" in lines[0]
    assert not out.exists()


def test_a_refused_icleval_resume_makes_no_report_or_store_folder(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Issue 54, item 4 (a folder made before a refusal): --report and --store were made while the flags were
    checked, so a resume refused for its settings left them behind, empty (481e2be). Now they are checked there and
    made when first written (the report at the end, the store with the engine)."""
    out, report, store = tmp_path / "icl.jsonl", tmp_path / "rep", tmp_path / "store"
    task = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out", str(out),
            "--model", str(tiny_model_dir), "--max-steps", "1", "--N", "2", "--quiet"]
    assert main(task) == 0
    capsys.readouterr()
    assert main([*task, "--dtype", "bfloat16", "--report", str(report), "--store", str(store)]) == 2
    refused(capsys, 'dtype "float32" / "bfloat16"')
    assert not report.exists() and not store.exists()
    assert main([*task, "--report", str(report)]) == 0 and (report / "report.md").is_file()  # made when written


def test_gradstudy_refuses_a_step_too_big_before_opening_its_output(tiny_model_dir, reqs, tmp_path, capsys,
                                                                    monkeypatch):
    """Issue 54, item 4 (a file opened before a refusal): gradstudy's walk checked its exact-gradient step's memory
    in its first prompt's study, --out already opened (481e2be: a 0-byte file). Now it is checked with the requests'
    tokens (Engine.check_steps of gradstudy.walk_config)."""
    out = tmp_path / "study.jsonl"
    monkeypatch.setattr("sicl_fast.run.checks.available_memory", lambda device: 1 << 10)
    assert main(["gradstudy", reqs, "--out", str(out), "--model", str(tiny_model_dir), "--study-N", "2",
                 "--study-mu", "0.004", "--seeds", "1", "--points", "0"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    assert len(lines) == 1 and "one ascent step needs about" in lines[0] and "the exact gradient of" in lines[0]
    assert not out.exists()
