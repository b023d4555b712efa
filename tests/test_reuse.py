"""Calibrate once, answer many (sicl_fast.answering.reuse): the closed-form minimum of the whole-matrix cosine, reuse
bit for bit equal to a per-query calibration wherever it is exact (every loop, estimator, scope and implementation), the
approximate case said so (`on`) or calibrated per query (`auto`), the tokenisation boundary, runs stopped early
never stored, the disk store shared by two engines, and answers from a stored calibration. A tiny random-weight
Llama with SmolLM2's tokenizer."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sicl_fast import Engine, load
from sicl_fast.errors import SiclError
from sicl_fast.ops import IMPLS
from sicl_fast.answering.reuse import EXACT_MARGIN, ReusedResult, min_whole_cosine

BASE = dict(max_steps=4, tau=0.0, patience=0, N=4, seed=3)
# the projection fires: every demonstration row moves by 5 embedding scales a step, against a cosine floor of 0.9
FIRES = dict(BASE, eta=5.0, kappa=0.9, grad_mode="normalize")


def request(query: str, rid: str | None = None) -> dict:
    return {"id": rid or query, "instruction": "Write each number word as a digit.",
            "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"},
                      {"input": "three", "output": "3"}], "query": query}


@pytest.fixture(scope="module")
def engine(tiny_llama, one_thread):
    return Engine(tiny_llama)


def own(engine, prompt, **cfg):
    """The prompt's own calibration, no store."""
    return engine.calibrate(prompt, reuse="off", **cfg)


def assert_same(got, ref) -> None:
    assert torch.equal(got.embeddings, ref.embeddings)
    for f in ("initial_proxy", "best_proxy", "steps", "best_step", "gated", "stop_reason", "history", "projections"):
        assert getattr(got, f) == getattr(ref, f), f


def test_min_whole_cosine_is_the_minimum_over_every_query_norm():
    g = torch.Generator().manual_seed(0)
    qs = torch.cat([torch.zeros(1), torch.logspace(-4, 4, 4000, dtype=torch.float64)])
    for _trial in range(200):
        x0 = torch.randn(30, generator=g, dtype=torch.float64)
        x = x0 * (0.05 + 3 * torch.rand(1, generator=g, dtype=torch.float64)) \
            + torch.randn(30, generator=g, dtype=torch.float64) * torch.rand(1, generator=g, dtype=torch.float64)
        u, a, c = x @ x0, x @ x, x0 @ x0
        brute = ((u + qs) / torch.sqrt((a + qs) * (c + qs))).min()
        got = min_whole_cosine(u, a, c)
        assert got <= brute + 1e-12  # never above the true minimum (it would call an inexact run exact)
        assert got >= brute - 1e-4  # and it is the minimum, up to the grid's resolution
    x0 = torch.randn(8, dtype=torch.float64)
    assert float(min_whole_cosine(x0 @ x0, x0 @ x0, x0 @ x0)) == pytest.approx(1.0)  # X = X0


def test_the_minimum_can_lie_below_the_query_free_cosine():
    """a and c far apart: a query of the right size lowers the cosine below the stem's own (q* > 0)."""
    x0 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    x = torch.tensor([10.0, 3.0], dtype=torch.float64)
    u, a, c = x @ x0, x @ x, x0 @ x0
    assert float(min_whole_cosine(u, a, c)) < float(u / (a * c).sqrt()) - 0.05


@pytest.mark.parametrize("loop", ["static", "eager"])
@pytest.mark.parametrize("cfg", [dict(BASE), dict(BASE, projection_scope="demos"), dict(BASE, estimator="central"),
                                 dict(BASE, tau=2.0)], ids=["prompt", "demos", "central", "gated"])
