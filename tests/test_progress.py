"""Progress a person can see (sicl_fast.run.progress): the step within the running calibration on calibrate's and
icleval's bar, and a resumed run with nothing left to do ending before any model is loaded."""
from __future__ import annotations

import json
import re

import pytest

from conftest import ICLEVAL_EXCERPTS
from sicl_fast import engine as engine_module
from sicl_fast.commands.cli import main

REQS = [{"id": "a", "demos": [{"input": "hello", "output": "world"}, {"input": "he", "output": "wor"}],
         "query": "hello"},
        {"id": "b", "demos": [{"input": "one", "output": "1"}, {"input": "two", "output": "2"}], "query": "three"}]


@pytest.fixture
def reqs(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQS))
    return str(path)


def no_model_load(monkeypatch):
    """Any Engine built from here on fails the test: the command must not load the model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module.Engine, "__init__", refuse)


@pytest.mark.parametrize("loop", ["static", "eager"])
def test_calibrate_shows_the_step_of_the_running_request(tiny_model_dir, reqs, tmp_path, capsys, loop):
    argv = ["calibrate", reqs, "--out", str(tmp_path / "o.jsonl"), "--model", str(tiny_model_dir), "--max-steps", "2",
            "--tau", "0", "--patience", "0", "--N", "2", "--loop", loop]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "step 1/2 proxy 0." in err  # the first report is drawn at once
    assert re.search(r"step 2/2 proxy 0\.\d+ \d+\.\d+ s/step", err)  # the last, drawn with the request's update


def test_calibrate_resumed_with_nothing_left_loads_no_model(tiny_model_dir, reqs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.jsonl"
    argv = ["calibrate", reqs, "--out", str(out), "--max-steps", "1", "--tau", "0", "--N", "2", "--model",
            str(tiny_model_dir)]
    assert main(argv) == 0
    before = out.read_text()
    capsys.readouterr()
    no_model_load(monkeypatch)  # the settings are told from the model's files, its weights are not read
    assert main(argv) == 0
    assert "nothing to do: all 2 requests are already in" in capsys.readouterr().err and out.read_text() == before


def test_icleval_resumed_with_nothing_left_loads_no_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "icl.jsonl"
    base = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out", str(out),
            "--model", str(tiny_model_dir), "--max-steps", "1", "--N", "2"]
    argv = [*base, "--method", "base", "sicl"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "step 1/1 proxy" in first.err  # the step of the running calibration, on the bar
    no_model_load(monkeypatch)
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "nothing to do: all 2 records are already in" in again.err and again.out == first.out
    # other settings for a variant already in the file: refused as a resume with work left refuses them
    assert main([*base, "--method", "sicl", "--eta", "0.1"]) == 2
    assert "with other settings than this run's: eta 0.05 / 0.1" in capsys.readouterr().err


def test_a_resume_compares_the_model_files_not_their_name(tiny_model_dir, reqs, tmp_path, capsys, monkeypatch):
    """Issue 54, defect 3: the same files named otherwise (a model folder, then a link to it; the embedded model by
    name, then by its GGUF path) were refused as another model: the settings compared model.name. The fingerprint
    is what a record is made with; its name is named only where the files differ."""
    from sicl_fast.run.settings import describe_diff, settings_diff

    out, link = tmp_path / "o.jsonl", tmp_path / "another-name"
    link.symlink_to(tiny_model_dir)
    argv = ["calibrate", reqs, "--out", str(out), "--max-steps", "1", "--tau", "0", "--N", "2", "--model"]
    assert main([*argv, str(tiny_model_dir)]) == 0
    before = out.read_text()
    capsys.readouterr()
    no_model_load(monkeypatch)
    assert main([*argv, str(link)]) == 0
    assert "nothing to do: all 2 requests are already in" in capsys.readouterr().err and out.read_text() == before
    embedded = {"model": {"name": "smollm2-135m", "fingerprint": "file:1"}, "dtype": "float32"}
    by_path = {"model": {"name": "SmolLM2-135M.Q8_0.gguf", "fingerprint": "file:1"}, "dtype": "float32"}
    assert settings_diff(embedded, by_path) == []
    other = {**by_path, "model": {"name": "other.gguf", "fingerprint": "file:2"}}
    assert settings_diff(embedded, other) == ["model.fingerprint", "model.name"]
    assert describe_diff(embedded, other) == 'model files "file:1" / "file:2", model "smollm2-135m" / "other.gguf"'
    # settings written by hand without a fingerprint on one side: the files differ, the name that is the same is
    # not named (before: "model \"m\" / \"m\"")
    hand = {"model": {"name": "smollm2-135m"}, "dtype": "float32"}
    assert settings_diff(embedded, hand) == ["model.fingerprint"]
    assert settings_diff(hand, {**hand, "model": {"name": "other"}}) == ["model.name"]


def test_a_refused_resume_leaves_its_file_untouched(tiny_model_dir, reqs, tmp_path, capsys, monkeypatch):
    """Issue 54, defect 5: a resume refused for its settings had already repaired the file (its torn last line moved
    to OUT.bad, the file rewritten). Refused now means untouched; a resume that goes on repairs it."""
    out = tmp_path / "o.jsonl"
    argv = ["calibrate", reqs, "--out", str(out), "--max-steps", "1", "--tau", "0", "--N", "2", "--model",
            str(tiny_model_dir)]
    assert main(argv) == 0
    torn = out.read_bytes().splitlines(keepends=True)[0] + b'{"id": "b", "ste'  # killed while it wrote b
    out.write_bytes(torn)
    capsys.readouterr()
    no_model_load(monkeypatch)
    assert main([*argv, "--seed", "3"]) == 2
    assert "seed 0 / 3 (the file's / this run's)" in capsys.readouterr().err
    assert out.read_bytes() == torn and not (tmp_path / "o.jsonl.bad").exists()
    monkeypatch.undo()
    assert main(argv) == 0  # the same settings: repaired, and b calibrated again
    assert (tmp_path / "o.jsonl.bad").read_bytes() == b'{"id": "b", "ste\n'
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b"]


def test_icleval_variants_are_refused_by_the_one_rule(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Issue 54, item 2: icleval's variants kept a check and a message of their own (evaluation.methods
    ._check_existing, beside run.settings.check_resume). A variant's part (here a baseline's options, which the
    run's settings do not hold) is now compared by the one rule and said in its one message, before the model
    loads."""
    out = tmp_path / "icl.jsonl"
    argv = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out", str(out),
            "--model", str(tiny_model_dir), "--method", "cc", "--quiet"]
    assert main([*argv, "--cf-inputs", "N/A"]) == 0
    before = out.read_text()
    capsys.readouterr()
    no_model_load(monkeypatch)
    assert main([*argv, "--cf-inputs", "N/A", "[MASK]"]) == 2
    err = capsys.readouterr().err
    assert (f"--out {out}: its records of variant 'cc' were made with other settings than this run's: cf_inputs "
            '["N/A"] / ["N/A", "[MASK]"] (the file\'s / this run\'s); use another --out or the same settings') in err
    assert out.read_text() == before
    assert main([*argv, "--cf-inputs", "N/A"]) == 0 and "nothing to do" in capsys.readouterr().err
