"""The first replay of every new capture checked against the same step through the torch ops, with a fallback (issue
53, item 5: sicl_fast.run.graphs.first_replay), on the CPU through the fake capture (tests/fake_graphs.py: the ops a
capture records replayed, impl 'torch'). A faulty capture (a recorded op left out of the replays) falls back to the
same step uncaptured; a faulty kernel (the plan's ops off, captured or not) falls back to the torch ops; either way
the run goes on and gives the numbers of a run that never captured (bit for bit: the same ops in the same order),
and the plan, the warning and the records' settings say which and why.
"""
import dataclasses

import pytest
import torch

from fake_graphs import FakeCuda
from sicl_fast.backends import make_backend
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.calibration.packed import run_packed
from sicl_fast.calibration.static import StepCache, run_static
from sicl_fast.errors import SiclWarning
from sicl_fast.run.plan import fall_back
from sicl_fast.run.settings import plan_settings, settings_diff
from test_fast_backend import make_prompt
from test_static import BASE, assert_same_result


def leave_out_last(only=None):
    """A faulty capture: the last recorded op never replays (of every capture, or of the k-th in `only`)."""
    return lambda ops, k: ops[:-1] if only is None or k in only else ops


def backend(models, **kw):
    return make_backend("fast", models["llama"], diff_matmul="bf16", impl="torch", **kw)


def config(be, **kw):
    return Calibrator(be, CalibrationConfig(**{**BASE, **kw})).config


def test_a_faulty_static_capture_goes_on_uncaptured(models, monkeypatch):
    """The step's graph leaves an op out: its first replay differs from the torch ops' step, the same step
    uncaptured matches, so the run goes on uncaptured (the plan: graphs off, fallback 'uncaptured' and why) and
    gives the uncaptured run's numbers; later steps are built uncaptured."""
    be = backend(models)
    cfg = config(be, max_steps=6)
    p = make_prompt(6)
    want = run_static(be, cfg, p)
    fake = FakeCuda(monkeypatch)
    fake.fault = leave_out_last()
    with pytest.warns(SiclWarning, match="CUDA graphs: the captured static step's first replay"):
        got = run_static(be, cfg, p, steps=StepCache("cpu"))
    assert_same_result(got, want)
    assert be.plan.fallback.startswith("uncaptured: the captured static step's first replay")
    assert not be.plan.graphs and be.plan.impl == "torch"
    assert "fallback" in be.plan.explain() and "fell back (uncaptured)" in be.plan.explain()
    captures = fake.captures
    run_static(be, cfg, make_prompt(0), steps=StepCache("cpu"))  # another shape: built uncaptured
    assert fake.captures == captures


def test_a_faulty_refresh_capture_goes_on_uncaptured(models, monkeypatch):
    """The step's graph is right, its reference refresh's graph (the second capture) leaves an op out: the refresh's
    first replay (after step 4 here: REFRESH_EVERY made 4) falls back; the run is the uncaptured one's."""
    from sicl_fast.backends import step_forward

    monkeypatch.setattr(step_forward, "REFRESH_EVERY", 4)
    be = backend(models)
    cfg = config(be, max_steps=6)
    p = make_prompt(6)
    want = run_static(be, cfg, p)
    fake = FakeCuda(monkeypatch)
    fake.fault = leave_out_last(only=(1,))
    with pytest.warns(SiclWarning, match="reference refresh"):
        got = run_static(be, cfg, p, steps=StepCache("cpu"))
    assert_same_result(got, want)
    assert be.plan.fallback.startswith("uncaptured: the captured reference refresh's first replay")


def test_a_faulty_kernel_goes_on_through_the_torch_ops(models, monkeypatch):
    """The plan's ops are off (a proxy kernel adding 0.05): the captured step and the same step uncaptured both
    differ from the torch ops' (the backend's twin), so the run goes on through the torch ops and the math
    attention, from the state before the faulty step, and gives a clean run's numbers; the plan and the records'
    settings say impl 'torch' and why."""
    lm = models["llama"]
    be = backend(models)
    cfg = config(be, max_steps=6)
    p = make_prompt(6)
    want = run_static(make_backend("fast", lm, diff_matmul="bf16", impl="torch", attn="math"), cfg, p)
    real = be.ops.proxy_planned

    def faulty(lp, plan):
        out = real(lp, plan)
        out.f.add_(0.05)
        return out
    monkeypatch.setattr(be.ops, "proxy_planned", faulty)
    FakeCuda(monkeypatch)
    with pytest.warns(SiclWarning, match="through the torch ops"):
        got = run_static(be, cfg, p, steps=StepCache("cpu"))
    assert_same_result(got, want)
    plan = be.plan
    assert plan.impl == "torch" and plan.attention == "math" and not plan.graphs
    assert plan.fallback.startswith("torch: the captured static step's first replay f0 (the history) is off by")
    assert "and uncaptured it f0 (the history) is off by" in plan.fallback
    settings = plan_settings(plan)
    assert settings["impl"] == "torch" and settings["fallback"] == plan.fallback