def test_exact_reuse_is_bit_for_bit_a_per_query_calibration(tiny_llama, one_thread, loop, cfg):
    eng = Engine(tiny_llama, loop=loop, impl="torch")
    first, second = eng.prepare(request("five")), eng.prepare(request("twenty-one thousand and six"))
    a = eng.calibrate(first, reuse="auto", **cfg)
    assert isinstance(a, ReusedResult) and (a.reuse, a.reused, a.exact) == ("fresh", False, True)
    assert_same(a, own(eng, first, **cfg))
    b = eng.calibrate(second, reuse="auto", **cfg)
    assert (b.reuse, b.reused, b.exact, b.key) == ("hit", True, True, a.key) and b.steps == a.steps
    assert_same(b, own(eng, second, **cfg))
    if cfg.get("projection_scope") != "demos" and cfg["tau"] < 1:
        assert a.calibration.min_cosine >= 0.2 + EXACT_MARGIN  # watched, and far from the floor
    on = Engine(tiny_llama, loop=loop, impl="torch")  # 'on': a miss calibrates rows [0, b) alone
    c = on.calibrate(second, reuse="on", **cfg)
    assert (c.reuse, c.exact) == ("fresh", True)
    assert_same(c, own(eng, second, **cfg))


@pytest.mark.parametrize("impl", [i for i in IMPLS if i not in ("auto", "torch")])
def test_exact_reuse_bit_for_bit_with_other_implementations(tiny_llama, one_thread, impl):
    from test_ops import why_unavailable

    if (why := why_unavailable(impl)) is not None:
        pytest.skip(why)
    eng = Engine(tiny_llama, impl=impl)
    first, second = eng.prepare(request("five")), eng.prepare(request("eleven"))
    cfg = dict(BASE, max_steps=2) if impl == "triton" else BASE  # triton: interpreted on the CPU, slow
    eng.calibrate(first, reuse="on", **cfg)
    b = eng.calibrate(second, reuse="on", **cfg)
    assert (b.reuse, b.exact) == ("hit", True)
    assert_same(b, own(eng, second, **cfg))


def test_a_fired_projection_is_approximate_under_on_and_per_query_under_auto(engine):
    first, second = engine.prepare(request("five")), engine.prepare(request("eleven"))
    ref = own(engine, second, **FIRES)
    assert ref.projections > 0
    on = engine.calibrate(first, reuse="on", **FIRES)  # rows [0, b) alone: the stem's own projection fires too
    # the projection put X on the cosine floor kappa 0.9 (to float64 rounding of the projected matrix's cosine)
    assert (on.reuse, on.exact) == ("fresh", False) and on.calibration.min_cosine < 0.9 + 1e-6
    approx = engine.calibrate(second, reuse="on", **FIRES)
    assert (approx.reuse, approx.reused, approx.exact) == ("hit", True, False)
    assert not torch.equal(approx.embeddings, ref.embeddings)  # it is an approximation, and says so
    auto = engine.calibrate(second, reuse="auto", **FIRES)  # auto never answers from an inexact calibration
    assert (auto.reuse, auto.reused, auto.exact) == ("per-query", False, True)
    assert_same(auto, ref)
    again = engine.calibrate(second, reuse="auto", **FIRES)  # its own calibration was kept: a rerun is a hit
    assert (again.reuse, again.reused) == ("per-query", True)
    assert_same(again, ref)


def test_auto_miss_with_a_fired_projection_stores_no_stem(tiny_llama, one_thread):
    eng = Engine(tiny_llama)
    first, second = eng.prepare(request("five")), eng.prepare(request("eleven"))
    a = eng.calibrate(first, reuse="auto", **FIRES)
    assert (a.reuse, a.exact) == ("per-query", True) and a.calibration.scope == "prompt"
    assert_same(a, own(eng, first, **FIRES))
    b = eng.calibrate(second, reuse="auto", **FIRES)
    assert (b.reuse, b.reused) == ("per-query", False)
    assert_same(b, own(eng, second, **FIRES))


def test_perturbing_the_query_is_never_shared(engine):
    cfg = dict(BASE, perturb_query=True)
    p = engine.prepare(request("five"))
    r = engine.calibrate(p, reuse="on", **cfg)
    assert (r.reuse, r.key) == ("per-query", None)
    assert_same(r, own(engine, p, **cfg))


