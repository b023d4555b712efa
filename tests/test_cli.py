"""The CLI end to end on SmolLM2 with a couple of steps: proxy, calibrate (resume, generate), errors, demo."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ICLEVAL_EXCERPTS
from sicl_fast import Engine
from sicl_fast.commands.cli import main

pytestmark = pytest.mark.slow

STRUCT = {"id": "digits", "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"},
                                    {"input": "three", "output": "3"}], "query": "five"}
RAW = {"id": "raw", "prompt": "Colours.\ngrass: green\nsky: blue\nsnow:", "output_spans": [[16, 21], [27, 31]],
       "demos_start": 9}
FAST = ["--max-steps", "2", "--N", "2"]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def test_proxy_command(tmp_path, capsys, smol):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, RAW])
    assert main(["proxy", reqs]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in lines] == ["digits", "raw"]
    assert set(lines[0]) == {"id", "proxy", "C", "R", "G", "num_demos", "token_spans"}
    assert lines[1]["num_demos"] == 2
    eng = Engine(smol)
    p = eng.prepare(STRUCT)
    assert lines[0]["proxy"] == pytest.approx(float(eng.proxy(p).f[0]), abs=1e-6)
    assert lines[0]["token_spans"] == [list(s) for s in p.token_spans]


def test_calibrate_resumes_and_generates(tmp_path, capsys):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    out = tmp_path / "out.jsonl"
    assert main(["calibrate", reqs, "--out", str(out), "--generate", "--max-new-tokens", "4", *FAST]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 1
    r = recs[0]
    for k in ("id", "initial_proxy", "best_proxy", "steps", "gated", "seconds", "answer_base", "answer_calibrated"):
        assert k in r
    assert r["steps"] == 2 and r["best_proxy"] >= r["initial_proxy"] and r["answer_base"] == "5"
    # a crash left half a line behind: it is cut off, done ids are skipped, new ones are run
    with out.open("a") as fh:
        fh.write('{"id": "half')
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, RAW])
    capsys.readouterr()
    assert main(["calibrate", reqs, "--out", str(out), "--generate", "--max-new-tokens", "4", *FAST]) == 0
    assert "resuming: 1 of 2" in capsys.readouterr().err
    recs2 = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in recs2] == ["digits", "raw"] and recs2[0] == r


def test_bad_request_fails_before_writing(tmp_path, capsys):
    bad = dict(RAW, id="oops", output_spans=[[16, 90]])
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, bad])
    out = tmp_path / "out.jsonl"
    assert main(["calibrate", reqs, "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert "'oops'" in err and "output_spans[0]" in err and "outside the prompt" in err
    assert not out.exists()


def test_unknown_model_and_bad_knob(tmp_path, capsys):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    assert main(["proxy", reqs, "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["proxy", reqs, "--q", "1.5"]) == 2
    assert "q must be in [0, 1]" in capsys.readouterr().err


# the console script installed beside this interpreter (CI runs .venv/bin/python without activating the venv)
SCRIPT = shutil.which("sicl-fast", path=str(Path(sys.executable).parent)) or shutil.which("sicl-fast")


@pytest.mark.skipif(SCRIPT is None, reason="package not installed (pip install -e .)")
def test_console_script_demo():
    run = subprocess.run([SCRIPT, "demo", "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "proxy before:" in run.stdout and "answer before: '5'" in run.stdout and "answer after:" in run.stdout


def test_icleval_command(tmp_path, capsys):
    out = tmp_path / "icl.jsonl"
    argv = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order",
            "generate_order", "--limit", "1", "--out", str(out), "--max-steps", "1", "--N", "2"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["task"], r["uid"]) for r in recs] == [("classifier_order", 0), ("generate_order", 0)]
    for r in recs:
        for k in ("label", "answer_base", "answer_calibrated", "correct_base", "correct_calibrated",
                  "initial_proxy", "best_proxy", "steps", "gated", "seconds"):
            assert k in r
        assert r["steps"] == 1 and r["best_proxy"] == r["initial_proxy"]  # one step: best is X0
        assert r["answer_calibrated"] == r["answer_base"] and r["correct_calibrated"] == r["correct_base"]
    assert recs[0]["label"] is True  # JSON bool labels survive
    assert "| classifier_order | 1 |" in table and "| all (micro) | 2 |" in table
    # resume: nothing left to do, same records
    assert main(argv) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == recs


def test_calibrate_packed_and_loops_agree(tmp_path):
    """--pack 2 (one batched forward for two prompts) and --loop eager give the records of the default run
    (the static loop); packed to float tolerance (tests/test_packed.py says why), eager exactly."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, RAW, {**STRUCT, "id": "digits2", "query": "nine"}])
    runs = {}
    for name, extra in (("static", []), ("eager", ["--loop", "eager"]),
                        ("packed", ["--pack", "2", "--backend", "fast-fp32"]),
                        ("alone", ["--backend", "fast-fp32"])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["calibrate", reqs, "--out", str(out), "--max-steps", "3", "--N", "2", *extra]) == 0
        runs[name] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    skip = {"seconds"}
    strip = lambda rs: {i: {k: v for k, v in r.items() if k not in skip} for i, r in rs.items()}  # noqa: E731
    assert strip(runs["static"]) == strip(runs["eager"])
    assert set(runs["packed"]) == {"digits", "raw", "digits2"}
    for i, r in runs["packed"].items():
        a = runs["alone"][i]
        assert r["steps"] == a["steps"] and r["stop_reason"] == a["stop_reason"]
        # issue 48: packed records lacked these four (a run without the store says so)
        assert set(r) == set(a) and (r["reused"], r["reuse"], r["key"], r["exact"]) == (False, "off", None, True)
        assert r["best_proxy"] == pytest.approx(a["best_proxy"], rel=1e-5)


def test_plan_and_bench_read_the_run_plan(capsys):
    """`plan` prints every axis and why; `bench` times the step the plan runs (--loop / --pack honoured) and
    refuses what the plan refuses, before any timing."""
    assert main(["plan", "--backend", "fast-fp32", "--loop", "eager", "--sync-every", "3"]) == 0
    out = capsys.readouterr().out
    assert "model smollm2-135m" in out and "fast-fp32: every product plain, in the model dtype" in out
    assert "auto: not CUDA" in out and "auto: no CUDA device here" in out  # --pack and --device: the defaults
    assert all(f"  {axis} " in out for axis in ("backend", "impl", "attention", "diff_matmul", "loop", "sync_every",
                                                "graphs", "pack", "estimator"))
    assert main(["plan", "--backend", "hf", "--pack", "2"]) == 2
    assert "pack > 1 needs the static loop on the fast backend (backend 'hf'" in capsys.readouterr().err
    loops = {}
    for extra in (["--loop", "eager"], ["--pack", "2"], []):
        assert main(["bench", "--length", "32", "--backends", "fast-fp32", "--repeats", "1", "--N", "2", *extra]) == 0
        row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| fast-fp32 |")]
        loops[" ".join(extra)] = row[0].split("|")[3].strip()
    assert loops == {"--loop eager": "eager", "--pack 2": "packed x2", "": "static"}
    assert main(["bench", "--length", "32", "--backends", "hf", "--loop", "static"]) == 2
    assert "loop 'static' needs the fast backend's sync-free forward; 'hf'" in capsys.readouterr().err
