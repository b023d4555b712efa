"""What a run would write, known before its model loads (sicl_fast.run.planned): the plan made on the architecture
is the one the engine takes (issue 54, item 2), and a plan remembered after a load is recalled, without planning,
as what that plan would have been."""
from __future__ import annotations

import dataclasses
import json

import pytest

from sicl_fast.commands.cli import main
from sicl_fast.engine import Engine
from sicl_fast.run import planned as planned_module
from sicl_fast.run.plan import Choices, confirm_plan, make_plan
from sicl_fast.run.planned import plan_key, planned, remember
from sicl_fast.run.settings import engine_settings
from sicl_fast.run.workers import engine_facts


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A model cache of the test's own: what it remembers, and the plans it recalls."""
    monkeypatch.setenv("SICL_FAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_plan_made_before_the_load_is_the_engines(tiny_model_dir, own_cache, monkeypatch):
    """The engine took its own plan after the load, beside the one the resume was checked with: now it takes the
    early plan, confirmed on the weights (run.plan.confirm_plan); a plan the weights do not confirm (here one of
    another model) is made afresh."""
    choices = Choices(impl="torch")
    early = planned(tiny_model_dir, "auto", "cpu", choices)
    assert early.plan is not None and early.key is not None  # nothing remembered yet: planned on the architecture

    def refuse(*a, **k):
        raise AssertionError("the engine planned again")

    monkeypatch.setattr("sicl_fast.engine.make_plan", refuse)
    eng = Engine(model=tiny_model_dir, device="cpu", impl="torch", plan=early.plan)
    assert dataclasses.replace(eng.plan, why=()) == dataclasses.replace(early.plan, why=())
    assert engine_settings(eng) == early.settings
    assert dict((a, r) for a, _, r in eng.plan.why)["dtype"] == eng.lm.extra["why"]["dtype"]  # the load's reason
    other = dataclasses.replace(early.plan, model="another")
    assert confirm_plan(other, eng.lm, choices) == make_plan(eng.lm, choices)


def test_a_remembered_plan_is_recalled_as_the_engine_made_it(tiny_model_dir, own_cache, tmp_path, monkeypatch):
    """What an engine planned after its load is kept under a key of what the plan is made from; the next run of
    that key recalls it, without building the architecture, the same as planning it would give. The key holds the
    model's files, not their name; the arguments and the environment's variables change it."""
    choices = Choices(impl="torch")
    key, identity = plan_key(tiny_model_dir, "auto", "cpu", choices)
    eng = Engine(model=tiny_model_dir, device="cpu", impl="torch")
    remember(key, engine_facts(eng))
    assert json.loads((own_cache / "plans" / f"{key}.json").read_text())["n_params"] > 0

    def refuse(*a, **k):
        raise AssertionError("planned on the architecture")

    monkeypatch.setattr("sicl_fast.models.facts.unloaded", refuse)
    got = planned(tiny_model_dir, "auto", "cpu", choices)
    assert got.plan is None and got.key == key and got.settings == engine_settings(eng)
    assert (got.name, got.family, got.n_params) == (eng.lm.name, eng.lm.family, engine_facts(eng)["n_params"])
    link = tmp_path / "another-name"
    link.symlink_to(tiny_model_dir)
    by_link = planned(link, "auto", "cpu", choices)  # the same files: recalled, and named as this run names them
    assert by_link.settings == {**got.settings, "model": {**identity, "name": "another-name"}}
    for other in [(tiny_model_dir, "bfloat16", "cpu", choices), (tiny_model_dir, "auto", "cpu", Choices())]:
        assert plan_key(*other)[0] != key
    monkeypatch.setenv("SICL_SOMETHING", "1")
    assert plan_key(tiny_model_dir, "auto", "cpu", choices)[0] != key
    monkeypatch.undo()
    monkeypatch.setenv("SICL_FAST_CACHE", str(own_cache))
    monkeypatch.setattr(planned_module, "recall", lambda key: None)
    fresh = planned(tiny_model_dir, "auto", "cpu", choices)  # planning it gives what was recalled
    assert fresh.plan is not None and (fresh.settings, fresh.family, fresh.n_params) == (
        got.settings, got.family, got.n_params)


def test_a_finished_resume_recalls_the_plan_its_first_run_remembered(tiny_model_dir, own_cache, tmp_path, capsys,
                                                                      monkeypatch):
    """The first run remembers what its engine planned; the resume recalls it: neither its weights nor its
    architecture are read (RESULTS 33: transformers is not imported)."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "a", "demos": [{"input": "hi", "output": "yo"}], "query": "hey"}) + "\n")
    argv = ["calibrate", str(reqs), "--out", str(tmp_path / "o.jsonl"), "--max-steps", "1", "--tau", "0", "--N",
            "2", "--model", str(tiny_model_dir)]
    assert main(argv) == 0
    assert len(list((own_cache / "plans").glob("*.json"))) == 1
    capsys.readouterr()

    def refuse(*a, **k):
        raise AssertionError("the model or its architecture was read")

    monkeypatch.setattr("sicl_fast.models.facts.unloaded", refuse)
    monkeypatch.setattr("sicl_fast.engine.load", refuse)
    assert main(argv) == 0 and "nothing to do: all 1 requests are already in" in capsys.readouterr().err
    assert main([*argv, "--max-steps", "2"]) == 2  # and a refused one
    assert "max_steps 1 / 2 (the file's / this run's)" in capsys.readouterr().err


def test_a_damaged_remembered_plan_is_planned_again(own_cache, models):
    """A remembered plan whose settings are not what remember() keeps (a field missing or of another type, a
    fallback, a count of 0) is not recalled (planned again), so it never answers a resume (before: `"settings": {}`
    or `"impl": 42` were recalled and every resume of the file was refused, naming settings nobody set, until the
    file was found and removed). What plan_settings makes is recalled, an attention precision included."""
    from sicl_fast.run.planned import recall
    from sicl_fast.run.settings import plan_settings

    for plan in (make_plan(models["llama"]), make_plan(models["llama"], impl="torch", attn="math",
                                                        attn_precision="tf32x3")):
        remember("k", {"settings": {"model": {}, **plan_settings(plan)}, "family": "llama", "n_params": 5})
        assert recall("k")["settings"] == plan_settings(plan)
    good = json.loads((own_cache / "plans" / "k.json").read_text())
    for damage in [{"settings": {}}, {"settings": {**good["settings"], "impl": 42}},
                   {"settings": {k: v for k, v in good["settings"].items() if k != "dtype"}},
                   {"settings": {**good["settings"], "threads": 2}}, {"settings": {**good["settings"], "pack": True}},
                   {"settings": {**good["settings"], "pack": 0}}, {"settings": {**good["settings"], "fallback": "x"}},
                   {"settings": {**good["settings"], "length_buckets": "4"}}, {"n_params": True},
                   {"n_params": -5}, {"family": ""}]:
        (own_cache / "plans" / "k.json").write_text(json.dumps({**good, **damage}))
        assert recall("k") is None, damage
    (own_cache / "plans" / "k.json").write_bytes(b"[" * 100000 + b"]" * 100000)  # issue 54 item 4: RecursionError
    assert recall("k") is None


def test_a_plans_folder_that_cannot_be_written_costs_only_the_recall(own_cache):
    """remember() on a cache whose plans/ is a file, or whose oldest '*.json' past KEEP is a folder: nothing is kept
    or removed, and nothing is raised (before: an internal error, NotADirectoryError or IsADirectoryError, in every
    run that remembered)."""
    import os

    from sicl_fast.run.planned import KEEP, recall

    facts = {"settings": {"model": {}, "backend": "fast", "impl": "torch", "attention": "sdpa", "diff_matmul": "bf16",
                          "dtype": "float32", "device": "cpu", "length_buckets": None, "pack": 1, "fallback": None},
             "family": "llama", "n_params": 5}
    own_cache.mkdir(parents=True)
    (own_cache / "plans").write_text("not a folder")
    remember("k", facts)
    assert recall("k") is None and (own_cache / "plans").read_text() == "not a folder"
    (own_cache / "plans").unlink()
    (own_cache / "plans" / "0-old.json").mkdir(parents=True)
    os.utime(own_cache / "plans" / "0-old.json", (0, 0))
    for i in range(KEEP + 1):
        remember(f"k{i}", facts)
    assert (own_cache / "plans" / "0-old.json").is_dir() and recall(f"k{KEEP}") is not None
    assert len(list((own_cache / "plans").glob("k*.json"))) == KEEP