def test_a_query_that_changes_the_boundary_tokens_is_calibrated_afresh(engine):
    """A raw prompt whose query continues the last output's word: BPE merges them into one token."""
    text = "Complete the word.\n\nInput: gree\nOutput: ting\n\nInput: hel\nOutput: hel"
    start = text.index("Output: ting") + len("Output: ")
    spans = [[start, start + 4], [len(text) - 3, len(text)]]
    plain = engine.prepare({"id": "plain", "prompt": text, "output_spans": spans})
    merged = engine.prepare({"id": "merged", "prompt": text + "lo", "output_spans": spans})
    assert not torch.equal(merged.input_ids[:plain.demo_end], plain.input_ids[:plain.demo_end]) \
        or merged.demo_end != plain.demo_end  # the premise: the query changed rows [0, b)
    engine.calibrate(plain, reuse="auto", **BASE)
    r = engine.calibrate(merged, reuse="auto", **BASE)
    assert (r.reuse, r.reused, r.exact) == ("boundary", False, True)
    assert_same(r, own(engine, merged, **BASE))
    with pytest.raises(SiclError, match="calibrate it"):
        engine.answer(engine.calibrate(plain, reuse="on", **BASE), merged)


def test_a_run_stopped_from_outside_is_not_stored(tiny_llama, one_thread):
    eng = Engine(tiny_llama)
    p = eng.prepare(request("five"))
    cut = eng.calibrate(p, reuse="auto", should_stop=lambda: "deadline", **BASE)
    assert cut.stop_reason == "deadline" and cut.calibration is None and len(eng.store.memory) == 0
    whole = eng.calibrate(p, reuse="auto", **BASE)
    assert whole.reuse == "fresh" and whole.stop_reason == "max_steps"


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_calibration_that_fell_back_midway_is_stored_under_the_plan_it_ended_on(tiny_llama, one_thread, mode,
                                                                                 monkeypatch):
    """A captured step that fails its check midway switches the run to the torch ops (FastBackend.fall_back): the
    calibration's bits are the torch ops', so the store keeps it under the key of that plan, never under the key
    looked up before the run (before: under it, and a process without the fault was served the torch ops' rows as
    its own, exact)."""
    from sicl_fast.errors import SiclWarning

    eng = Engine(tiny_llama, impl="cpp")
    p = eng.prepare(request("five"))
    cfg = eng.reuser.resolve(eng.config(**BASE))
    before = eng.reuser.key(p, cfg)
    run = eng.run

    def falls_back(*a, **k):
        eng.backend.fall_back("torch", "the captured static step's first replay f0 is off by 0.05")
        return run(*a, **k)
    monkeypatch.setattr(eng, "run", falls_back)
    with pytest.warns(SiclWarning, match="through the torch ops"):
        got = eng.calibrate(p, reuse=mode, **BASE)
    after = eng.reuser.key(p, cfg)
    assert after != before and eng.store.peek(before) is None
    assert eng.store.peek(after) is got.calibration and got.calibration.impl == "torch"


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_waiter_stops_by_its_own_time_budget(tiny_llama, one_thread, mode):
    """A query whose calibration another thread has in flight waits for it no longer than its own time budget: it
    then ends as its own calibration with that budget would (one step, stop_reason 'time_budget', nothing stored),
    while the other still runs."""
    import threading

    eng = Engine(tiny_llama)
    p = eng.prepare(request("five"))
    key = eng.reuser.key(p, eng.reuser.resolve(eng.config(**BASE)))
    release, holding = threading.Event(), threading.Event()
    leader = threading.Thread(target=lambda: eng.store.flight.run(key, lambda: (holding.set(), release.wait(60))),
                              daemon=True)
    leader.start()
    assert holding.wait(30)
    out = []
    try:
        waiter = threading.Thread(target=lambda: out.append(eng.calibrate(p, reuse=mode, time_budget_s=0.2, **BASE)))
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive() and leader.is_alive(), "the waiter waited for the leader"
    finally:
        release.set()
        leader.join(30)
    res = out[0]
    assert (res.stop_reason, res.steps, res.reused) == ("time_budget", 1, False) and eng.store.stats["gave_up"] == 1
    assert len(eng.store.memory) == 0
    ref = eng.calibrate(p, reuse="off", **dict(BASE, max_steps=1))
    assert res.history == ref.history and torch.equal(res.embeddings, ref.embeddings)


