"""The packed multi-prompt step (sicl_fast.calibration.packed): prompts of different lengths, one that gates at step 0,
slots refilled from the queue; every result equals its prompt calibrated alone (seeded, float32, plain
products, no prefix cache: the packed forward's own numerics).

Packed alone (pack=1) the result is bit for bit the prompt's own. Packed with others, the forward's products
have another row count and torch's CPU kernels (the BLAS, SDPA's blocked softmax over the padded length) may
round a last bit differently (measured: ~1e-7 relative on f, 1e-6 on hidden states), so there the histories
agree to rtol 1e-5 and the run takes the same steps, stops, best step and projections."""
import pytest
import torch

from conftest import reference_backend
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.errors import SiclError
from sicl_fast.calibration.packed import PackedStep, run_packed
from sicl_fast.calibration.static import StaticStep, run_static
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from sicl_fast.run.buckets import Bucket
from test_fast_backend import V
from test_ops import why_unavailable
from test_static import HostReadGuard, assert_same_result


def prompt_of(L: int, spans, a: int, seed: int) -> Prompt:
    g = torch.Generator().manual_seed(seed)
    return Prompt(request=Request(id=f"p{L}", prompt="x" * 100, output_spans=((10, 20),)),
                  input_ids=torch.randint(0, V, (L,), generator=g), token_spans=tuple(spans), demo_start=a,
                  demo_end=spans[-1][1])


BASE = CalibrationConfig(N=3, mu=0.05, eta=0.5, kappa=0.2, tau=0.0, patience=2, max_steps=5, scale=1.0)
ITEMS = [
    (prompt_of(48, ((14, 20), (26, 31)), 0, 1), BASE.replace(seed=1)),
    (prompt_of(23, ((5, 9), (12, 15), (17, 20)), 2, 2), BASE.replace(seed=2, estimator="central", N=2)),
    (prompt_of(35, ((8, 12), (20, 33)), 4, 3), BASE.replace(seed=3, tau=0.99)),  # gates at step 0
    (prompt_of(17, ((3, 6), (9, 12)), 0, 4), BASE.replace(seed=4, grad_mode="normalize", kappa=0.999, eta=2.0,
                                                          max_steps=4)),
]


def assert_close_result(got, ref):
    for name in ("steps", "best_step", "stop_reason", "gated", "projections"):
        assert getattr(got, name) == getattr(ref, name), name
    torch.testing.assert_close(torch.tensor(got.history), torch.tensor(ref.history), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got.embeddings, ref.embeddings, rtol=0, atol=1e-4)


@pytest.mark.parametrize("attn", ["math", "sdpa"])
@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_equals_one_by_one(models, family, impl, attn):
    if why_unavailable(impl):
        pytest.skip(why_unavailable(impl))
    be = reference_backend("fast", models[family], attn=attn, diff_matmul="off", prefix_cache=False, impl=impl)
    refs = [Calibrator(be, cfg).run(p) for p, cfg in ITEMS]
    for g, r in zip(run_packed(be, ITEMS, pack=1), refs):
        assert_same_result(g, r)
    assert refs[2].gated and len({p.length for p, _ in ITEMS}) == 4
    for pack, k in ((2, 1), (4, 3), (3, 2)):
        got = [None] * len(ITEMS)
        assert run_packed(be, ITEMS, pack=pack, sync_every=k, on_result=got.__setitem__) == []
        for g, r in zip(got, refs):
            assert_close_result(g, r)


def test_packed_arguments(models):
    be = reference_backend("fast", models["llama"], diff_matmul="off")
    with pytest.raises(SiclError, match="pack must be >= 1, got 0"):
        run_packed(be, ITEMS, pack=0)
    with pytest.raises(SiclError, match="packed step needs the fast backend"):
        run_packed(reference_backend("hf", models["llama"]), ITEMS, pack=2)