def test_a_capture_that_raises_goes_on_uncaptured(models, monkeypatch):
    """The capture itself raises (as CUDA refuses an operation inside a capture): the step is kept without a graph,
    its first call checks the same step uncaptured, which matches, so the run goes on uncaptured with the uncaptured
    run's numbers, and the plan says why (before: the RuntimeError ended the run)."""
    be = backend(models)
    cfg = config(be, max_steps=6)
    p = make_prompt(6)
    want = run_static(be, cfg, p)
    fake = FakeCuda(monkeypatch)

    def refuse(ops, k):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors ...")
    fake.fault = refuse
    with pytest.warns(SiclWarning, match="the static step could not be captured"):
        got = run_static(be, cfg, p, steps=StepCache("cpu"))
    assert_same_result(got, want)
    assert be.plan.fallback == ("uncaptured: the static step could not be captured (RuntimeError: operation not "
                                "permitted when stream is capturing); uncaptured it matched the torch ops")


def test_a_kernel_that_raises_at_its_first_launch_goes_on_through_the_torch_ops(models, monkeypatch):
    """The plan's kernel raises at its first launch, the capture's warm-up (a kernel this GPU cannot run): the same
    step uncaptured raises too, so the run goes on through the torch ops and the math attention with a clean run's
    numbers (before: the error ended the run)."""
    lm = models["llama"]
    be = backend(models)
    cfg = config(be, max_steps=6)
    p = make_prompt(6)
    want = run_static(make_backend("fast", lm, diff_matmul="bf16", impl="torch", attn="math"), cfg, p)

    def broken(lp, plan):
        raise RuntimeError("out of resource: shared memory")
    monkeypatch.setattr(be.ops, "proxy_planned", broken)
    FakeCuda(monkeypatch)
    with pytest.warns(SiclWarning, match="through the torch ops"):
        got = run_static(be, cfg, p, steps=StepCache("cpu"))
    assert_same_result(got, want)
    assert be.plan.impl == "torch" and be.plan.attention == "math"
    assert be.plan.fallback == ("torch: the static step could not be captured (RuntimeError: out of resource: shared "
                                "memory), and uncaptured it failed: RuntimeError: out of resource: shared memory")


def test_a_faulty_decode_capture_goes_on_uncaptured(models, monkeypatch):
    be = make_backend("fast-fp32", models["qwen3"], impl="torch")
    X = be.embed(make_prompt(6))[:20]
    want = be.generate(X, None, 6).token_ids
    fake = FakeCuda(monkeypatch)
    fake.fault = leave_out_last()
    be.use_graphs()
    with pytest.warns(SiclWarning, match="decode step"):
        assert be.generate(X, None, 6).token_ids == want
    assert be.plan.fallback.startswith("uncaptured: the captured decode step's first replay the logits")
    assert be.decoders is None and be.generate(X, None, 6).token_ids == want