def test_two_engines_share_a_store_directory(tiny_llama, one_thread, tmp_path):
    a = Engine(tiny_llama, store_dir=str(tmp_path))
    ra = a.calibrate(a.prepare(request("five")), reuse="auto", **BASE)
    b = Engine(tiny_llama, store_dir=str(tmp_path))  # another engine (process): nothing in its memory
    second = b.prepare(request("eleven"))
    rb = b.calibrate(second, reuse="auto", **BASE)
    assert (rb.reuse, rb.key) == ("hit", ra.key) and b.store.stats["disk_reads"] == 1
    assert_same(rb, own(b, second, **BASE))


DAMAGES = {  # an entry resealed with valid checksums whose content is not what its key serves (issue 48, defect 6)
    "nan": lambda c: replace(c, rows=c.rows.clone().index_fill_(0, torch.tensor([1]), float("nan"))),
    "short": lambda c: replace(c, rows=c.rows[:-1].clone(), input_ids=c.input_ids[:-1].clone()),
    "width": lambda c: replace(c, rows=c.rows[:, :16].clone()),
    "ids": lambda c: replace(c, input_ids=c.input_ids.clone().index_add_(0, torch.tensor([2]), torch.tensor([1]))),
}


@pytest.fixture(scope="module")
def stored(tiny_llama, one_thread, tmp_path_factory):
    """A store directory holding the calibration of request('five')'s stem, and request('eleven')'s own calibration
    (which a reuse of that stem must equal)."""
    root = tmp_path_factory.mktemp("stored")
    eng = Engine(tiny_llama, store_dir=str(root))
    cfg = dict(BASE, max_steps=2)
    key = eng.calibrate(eng.prepare(request("five")), reuse="auto", **cfg).key
    return root, key, cfg, own(eng, eng.prepare(request("eleven")), **cfg)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_an_entry_that_is_not_what_its_key_serves_is_corrupt(tiny_llama, stored, tmp_path, damage):
    """Before: a NaN in the rows was a hit (and an empty answer), one row short of demo_end was served, another width
    or a changed token id failed every later run. Now each is a corrupt entry: warned, moved to corrupt/, recomputed
    (the same result as the prompt's own calibration), and the next engine hits the good entry."""
    import shutil

    from sicl_fast.errors import SiclWarning

    root, key, cfg, ref = stored
    shutil.copytree(root, tmp_path / "s")
    eng = Engine(tiny_llama, store_dir=str(tmp_path / "s"))  # another process's view: nothing in its memory
    with eng.store.disk.lock(key):
        eng.store.disk.write(DAMAGES[damage](eng.store.disk.read(key)))
    with pytest.warns(SiclWarning, match=f"entry {key} is corrupt \\(it holds "):
        res = eng.calibrate(eng.prepare(request("eleven")), reuse="auto", **cfg)
    assert (res.reuse, res.reused) == ("fresh", False) and len(list((tmp_path / "s" / "corrupt").iterdir())) == 2
    assert_same(res, ref)
    again = Engine(tiny_llama, store_dir=str(tmp_path / "s"))
    assert again.calibrate(again.prepare(request("twelve")), reuse="auto", **cfg).reuse == "hit"


def test_a_store_directory_alone_means_reuse(tiny_llama, one_thread, tmp_path):
    """#40: Engine(store_dir=...) without reuse= never wrote to the store (reuse defaulted to 'off'), while
    docs/store.md presented store_dir as enough; a store given now means reuse 'auto' unless reuse= says otherwise,
    and a store with pack > 1 (which never uses it) is refused."""
    eng = Engine(tiny_llama, store_dir=str(tmp_path / "sd"))
    assert eng.plan.reuse == "auto" and Engine(tiny_llama).plan.reuse == "off"
    res = eng.calibrate(eng.prepare(request("five")), **BASE)
    assert (res.reuse, res.exact) == ("fresh", True) and len(list((tmp_path / "sd" / "entries").rglob("*.json"))) == 1
    assert Engine(tiny_llama, store_dir=str(tmp_path / "sd"), reuse="off").plan.reuse == "off"
    with pytest.raises(SiclError, match="a store with pack 2 is not used"):
        Engine(tiny_llama, store_dir=str(tmp_path / "other"), pack=2)
    assert not (tmp_path / "other").exists()  # refused before the store made its folders