def test_packed_time_budget_and_best_at(models):
    """Each slot's time budget from its own start, checked at each read (0: the first read), and its best X kept
    after given step counts: equal to the prompt's eager run stopped there (pack 1: bit for bit)."""
    be = reference_backend("fast", models["llama"], diff_matmul="off", prefix_cache=False, impl="torch")
    items = [(p, cfg.replace(patience=0)) for p, cfg in ITEMS]
    got = run_packed(be, items, pack=1, sync_every=2, time_budget_s=0, best_at=[1, 3])
    for (p, cfg), res in zip(items, got):
        ref = Calibrator(be, cfg.replace(max_steps=1)).run(p)
        if cfg.tau > 0.5:  # the gate stops it first
            assert res.stop_reason == "gate" and res.best_at == {}
            continue
        assert res.stop_reason == "time_budget" and res.steps == 1  # the read lands on step count 1
        # (projections aside: the static step made step 0's update before the read stopped it)
        assert res.history == ref.history and res.best_step == ref.best_step
        assert torch.equal(res.embeddings, ref.embeddings)
        assert list(res.best_at) == [1] and torch.equal(res.best_at[1][1], ref.embeddings)
    got = run_packed(be, items, pack=3, sync_every=4, best_at=[1, 3])
    for (p, cfg), res in zip(items, got):
        for n, (best_step, X) in res.best_at.items():
            ref = Calibrator(be, cfg.replace(max_steps=n)).run(p)
            assert best_step == ref.best_step
            torch.testing.assert_close(X, ref.embeddings, rtol=0, atol=1e-4)
        assert sorted(res.best_at) == ([] if res.gated else [1, 3])
    with pytest.raises(SiclError, match="run_packed: time_budget_s must be >= 0.0"):
        run_packed(be, items, pack=2, time_budget_s=-0.5)