@pytest.mark.parametrize("fault", ["capture", "kernel"])
def test_a_faulty_packed_layout_falls_back(models, monkeypatch, fault):
    """The packed step's captured layout: a faulty capture goes on uncaptured (the uncaptured run's results, bit for
    bit), a faulty kernel through the torch ops (a clean run's on the torch ops and the math attention, the same
    steps and stops, the histories within 1e-3: the pass laid out again on the torch ops takes each slot's reference
    at its X of then, not at its last refresh's, as a reference the faulty ops made is not kept; measured 6.8e-5)."""
    lm = models["llama"]
    be = backend(models)
    cfg = config(be, max_steps=5, patience=0)
    items = [(make_prompt(0, seed=s), cfg.replace(seed=s)) for s in (1, 2)]
    clean = make_backend("fast", lm, diff_matmul="bf16", impl="torch", attn="math") if fault == "kernel" else be
    want = run_packed(clean, items, pack=2, sync_every=2, graphs=False)
    fake = FakeCuda(monkeypatch)
    if fault == "capture":
        fake.fault = leave_out_last()
    else:
        real = be.ops.proxy_planned
        state = {"on": False}

        def faulty(lp, plan):  # off once the layout is captured (its warm-up step ran right)
            out = real(lp, plan)
            if state["on"]:
                out.f.add_(0.05)
            return out
        monkeypatch.setattr(be.ops, "proxy_planned", faulty)
        from sicl_fast.calibration.packed import PackedStep

        capture = PackedStep.capture
        monkeypatch.setattr(PackedStep, "capture", lambda self: state.update(on=True) or capture(self))
    with pytest.warns(SiclWarning, match="packed step"):
        got = run_packed(be, items, pack=2, sync_every=2, graphs=True)
    for g, w in zip(got, want):
        if fault == "capture":
            assert_same_result(g, w)
        else:
            assert (g.steps, g.stop_reason, g.best_step) == (w.steps, w.stop_reason, w.best_step)
            torch.testing.assert_close(torch.tensor(g.history), torch.tensor(w.history), rtol=1e-3, atol=0)
    assert be.plan.fallback.startswith(("uncaptured" if fault == "capture" else "torch")
                                       + ": the captured packed step's first replay slot ")


def test_a_fallback_is_a_note_of_the_records_settings(models, tmp_path):
    """The records' settings carry the fallback; it is never a reason to refuse a resume (an 'uncaptured' one gives
    the same bits), while the impl a 'torch' one changes is."""
    from sicl_fast.formats.records import ResultWriter

    plan = backend(models).plan
    before = plan_settings(plan)
    uncaptured, torch_ops = (plan_settings(fall_back(plan, to, "why")) for to in ("uncaptured", "torch"))
    assert before["fallback"] is None and uncaptured["fallback"] == "uncaptured: why"
    assert settings_diff(uncaptured, before) == [] and settings_diff(torch_ops, before) == ["attention"]
    out = tmp_path / "r.jsonl"
    with ResultWriter(out, settings={"command": "calibrate", **before}) as w:
        w.write({"id": "a"})
        w.write({"id": "b", "settings": uncaptured})
    import json

    a, b = (json.loads(line)["settings"] for line in out.read_text().splitlines())
    assert a["fallback"] is None and b["fallback"] == "uncaptured: why" and b["command"] == "calibrate"


def test_a_resume_after_a_fallback_says_how_to_run_as_its_records_did(models):
    """A file whose records went on through the torch ops (a failed capture check) and a resume with the flags the
    run was started with: refused, naming the fallback and the flags that run as the records did (--impl, --attn,
    --attn-precision; before: only "attention "math" / "triton" ... use another --out or the same settings", and no
    flag chose the attention). A file that fell back midway holds records of both settings: no run adds to all of
    them, said once (before: each run refused by the other half's records in turn)."""
    from sicl_fast.errors import SiclError
    from sicl_fast.run.settings import check_resume

    plan = backend(models).plan
    plan = dataclasses.replace(plan, impl="triton", attention="triton", attention_precision="tf32x3")
    want = {"command": "calibrate", **plan_settings(plan)}
    fell = {"command": "calibrate", **plan_settings(fall_back(plan, "torch", "the captured static step's first "
                                                                        "replay f0 is off by 0.05"))}
    with pytest.raises(SiclError) as exc:
        check_resume([{"id": "a", "settings": fell}], want, "--out r.jsonl")
    assert str(exc.value) == (
        '--out r.jsonl: its records were made with other settings than this run\'s: attention "math" / "triton", '
        'impl "torch" / "triton" (the file\'s / this run\'s); use another --out or the settings they went on with '
        "after a failed check of a captured step (torch: the captured static step's first replay f0 is off by "
        "0.05): --impl torch --attn math --attn-precision tf32x3")
    check_resume([{"id": "a", "settings": fell}], {**want, "impl": "torch", "attention": "math"}, "--out r.jsonl")
    with pytest.raises(SiclError, match=r'^--out r.jsonl: holds records of different settings \(attention "triton" / '
                                        r'"math", impl "triton" / "torch"\); its run went on otherwise midway, after a '
                                        r"failed check of a captured step \(torch: .*\): no run's settings match them "
                                        r"all, so none adds to it; use another --out$"):
        check_resume([{"id": "a", "settings": want}, {"id": "b", "settings": fell}], want, "--out r.jsonl")