def test_the_key_holds_the_attention_kernel_and_not_the_loop(tiny_llama, one_thread):
    """Engines that differ only in their attention kernel compute other bits, so a shared store must not serve one's
    calibration to the other; engines that differ only in the loop compute the same bits and share it."""
    from sicl_fast.store import CalibrationStore

    store = CalibrationStore()
    math, sdpa, eager = (Engine(tiny_llama, attn=a, loop=lp, sync_every=3, store=store)
                         for a, lp in (("math", "static"), ("sdpa", "static"), ("math", "eager")))
    p = math.prepare(request("five"))
    runs = [eng.calibrate(p, reuse="auto", **BASE) for eng in (math, sdpa, eager)]
    assert [r.reuse for r in runs] == ["fresh", "fresh", "hit"]
    assert runs[0].key != runs[1].key and runs[2].key == runs[0].key
    assert math.reuser.fingerprint["attention"] == "math" and sdpa.reuser.fingerprint["attention"] == "sdpa"
    assert_same(runs[1], own(sdpa, p, **BASE))


def test_the_key_holds_the_model_s_weights_not_its_name(tiny_llama, one_thread):
    """Issue 54, item 4 (defect 3's pattern in the store): the same weights under another name (a model loaded by
    name and then by its own path, or through a link) compute the same bits, so an engine on it is served the
    other's calibration from a shared store (481e2be: the name was part of the key, a miss)."""
    import dataclasses

    from sicl_fast.store import CalibrationStore

    store = CalibrationStore()
    first, renamed = (Engine(lm, store=store) for lm in (tiny_llama, dataclasses.replace(tiny_llama, name="renamed")))
    p = first.prepare(request("five"))
    runs = [eng.calibrate(p, reuse="auto", **BASE) for eng in (first, renamed)]
    assert [r.reuse for r in runs] == ["fresh", "hit"] and runs[0].key == runs[1].key
    assert "model" not in first.reuser.fingerprint


def test_the_key_holds_the_cpu_thread_count_and_the_platform(tiny_llama, one_thread):
    """On the CPU another thread count moves float32 sums in their last bits (SmolLM2's proxy history differs
    between 1 and 2 threads), so engines that share a store but not their thread count do not share entries: each
    is served only what it computes itself. The fingerprint also names torch's version and the CPU's vector
    capability, which pick the kernels."""
    from sicl_fast.store import CalibrationStore

    store = CalibrationStore()
    one, two, again = (Engine(tiny_llama, threads=t, store=store) for t in (1, 2, 1))
    p = one.prepare(request("five"))
    runs = [eng.calibrate(p, reuse="auto", **BASE) for eng in (one, two, again)]
    assert [r.reuse for r in runs] == ["fresh", "fresh", "hit"] and runs[0].key != runs[1].key
    fp = one.reuser.fingerprint
    assert (fp["threads"], two.reuser.fingerprint["threads"]) == (1, 2)
    assert fp["platform"] == {"torch": torch.__version__, "hardware": torch.backends.cpu.get_cpu_capability()}


def test_answers_from_a_stored_calibration(engine):
    queries = [request(q) for q in ("five", "nine", "a hundred and two")]
    cal = engine.calibrate(engine.prepare(queries[0]), reuse="auto", **BASE).calibration
    got = engine.answer_many(cal, queries, max_new_tokens=6)
    for q, g in zip(queries, got):
        p = engine.prepare(q, reserve=6)
        ref = engine.generate(p, own(engine, p, **BASE).embeddings, max_new_tokens=6)
        assert g.token_ids == ref.token_ids and g.answer == ref.answer
        assert engine.answer(cal, p, max_new_tokens=6).token_ids == ref.token_ids
    with pytest.raises(SiclError, match="stored Calibration"):
        engine.answer(object(), queries[0])


def test_bad_reuse_mode(tiny_llama, engine):
    with pytest.raises(SiclError, match="reuse"):
        Engine(tiny_llama, reuse="always")
    with pytest.raises(SiclError, match="reuse"):
        engine.calibrate(engine.prepare(request("five")), reuse="yes", **BASE)


def read_jsonl(path) -> list[dict]:
    import json

    return [json.loads(x) for x in path.read_text().splitlines()]


def write_jsonl(path, objs) -> str:
    import json

    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


CLI_FAST = ["--max-steps", "3", "--N", "4", "--tau", "0", "--patience", "0", "--seed", "3"]