@pytest.mark.parametrize("pack,k", [(1, 1), (1, 2), (2, 1), (3, 2)])
def test_packed_time_budget_follows_the_clock(models, monkeypatch, pack, k):
    """A clock that moves one second a packed step (test_static's fake clock): each slot's budget of 2.5 s, from
    its own start (a slot refilled later starts later), stops it at the first read at or after 2.5 s: 3 steps when
    reading every step, 4 when every second; equal to the prompt's eager run stopped there."""
    from sicl_fast.calibration.packed import PackedStep
    from test_static import fake_clock

    be = reference_backend("fast", models["llama"], diff_matmul="off", prefix_cache=False, impl="torch")
    items = [(p, cfg.replace(patience=0, max_steps=10)) for p, cfg in ITEMS]
    clock = fake_clock(monkeypatch)
    step = PackedStep.__call__

    def timed(self):
        step(self)
        clock[0] += 1.0

    monkeypatch.setattr(PackedStep, "__call__", timed)
    got = run_packed(be, items, pack=pack, sync_every=k, time_budget_s=2.5)
    steps = 3 if k == 1 else 4
    for (p, cfg), res in zip(items, got):
        if cfg.tau > 0.5:  # the gate stops it at its first read
            assert res.stop_reason == "gate" and res.steps == 1
            continue
        assert res.stop_reason == "time_budget" and res.steps == steps
        ref = Calibrator(be, cfg.replace(max_steps=steps)).run(p)
        assert res.best_step == ref.best_step  # (projections aside: the update before the read, as above)
        if pack == 1:
            assert res.history == ref.history and torch.equal(res.embeddings, ref.embeddings)
        else:
            torch.testing.assert_close(torch.tensor(res.history), torch.tensor(ref.history), rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(res.embeddings, ref.embeddings, rtol=0, atol=1e-4)


@pytest.mark.parametrize("pack", [1, 3])
def test_packed_min_delta_equals_eager(models, pack):
    """min_delta and min_delta_rel in the packed step: patience counts from the last step that beat its anchor by
    the margin, as in the eager loop (pack 1: bit for bit), and the margins make patience stop where the paper's
    rule goes on."""
    be = reference_backend("fast", models["llama"], diff_matmul="off", prefix_cache=False, impl="torch")
    paper = [(p, cfg.replace(patience=2, max_steps=12, tau=0.0)) for p, cfg in ITEMS]
    margins = [(p, cfg.replace(**({"min_delta": 1e-5} if i % 2 else {"min_delta_rel": 8e-3})))
               for i, (p, cfg) in enumerate(paper)]
    refs = [Calibrator(be, cfg).run(p) for p, cfg in margins]
    got = run_packed(be, margins, pack=pack, sync_every=2)
    for g, r in zip(got, refs):
        (assert_same_result if pack == 1 else assert_close_result)(g, r)
    steps_paper = [Calibrator(be, cfg).run(p).steps for p, cfg in paper]
    assert any(r.stop_reason == "patience" and r.steps < n for r, n in zip(refs, steps_paper)), (
        [r.steps for r in refs], steps_paper)


# ------------------------------------------------------------------------- the difference form, slots that change


def rows_backend(lm, **choices):
    """The difference form without the prefix cache, on the C++ ops (their products give the same bits packed or
    alone here; the torch reference's bf16 products over more rows moved a history by up to 2.5e-3)."""
    if why_unavailable("cpp"):
        pytest.skip(why_unavailable("cpp"))
    return reference_backend("fast", lm, diff_matmul="bf16", prefix_cache=False, impl="cpp", **choices)


def test_packed_difference_form_equals_the_static_step(models):
    """Difference products: a slot packed alone is the prompt's static run (prefix 'none') bit for bit, its reference
    refreshed at its own 16th step as there (beside others, within rounding: the next tests)."""
    be = rows_backend(models["gemma2"])
    items = [(p, cfg.replace(max_steps=18, patience=0)) for p, cfg in ITEMS]
    refs = [run_static(be, cfg, p) for p, cfg in items]
    for g, r in zip(run_packed(be, items, pack=1, sync_every=4), refs):
        assert_same_result(g, r)


def test_a_slot_that_changes_makes_its_own_reference_only(models, monkeypatch):
    """Every prompt's reference is made once, when it takes its slot (no step of its own makes one): a slot that
    changes leaves the others' references as they were, in place or copied where a longer prompt lays the pass out
    again; the step (what a graph captures) reads nothing back to the host."""
    be = rows_backend(models["llama"])
    made = []
    reference_rows = be.model.reference_rows
    monkeypatch.setattr(be.model, "reference_rows", lambda x, *a, **k: made.append(x.shape[0]) or
                        reference_rows(x, *a, **k))
    items = [(p, cfg.replace(max_steps=6)) for p, cfg in ITEMS]  # no refresh (every 16 steps)
    run_packed(be, items, pack=2, sync_every=2)
    assert sorted(made) == sorted(p.demo_end for p, _ in items)
    cfg = Calibrator(be, BASE).config
    slots = [StaticStep(be, cfg, p, be.embed(p), use_prefix=False, own_forward=False) for p, _ in ITEMS[:3]]
    step = PackedStep(be, slots)
    step()
    for new, layout in ((ITEMS[3][0], False), (prompt_of(60, ((20, 25), (50, 56)), 0, 9), True)):  # b 31, then 56
        fwd = step.forward
        before = [fwd.ref.rows(j * fwd.T, j * fwd.T + fwd.spans[j].b).tensors() for j in (0, 2)]
        before = [[t.clone() for t in ts] for ts in before]
        z = [fwd.z_refs[j] for j in (0, 2)]
        made.clear()
        slots[1] = StaticStep(be, cfg, new, be.embed(new), use_prefix=False, own_forward=False)
        assert step.set(slots) and (fwd.T == 56) == layout
        assert made == [new.demo_end]
        for j, ts, zj in zip((0, 2), before, z):
            now = fwd.ref.rows(j * fwd.T, j * fwd.T + fwd.spans[j].b).tensors()
            assert all(torch.equal(a, b) for a, b in zip(now, ts)) and fwd.z_refs[j] is zj
        step()
    with HostReadGuard(monkeypatch):  # what a graph captures reads nothing back (the guard undoes the spy)
        step.step()


def test_prompts_of_one_shape_are_loaded_in_place_and_captured(models, monkeypatch):
    """With length buckets, a prompt of the stopped slot's shape (config, prefix rows, span count, bucket) takes that
    slot's tensors in place: the pack keeps its layout and, with graphs, its one capture (made once the layout went
    through a read interval unchanged, its warm-up; none while the queue's tail shrinks the pack). The capture off
    CUDA is the step itself: the results are the uncaptured run's, and each prompt's own padded run's within
    rounding."""
    from fake_graphs import FakeCuda
    from sicl_fast.calibration import packed
    from sicl_fast.calibration.static import StepCache

    be = rows_backend(models["llama"], length_buckets=4)
    cfg = BASE.replace(max_steps=9, patience=1)
    items = [(prompt_of(L, ((8, 12), (L - 9, L - 4)), 3, L), cfg) for L in (37, 39, 41, 44, 38)]
    assert len({Bucket.of(p, 4) for p, _ in items}) == 1
    built, captures = [], []
    init = StaticStep.__init__
    monkeypatch.setattr(StaticStep, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    FakeCuda(monkeypatch)  # graphs captured on the CPU: their owner's capture spied (the step itself runs)
    monkeypatch.setattr(packed.Captures, "capture", lambda self, fn, **kw: captures.append(kw["warmup"]) or fn)
    plain = run_packed(be, items, pack=2, sync_every=2, graphs=False)
    assert len(built) == 2 and captures == []  # two slots' steps, every later prompt loaded into one of them
    got = run_packed(be, items, pack=2, sync_every=2, graphs=True)
    assert captures == [0]
    for g, r, (p, c) in zip(got, plain, items):
        assert_same_result(g, r)
        assert_close_result(g, run_static(be, c, p, steps=StepCache("cpu", buckets=4, graphs=False)))


def test_a_captured_layouts_refreshes_are_one_launch_a_slot(models, monkeypatch):
    """In a captured layout (the capture faked: tests/fake_graphs.py) each slot's reference refresh is a graph of its
    own after its first, which was eager (its warm-up): a step where both slots refresh launches the step's graph
    and one graph a slot, where the eager refreshes launch over a hundred kernels each (three decoder layers here;
    394 at SmolLM2, bench/RESULTS.md section 30); the run is the uncaptured one's bit for bit."""
    from fake_graphs import FakeCuda
    from sicl_fast.backends import make_backend
    from sicl_fast.diagnostics.kernel_count import count_kernels
    from sicl_fast.run.graphs import Captures

    be = make_backend("fast", models["llama"], diff_matmul="bf16", impl="torch")
    cfg = BASE.replace(max_steps=16, patience=0)
    ps = [prompt_of(L, ((5, 9), (12, L - 3)), 2, L) for L in (20, 26)]

    def packed(captures):
        slots = [StaticStep(be, cfg, p, be.embed(p), use_prefix=False, own_forward=False) for p in ps]
        step = PackedStep(be, slots, captures=captures)
        step.forward.refresh_every = 4  # REFRESH_EVERY's 16, sooner
        step()  # the layout's warm-up
        step.capture()
        return step, slots
    plain, plain_slots = packed(None)
    fake = FakeCuda(monkeypatch)
    step, slots = packed(Captures("cpu"))
    counts = {}
    for k in range(1, 14):  # the slots' steps 1 .. 13 (0 was the warm-up): both refresh before 4, 8 and 12
        plain()
        if k in (4, 11, 12, 13):
            counts[k] = count_kernels(step)
        else:
            step()
    # 4: eager (each slot's first in the layout), then captured; 8: their first replays, checked (run.graphs:
    # first_replay); 12: replays
    assert counts[12] == 3 and counts[11] == counts[13] == 1  # the step's graph and a graph a slot
    assert len(step.refreshes) == 2 and fake.hazards == []
    for st, ref in zip(slots, plain_slots):
        assert torch.equal(st.state.X, ref.state.X)
        torch.testing.assert_close(st.state.history, ref.state.history, rtol=0, atol=0, equal_nan=True)
    eager_refresh = count_kernels(lambda: plain.forward.refresh(0, plain_slots[0].state.X))
    assert counts[4] > 2 * eager_refresh > 200  # eager (each slot's first in the layout), then captured