def test_cli_groups_requests_by_key_and_calibrates_each_group_once(tiny_dir, tmp_path, capsys, monkeypatch):
    import sicl_fast.answering.answer as answer
    from sicl_fast.commands.cli import main

    batches = []  # the query-only decodings: one batch per group (Engine.answer_many), not one per request
    real = answer.decode_queries
    monkeypatch.setattr(answer, "decode_queries", lambda be, cal, prompts, *a, **k: (
        batches.append(len(prompts)), real(be, cal, prompts, *a, **k))[1])

    other = {"id": "o", "demos": [{"input": "red", "output": "rot"}], "query": "blue"}
    reqs = [request("five", "a"), {**other, "id": "o1"}, request("nine", "b"), {**other, "id": "o2",
                                                                                "query": "green"},
            request("twelve", "c")]
    path = write_jsonl(tmp_path / "r.jsonl", reqs)
    model = ["--model", tiny_dir]
    out, off = tmp_path / "auto.jsonl", tmp_path / "off.jsonl"
    assert main(["calibrate", path, "--out", str(out), "--generate", "--max-new-tokens", "3", *model, *CLI_FAST]) == 0
    assert main(["calibrate", path, "--out", str(off), "--generate", "--max-new-tokens", "3", "--reuse", "off",
                 *model, *CLI_FAST]) == 0
    got = {r["id"]: r for r in read_jsonl(out)}
    ref = {r["id"]: r for r in read_jsonl(off)}
    assert batches == [3, 2]
    assert [r["id"] for r in read_jsonl(out)] == ["a", "b", "c", "o1", "o2"]  # one group after the other
    assert [got[i]["reuse"] for i in "abc"] == ["fresh", "hit", "hit"] and got["o2"]["reuse"] == "hit"
    assert len({got[i]["key"] for i in "abc"}) == 1 and got["o1"]["key"] != got["a"]["key"]
    assert all(r["exact"] for r in got.values()) and ref["a"]["reuse"] == "off"  # every record says (issue 48)
    for i, r in got.items():  # the same numbers and answers as calibrating every request
        for k in ("initial_proxy", "best_proxy", "steps", "best_step", "stop_reason", "answer_calibrated"):
            assert r[k] == ref[i][k], (i, k)
    capsys.readouterr()
    assert main(["calibrate", path, "--out", str(tmp_path / "x.jsonl"), "--pack", "2", "--reuse", "on", *model]) == 2
    assert "reuse 'on' with pack 2: packed calibration does not use the store" in capsys.readouterr().err


def test_cli_records_a_boundary_query_as_calibrated_afresh(tiny_dir, tmp_path):
    """The raw prompts of test_a_query_that_changes_the_boundary_tokens_is_calibrated_afresh through the command
    line: the record of the query whose BPE merge changes rows [0, b) says reuse 'boundary', and its numbers are its
    own calibration's."""
    from sicl_fast.commands.cli import main

    text = "Complete the word.\n\nInput: gree\nOutput: ting\n\nInput: hel\nOutput: hel"
    start = text.index("Output: ting") + len("Output: ")
    spans = [[start, start + 4], [len(text) - 3, len(text)]]
    reqs = [{"id": "plain", "prompt": text, "output_spans": spans},
            {"id": "merged", "prompt": text + "lo", "output_spans": spans}]
    path = write_jsonl(tmp_path / "r.jsonl", reqs)
    for name, flags in (("auto", []), ("off", ["--reuse", "off"])):
        assert main(["calibrate", path, "--out", str(tmp_path / f"{name}.jsonl"), "--model", tiny_dir, *CLI_FAST,
                     *flags]) == 0
    got = {r["id"]: r for r in read_jsonl(tmp_path / "auto.jsonl")}
    ref = {r["id"]: r for r in read_jsonl(tmp_path / "off.jsonl")}
    assert (got["merged"]["reuse"], got["merged"]["reused"], got["merged"]["exact"]) == ("boundary", False, True)
    assert got["merged"]["best_proxy"] == ref["merged"]["best_proxy"]
    assert got["merged"]["steps"] == ref["merged"]["steps"] and got["merged"]["key"] != got["plain"]["key"]


def test_cli_store_directory_serves_a_rerun(tiny_dir, tmp_path):
    from sicl_fast.commands.cli import main

    path = write_jsonl(tmp_path / "r.jsonl", [request("five", "a"), request("nine", "b")])
    store = ["--store", str(tmp_path / "store"), "--model", tiny_dir, *CLI_FAST]
    assert main(["calibrate", path, "--out", str(tmp_path / "1.jsonl"), *store]) == 0
    assert main(["calibrate", path, "--out", str(tmp_path / "2.jsonl"), *store]) == 0
    first, second = read_jsonl(tmp_path / "1.jsonl"), read_jsonl(tmp_path / "2.jsonl")
    assert [r["reuse"] for r in first] == ["fresh", "hit"] and [r["reuse"] for r in second] == ["hit", "hit"]
    assert [r["best_proxy"] for r in first] == [r["best_proxy"] for r in second]


@pytest.mark.slow
def test_cli_on_smollm2_reuses_with_the_same_answers(tmp_path):
    """End to end on the real model: three queries on one few-shot prompt, calibrated once."""
    from sicl_fast.commands.cli import main

    path = write_jsonl(tmp_path / "r.jsonl", [request(q, q) for q in ("five", "nine", "two")])
    flags = ["--generate", "--max-new-tokens", "3", "--max-steps", "2", "--N", "2", "--tau", "0"]
    assert main(["calibrate", path, "--out", str(tmp_path / "auto.jsonl"), *flags]) == 0
    assert main(["calibrate", path, "--out", str(tmp_path / "off.jsonl"), "--reuse", "off", *flags]) == 0
    got, ref = read_jsonl(tmp_path / "auto.jsonl"), read_jsonl(tmp_path / "off.jsonl")
    assert [r["reuse"] for r in got] == ["fresh", "hit", "hit"] and all(r["exact"] for r in got)
    assert [r["answer_calibrated"] for r in got] == [r["answer_calibrated"] for r in ref] == ["5", "9", "2"]
    assert [r["best_proxy"] for r in got] == [r["best_proxy"] for r in ref]


def test_icleval_rerun_reads_its_calibrations_from_the_store(tiny_dir, tmp_path, capsys):
    """ICLEval gives every sample its own demonstrations: the numbers are those of calibrating each, and a rerun
    with the same --store reads every calibration back."""
    from conftest import ICLEVAL_EXCERPTS
    from sicl_fast.commands.cli import main

    base = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "generate_order", "--limit", "1",
            "--model", tiny_dir, "--max-steps", "2", "--N", "2", "--tau", "0"]
    runs = {}
    for name, extra in (("off", ["--reuse", "off"]), ("first", ["--store", str(tmp_path / "s")]),
                        ("rerun", ["--store", str(tmp_path / "s")])):
        out = tmp_path / f"{name}.jsonl"
        capsys.readouterr()
        assert main([*base, "--out", str(out), *extra]) == 0
        runs[name] = [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in read_jsonl(out)]  # timings
        runs[name + "_err"] = capsys.readouterr().err
    assert runs["off"] == runs["first"] == runs["rerun"]
    assert "store: 0 calibration(s) reused, 2 run" in runs["first_err"]
    assert "store: 2 calibration(s) reused, 0 run" in runs["rerun_err"]


@pytest.mark.parametrize("flags,needle", [
    (["--store", "SD", "--reuse", "off"], "--store SD would have no effect: --reuse off calibrates every request on "
                                          "its own, without the store; drop --store, or use --reuse auto"),
    (["--store", "SD", "--pack", "2"], "--store SD would have no effect: --pack 2 calibrates packed"),
    (["--store-mib", "8", "--reuse", "off"], "--store-mib 8 would have no effect"),
    (["--store", "SD", "--answer-at", "1"], "--answer-at keeps the best X along each run"),
])
def test_store_flags_that_would_do_nothing_are_refused_before_any_work(tmp_path, capsys, monkeypatch, flags,
                                                                         needle):
    """#40: `calibrate --store DIR --reuse off` (and with --pack 2) made empty store folders, stored nothing and
    said nothing."""
    from conftest import ICLEVAL_EXCERPTS
    from sicl_fast.commands.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sicl_fast.engine.load", lambda *a, **k: pytest.fail("a model was loaded"))
    reqs = write_jsonl(tmp_path / "r.jsonl", [request("five")])
    cmds = [["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1"]] if "--answer-at" in flags else \
        [["calibrate", reqs], ["icleval", str(ICLEVAL_EXCERPTS), "--limit", "1"]]
    for cmd in cmds:
        assert main([*cmd, "--out", str(tmp_path / "o.jsonl"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err
    assert not (tmp_path / "SD").exists() and not (tmp_path / "o.jsonl").exists()


def test_answers_along_the_way_need_their_own_run(tiny_dir, tmp_path, capsys):
    """icleval --answer-at keeps the best X along each calibration, which a stored one does not have: it runs with
    the store off, and refuses an explicit --reuse auto / on before any model loads."""
    from conftest import ICLEVAL_EXCERPTS
    from sicl_fast.commands.cli import main

    argv = ["icleval", str(ICLEVAL_EXCERPTS), "--tasks", "classifier_order", "--limit", "1", "--out",
            str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no-model"), "--answer-at", "1"]
    assert main([*argv, "--reuse", "auto"]) == 2
    assert "best_at (icleval --answer-at) keeps the best X along each calibration" in capsys.readouterr().err
    eng = Engine(load(tiny_dir), reuse="auto")
    prompt = eng.prepare({"id": "q", "demos": [{"input": "a", "output": "b"}], "query": "c"})
    with pytest.raises(SiclError, match=r"best_at \(icleval --answer-at\) keeps the best X along each calibration"):
        eng.calibrate(prompt, max_steps=2, best_at=[1])


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text"])
def test_exact_reuse_bit_for_bit_on_every_family(smol, one_thread, family):
    """Reuse on the other families the fast decoder runs (Qwen3's q / k norms, Gemma's sliding windows, soft-caps
    and scaled embeddings): the second query answered from the first's calibration equals its own calibration bit
    for bit (tiny random models of each family with SmolLM2's tokenizer)."""
    from test_fast_backend import build

    eng = Engine(build(family, layers=2, tokenizer=smol.tokenizer))
    first, second = eng.prepare(request("five")), eng.prepare(request("twenty-one thousand and six"))
    a = eng.calibrate(first, reuse="auto", **BASE)
    assert (a.reuse, a.exact) == ("fresh", True)
    assert_same(a, own(eng, first, **BASE))
    b = eng.calibrate(second, reuse="auto", **BASE)
    assert (b.reuse, b.reused, b.exact, b.key) == ("hit", True, True, a.key)
    assert_same(b, own(eng, second, **BASE))


def test_a_stem_whose_own_cosine_holds_but_a_query_could_fire_is_inexact(tiny_llama, one_thread, monkeypatch):
    """The decision reads the minimum over every query norm, not the stem's own cosine. A run that moves rows
    [0, b) to 10 X0 keeps their own cosine at 1 (the projection never fires), but a query of squared norm 10 |X0|^2
    would bring the whole-matrix cosine to 2 sqrt(10) / 11 = 0.575 < kappa: the run is stored as inexact, and
    `auto` calibrates the next query per query instead of reusing it. (Natural ascent steps add noise orthogonal to
    X0, where the two minima agree, so the run here is a real one whose watched X is scaled.)"""
    eng = Engine(tiny_llama)
    real = eng.run

    def scaling_run(prompt, cfg, on_step=None, should_stop=None, on_update=None, best_at=()):
        res = real(prompt, cfg, on_step=on_step, should_stop=should_stop)
        if on_update is not None:
            X = eng.backend.embed(prompt)
            X[:prompt.demo_end] *= 10
            on_update(X)
        return res

    monkeypatch.setattr(eng, "run", scaling_run)
    cfg = dict(BASE, kappa=0.9)
    r = eng.calibrate(eng.prepare(request("five")), reuse="on", **cfg)
    assert (r.reuse, r.exact, r.projections) == ("fresh", False, 0)
    assert r.calibration.min_cosine == pytest.approx(2 * 10 ** 0.5 / 11, rel=1e-6)
    nxt = eng.calibrate(eng.prepare(request("eleven")), reuse="auto", **cfg)
    assert (nxt.reuse, nxt.reused) == ("per-query", False)
