"""The scheduler that owns the engine (sicl_fast.scheduler), from its Python front end, on a tiny random-weight Llama
with SmolLM2's tokenizer: answers decode together with the tokens each gets alone, for every batch size and join
time (a row joining at the next token, rows leaving at their stop or when cancelled); a calibration stepping between
answers keeps its result bit for bit; a deadline stops only its own calibration; neither lane starves the other;
admission in arrival order within the limits, and the queue full; concurrent calibrations as slots of the packed
step with packing forced (pack 2 on the CPU), within the packed step's tolerance of each alone. The HTTP front end:
tests/test_serve.py and tests/test_chat.py."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from sicl_fast import Engine, SiclError
from sicl_fast.scheduler import Cancelled, Limits, Observer, QueueFull, Scheduler, engine_lock

NEW = 10
QUERIES = ["five", "nine", "forty two", "three hundred and six", "x", "twelve and a half", "seven", "one one"]
# a calibration that runs until its deadline or cancellation
LONG = {"max_steps": 100_000, "patience": 0, "tau": 0.0}


def request(query: str, demos=(("one", "1"), ("seven", "7"))) -> dict:
    return {"id": query, "instruction": "Write each number word as a digit.",
            "demos": [{"input": i, "output": o} for i, o in demos], "query": query}


class Rows(Observer):
    """Every decoding unit's rows (what joined and left shows here)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def decoded(self, rows: int, tokens: int, seconds: float) -> None:
        self.rows.append(rows)


@pytest.fixture(scope="module")
def engine(tiny_llama, one_thread):
    return Engine(tiny_llama, reuse="auto")


@pytest.fixture(scope="module")
def stored(engine):
    """A stored calibration (reuse 'auto', exact) that every query of QUERIES fits."""
    res = engine.calibrate(engine.prepare(request("five"), reserve=NEW), max_steps=3, N=4, tau=0.0)
    assert res.calibration is not None and res.exact
    return res.calibration


@pytest.fixture(scope="module")
def alone(engine, stored):
    """Each query's answer alone (Engine.answer: a batch of one), before any scheduler runs on the engine."""
    return {q: engine.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()).token_ids for q in QUERIES}


@pytest.fixture(scope="module")
def sched(engine, alone):
    s = Scheduler(engine, Limits())
    yield s
    assert s.close()


def tokens(ticket) -> list[int]:
    return ticket.result(60).token_ids


def test_answers_decode_together_with_their_tokens_alone(sched, stored, alone):
    for n in (1, 2, 3, 8):
        tickets = {q: sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES[:n]}
        assert {q: tokens(t) for q, t in tickets.items()} == {q: alone[q] for q in QUERIES[:n]}, n


@pytest.mark.parametrize("bad", ["not a calibration", "empty stop", "negative max_new_tokens", "other demos"])
def test_an_answer_is_refused_before_it_is_queued_as_engine_answer_refuses_it(engine, sched, stored, bad):
    """Scheduler.answer makes Engine.answer's checks (answering.answer.checked_queries), with its message, before the
    request is queued: nothing waits or runs for it."""
    cal, query, kw = stored, request("five"), {"max_new_tokens": NEW, "stop_strings": ("\n",)}
    if bad == "not a calibration":
        cal = "q1"
    elif bad == "empty stop":
        kw["stop_strings"] = ("",)
    elif bad == "negative max_new_tokens":
        kw["max_new_tokens"] = -1
    else:
        query = request("five", demos=(("two", "2"), ("ten", "10")))
    with pytest.raises(SiclError) as direct:
        engine.answer(cal, query, **kw)
    with pytest.raises(SiclError) as queued:
        sched.answer(cal, query, **kw)
    assert str(queued.value) == str(direct.value) and sched.depth == 0 and not sched.busy


@pytest.mark.parametrize("at", [1, 3, NEW - 1])
def test_a_request_joins_a_running_batch_at_its_next_token(engine, stored, alone, at):
    """Each query joins when the one before it has decoded `at` tokens (its own on_text submits it: the scheduler's
    thread, so the joiner is taken in at the very next iteration), each with its own stop strings and length."""
    obs = Rows()
    s = Scheduler(engine, observer=obs)
    chain = QUERIES[:4]
    tickets: dict[str, object] = {}

    def submit(k: int):
        seen = [0]

        def on_text(_text: str) -> None:
            seen[0] += 1
            if seen[0] == at and k + 1 < len(chain):
                tickets[chain[k + 1]] = submit(k + 1)
        return s.answer(stored, request(chain[k]), max_new_tokens=NEW, stop_strings=(), on_text=on_text)

    tickets[chain[0]] = submit(0)
    try:
        for q in chain:
            assert tokens(tickets[q]) == alone[q], (q, at)
    finally:
        s.close()
    assert max(obs.rows) >= 2  # they decoded together: a row joined while the others ran
    # stop strings and lengths of their own: a short one leaves first, the others go on unchanged
    s = Scheduler(engine)
    short = s.answer(stored, request("nine"), max_new_tokens=3, stop_strings=())
    long = s.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=())
    assert tokens(short) == alone["nine"][:3] and tokens(long) == alone["five"]
    s.close()


def test_asyncio_front_end(sched, stored, alone):
    async def main():
        return await asyncio.gather(*(sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=())
                                      for q in QUERIES[:4]))
    got = asyncio.run(main())
    assert [g.token_ids for g in got] == [alone[q] for q in QUERIES[:4]]


def test_a_cancelled_answer_leaves_without_disturbing_the_others(sched, stored, alone):
    box = {}

    def on_text(_text: str, seen=[0]) -> None:  # noqa: B006 - the count of this one answer
        seen[0] += 1
        if seen[0] == 2:
            box["t"].cancel()

    box["t"] = sched.answer(stored, request("nine"), max_new_tokens=NEW, stop_strings=(), on_text=on_text)
    others = {q: sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in ("five", "x")}
    with pytest.raises(Cancelled):
        box["t"].result(60)
    assert {q: tokens(t) for q, t in others.items()} == {q: alone[q] for q in others}


def test_a_calibration_between_answers_keeps_its_result(engine, sched, stored, alone):
    """A calibration (another prompt, without the store) steps between the answers' tokens: its history and X are
    those of the same calibration alone, bit for bit, and the answers are theirs alone."""
    prompt = engine.prepare(request("ten", demos=(("two", "2"), ("six", "6"), ("eight", "8"))))
    knobs = dict(max_steps=6, N=4, tau=0.0, seed=7)
    ref = engine.calibrate(prompt, reuse="off", **knobs)
    cal = sched.calibrate(prompt, reuse="off", **knobs)
    answers = {q: sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES[:3]}
    res = cal.result(60)
    assert res.history == ref.history and res.steps == 6 and torch.equal(res.embeddings, ref.embeddings)
    assert {q: tokens(t) for q, t in answers.items()} == {q: alone[q] for q in answers}


def test_a_flow_calibrates_then_answers_from_its_embeddings(engine, sched):
    """A flow of its own (Scheduler.submit): a calibration without the store that perturbs the query rows too, then
    its answer as a row of its own prefix: the full calibrated matrix's answer (Engine.generate), its query rows
    the calibrated ones."""
    from sicl_fast.scheduler import Answer, Calibrate

    prompt = engine.prepare(request("nine", demos=(("two", "2"), ("six", "6"))), reserve=NEW)
    cfg = engine.config(max_steps=6, N=4, tau=0.0, seed=2, eta=1.0, mu=0.05, perturb_query=True)

    def flow():
        res = yield Calibrate(prompt, cfg, reuse="off")
        gen = yield Answer.after(res, prompt, NEW, ())
        return res, gen

    res, gen = sched.submit(flow(), "mine").result(60)
    assert not torch.equal(res.embeddings[prompt.demo_end:], engine.backend.embed(prompt)[prompt.demo_end:])
    assert gen.token_ids == engine.generate(prompt, res.embeddings, max_new_tokens=NEW, stop_strings=()).token_ids


def test_a_deadline_stops_only_its_own_request(engine, sched, stored, alone):
    long = sched.calibrate(engine.prepare(request("ten")), reuse="off", deadline=time.monotonic() + 0.3, **LONG)
    prompt = engine.prepare(request("ten", demos=(("two", "2"), ("six", "6"))))
    after = sched.calibrate(prompt, reuse="off", max_steps=3, N=4, tau=0.0, seed=2)  # waits for the slot
    answers = {q: sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES[:2]}
    res = long.result(60)
    assert res.stop_reason == "deadline" and 1 <= res.steps < LONG["max_steps"]
    own = after.result(60)
    ref = engine.calibrate(prompt, reuse="off", max_steps=3, N=4, tau=0.0, seed=2)
    assert own.stop_reason == "max_steps" and own.history == ref.history
    assert {q: tokens(t) for q, t in answers.items()} == {q: alone[q] for q in answers}


def test_neither_lane_starves_the_other(engine, sched, stored, alone):
    """A calibration that would run for ever does not hold answers back (they all end while it runs), and a stream
    of answers does not hold a calibration back (it ends while answers keep coming)."""
    long = sched.calibrate(engine.prepare(request("ten")), reuse="off", **LONG)
    answers = [sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES]
    assert [tokens(t) for t in answers] == [alone[q] for q in QUERIES]
    assert not long.done  # still calibrating: the answers did not wait for it
    long.cancel()
    with pytest.raises(Cancelled):
        long.result(60)
    # answers without a pause (each one that ends is replaced), and a calibration submitted among them
    stop, done, feeder = threading.Event(), [], []

    def feed(q: str) -> None:
        if stop.is_set():
            return
        t = sched.answer(stored, request(q), max_new_tokens=NEW, stop_strings=())
        feeder.append(t)
        t.future.add_done_callback(lambda f: (done.append(f), feed(q)))

    for q in QUERIES[:4]:
        feed(q)
    cal = sched.calibrate(engine.prepare(request("ten", demos=(("two", "2"), ("six", "6")))), reuse="off",
                          max_steps=5, N=4, tau=0.0)
    rows = []
    cal.future.add_done_callback(lambda f: rows.append(sched.answers.size))  # answers in flight as it ends
    res = cal.result(120)  # it ends (it would wait for ever if the answers held it back)
    stop.set()
    for t in list(feeder):
        t.result(60)
    assert res.steps == 5 and rows[0] >= 1 and done


def test_a_lane_that_ran_alone_has_no_lead(engine, stored, alone):
    """A lane's time alone is no credit: after answers ran alone for a long while (their lane's clock far ahead), a
    calibration that starts alone and an answer that comes during it share the engine: the answer does not wait
    for the calibration's end."""
    s = Scheduler(engine)
    s.vtime["answers"] = 1e6  # as after a long time of answers alone
    steps = threading.Event()
    cal = s.calibrate(engine.prepare(request("ten")), reuse="off", max_steps=2000, patience=0, tau=0.0,
                      on_step=lambda i, f: i >= 3 and steps.set())
    assert steps.wait(60)  # it runs alone
    ans = s.answer(stored, request("nine"), max_new_tokens=NEW, stop_strings=())
    assert tokens(ans) == alone["nine"] and not cal.done
    cal.cancel()
    s.close()


def test_a_stored_calibration_answers_at_once_beside_a_running_one(engine, sched):
    """A calibration the store's memory holds (the stem's, or a prompt's own: per query) is answered without
    waiting for the one running, which keeps the one-at-a-time lane."""
    own = engine.prepare(request("eleven", demos=(("two", "2"), ("six", "6"))))
    first = engine.calibrate(own, max_steps=2, N=4, tau=0.0, perturb_query=True)  # stored under its own key
    assert first.reuse == "per-query" and not first.reused
    long = sched.calibrate(engine.prepare(request("ten")), reuse="off", **LONG)
    got = sched.calibrate(own, max_steps=2, N=4, tau=0.0, perturb_query=True).result(60)
    assert got.reused and got.reuse == "per-query" and got.history == first.history and not long.done
    long.cancel()


def test_admission_in_arrival_order_within_the_limits(engine, stored, alone):
    obs = Rows()
    s = Scheduler(engine, Limits(max_rows=2), observer=obs)
    with engine_lock(engine):  # every request is queued before the first token
        tickets = [s.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES[:5]]
    assert [tokens(t) for t in tickets] == [alone[q] for q in QUERIES[:5]]
    admitted = [t.admitted for t in tickets]
    assert admitted == sorted(admitted) and max(obs.rows) == 2
    s.close()


def test_beyond_the_queue_new_requests_are_refused(engine, stored, alone):
    s = Scheduler(engine, Limits(max_queue=1, max_rows=1))
    with engine_lock(engine):  # the first holds the one row; one waits; the younger two are refused
        tickets = [s.answer(stored, request(q), max_new_tokens=NEW, stop_strings=()) for q in QUERIES[:4]]
    assert tokens(tickets[0]) == alone[QUERIES[0]] and tokens(tickets[1]) == alone[QUERIES[1]]
    for t in tickets[2:]:
        with pytest.raises(QueueFull) as full:
            t.result(60)
        assert full.value.retry_after >= 1 and "--max-queue 1" in str(full.value)
    s.close()


def test_a_request_over_a_limit_by_itself_is_refused(engine, stored):
    s = Scheduler(engine, Limits(max_tokens=8))
    with pytest.raises(Exception, match=r"exceed this server's limit of 8 \(--max-batch-tokens\)"):
        s.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=()).result(60)
    s.close()


@pytest.fixture(scope="module")
def packing(tiny_llama, one_thread):
    return Engine(tiny_llama, pack=2)


def test_concurrent_calibrations_share_the_packed_step(packing):
    """Packing forced (pack 2 on the CPU): three calibrations of their own configs (steps, seeds) run as slots of one
    packed step, the third joining at the read where the first stops; each within the packed step's tolerance of its
    run alone (tests/test_packed.py: rtol 1e-5, same steps and stops). A deadline and a cancellation stop only
    their own slot."""
    prompts = [packing.prepare(request(q, demos=(("one" * (i + 1), "1"), ("seven", "7" * (i + 1)))))
               for i, q in enumerate(("five", "nine", "ten"))]
    configs = [packing.config(max_steps=3 + 2 * i, N=4, tau=0.0, seed=i) for i in range(3)]
    alone = [packing.calibrate(p, c, reuse="off") for p, c in zip(prompts, configs)]
    s = Scheduler(packing)
    try:
        with engine_lock(packing):
            tickets = [s.calibrate(p, c) for p, c in zip(prompts, configs)]
        for a, t in zip(alone, tickets):
            got = t.result(60)
            assert (got.steps, got.stop_reason) == (a.steps, a.stop_reason)
            assert got.history == pytest.approx(a.history, rel=1e-5, abs=0)
        assert s.work.packed is not None and s.work.packed.full == 2  # two slots ran together
        with engine_lock(packing):
            long = s.calibrate(prompts[0], configs[0].replace(**LONG), deadline=time.monotonic() + 0.3)
            gone = s.calibrate(prompts[1], configs[1].replace(**LONG))
        time.sleep(0.1)
        gone.cancel()
        with pytest.raises(Cancelled):
            gone.result(60)
        assert long.result(60).stop_reason == "deadline"
        own = s.calibrate(prompts[2], configs[2]).result(60)  # the slots are free again
        assert own.history == pytest.approx(alone[2].history, rel=1e-5, abs=0)
    finally:
        s.close()


def test_each_piece_of_work_runs_with_its_own_rotary_tables(one_thread):
    """A rope type whose tables depend on the prompt length (Phi-3's longrope past its pretraining length, 16 here):
    a calibration of a 24-token prompt steps between answers on prompts of at most 16 tokens, each with its own
    tables (Transformer.restore_rope): the calibration's history and the answers are theirs alone."""
    from conftest import synthetic_prompt
    from test_answer import B_ROWS, prompt as query, stored as stored_of
    from test_fast_families import V, build

    eng = Engine(build("phi3"), impl="torch")
    long = synthetic_prompt(24, ((3, 6), (8, 12)), 1, V, seed=1)
    knobs = dict(max_steps=12, N=4, tau=0.0, patience=0)
    ref = eng.calibrate(long, reuse="off", **knobs)
    stem = torch.arange(B_ROWS) + 3
    cal = stored_of(eng, stem)
    queries = [query(stem.tolist() + list(range(20, 20 + n))) for n in (2, 4, 6)]
    alone = [eng.answer(cal, q, max_new_tokens=4, stop_strings=()).token_ids for q in queries]
    s = Scheduler(eng)
    try:
        with engine_lock(eng):
            t = s.calibrate(long, reuse="off", **knobs)
            answers = [s.answer(cal, q, max_new_tokens=4, stop_strings=()) for q in queries]
        assert [tokens(a) for a in answers] == alone
        assert t.result(60).history == ref.history
    finally:
        s.close()


@pytest.mark.parametrize("bad", [[["not work"]], {"a": 1}, 5])
def test_a_flow_that_yields_no_work_fails_alone(sched, stored, alone, bad):
    """A flow that yields something other than scheduler.work items (an unhashable list in a list, a dict, a number)
    fails its own request with a TypeError that names what it yielded; the scheduler's loop goes on."""
    def flow():
        yield bad

    with pytest.raises(TypeError, match=f"yielded {type(bad).__name__}"):
        sched.submit(flow(), "odd").result(10)
    assert tokens(sched.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=())) == alone["five"]


def test_a_cancelled_future_or_task_cancels_its_request(engine, sched):
    """Cancelling what a front end holds cancels the request: `ticket.future.cancel()`, or the asyncio task that
    awaits the ticket (asyncio.wait_for's timeout). The calibration stops at its next step and the scheduler is idle
    again (before, the work ran on, and its request stayed open for ever: /health busy, the drain waiting)."""
    prompt = engine.prepare(request("ten"))
    t = sched.calibrate(prompt, reuse="off", **LONG)
    time.sleep(0.1)
    assert t.future.cancel() and t.cancelled

    async def wait_briefly():
        inner = sched.calibrate(prompt, reuse="off", **LONG)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(_awaited(inner)), 0.2)
        return inner

    inner = asyncio.run(wait_briefly())
    assert inner.cancelled
    end = time.monotonic() + 30
    while sched.busy:
        assert time.monotonic() < end, "the cancelled requests still hold the scheduler"
        time.sleep(0.02)


async def _awaited(ticket):
    return await ticket


def _raise(exc: BaseException):
    raise exc


def test_a_calibration_waiting_for_bytes_does_not_hold_answers_back(packing):
    """--max-batch-bytes that fits one packed calibration and an answer, not two calibrations (pack 2): a second
    calibration waits for the bytes the first holds, and an answer that comes meanwhile is served while the first
    still runs (a long calibration never holds answers back). Before, the waiting calibration held back every
    younger request until the first one ended."""
    from sicl_fast.scheduler import Answer, Cost

    prompts = [packing.prepare(request(q, demos=(("one" * (i + 1), "1"), ("seven", "7")))) for i, q in
               enumerate(("five", "nine"))]
    cfg = packing.config(N=4, **LONG)
    query = packing.prepare(request("ten"), reserve=NEW)
    cal = Cost.of_calibration(packing.lm, packing.plan, prompts[0], cfg, True).bytes
    ans = Cost.of_answer(packing.lm, query, NEW, query.demo_end, 1, True).bytes
    assert 2 * ans < cal
    s = Scheduler(packing, Limits(max_bytes=cal + 2 * ans))

    def answer():
        return (yield Answer(query, NEW, ()))

    try:
        first = s.calibrate(prompts[0], cfg, reuse="off", deadline=time.monotonic() + 10)
        wait_until = time.monotonic() + 30
        while first.admitted is None:
            assert time.monotonic() < wait_until
            time.sleep(0.01)
        with engine_lock(packing):
            second = s.calibrate(prompts[1], cfg, reuse="off")
            got = s.submit(answer(), "answer")
        assert got.result(60).token_ids == packing.generate(query, max_new_tokens=NEW, stop_strings=()).token_ids
        assert not first.done and second.admitted is None  # served while the first runs, the second waiting
    finally:
        s.close()


def test_an_engine_runs_one_calibration_at_a_time(engine, sched):
    """Engine.calibrate called while another calibration runs on the engine (its scheduler's, paused between two
    steps, or another thread's) is refused in one line, and the one running keeps its own result; a calibration
    given to the scheduler while another thread's runs waits for it. Before, both ran at once on the engine's shared
    buffers and gave wrong histories without a word."""
    from sicl_fast.errors import SiclError

    prompt = engine.prepare(request("ten", demos=(("two", "2"), ("six", "6"))))
    same = engine.prepare(request("six", demos=(("two", "2"), ("six", "6"))))  # the same shape
    knobs = dict(max_steps=6, N=4, tau=0.0, seed=3)
    ref = engine.calibrate(prompt, reuse="off", **knobs)
    started = threading.Event()
    long = sched.calibrate(same, reuse="off", on_step=lambda i, f: started.set(), **LONG)
    assert started.wait(60)
    with pytest.raises(SiclError, match="another calibration is running on this engine"):
        engine.calibrate(prompt, reuse="off", **knobs)
    long.cancel()
    with pytest.raises(Cancelled):
        long.result(60)
    end = time.monotonic() + 30
    while engine.calibrating:  # the cancelled one stops at its next step
        assert time.monotonic() < end
        time.sleep(0.01)
    go, running = threading.Event(), threading.Event()
    out = {}

    def hold(step, f):
        running.set()
        go.wait(60)

    other = threading.Thread(target=lambda: out.update(r=engine.calibrate(same, reuse="off", on_step=hold, **knobs)))
    other.start()
    assert running.wait(60)
    queued = sched.calibrate(prompt, reuse="off", **knobs)  # waits for the other thread's run
    time.sleep(0.1)
    assert not queued.done
    go.set()
    other.join(60)
    assert queued.result(60).history == ref.history and out["r"].steps == 6


def test_threads_asking_for_the_engine_scheduler_at_once_share_one(tiny_llama, one_thread):
    """Engine.scheduler() called from 8 threads at once on first use gives all of them the one scheduler (second
    probe of issue #52). Before, each thread that saw none yet started its own: up to 8 scheduler threads on one
    engine, answers split over them instead of decoding together, all but the last never closed."""
    eng = Engine(tiny_llama)
    start, got = threading.Barrier(8), []

    def ask() -> None:
        start.wait(10)
        got.append(eng.scheduler())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    made = {id(s): s for s in got}
    try:
        assert len(got) == 8 and len(made) == 1
    finally:
        for s in made.values():
            assert s.close()


def test_a_request_whose_own_code_raises_a_base_exception_fails_alone(engine, stored, alone):
    """A Call, an on_text or an observer raising what is not an Exception (asyncio.CancelledError, which user code
    driving an event loop meets; KeyboardInterrupt) fails its own request (or, on_text, ends its answer there), and
    the scheduler goes on (second probe of issue #52). Before, it ended the scheduler's thread: that request and
    every later one waited for ever."""
    class Loud(Observer):
        def decoded(self, rows: int, tokens: int, seconds: float) -> None:
            raise asyncio.CancelledError()

    s = Scheduler(engine, observer=Loud())
    try:
        for exc in (asyncio.CancelledError, KeyboardInterrupt):
            with pytest.raises(exc):
                s.call(lambda e, exc=exc: _raise(exc())).result(10)
        cut = s.answer(stored, request("nine"), max_new_tokens=NEW, stop_strings=(),
                       on_text=lambda text: _raise(asyncio.CancelledError()))
        assert tokens(cut) == alone["nine"][:1]  # it stopped at its first token, as any failing listener's does
        assert tokens(s.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=())) == alone["five"]
    finally:
        assert s.close(10)


def test_a_packed_slot_whose_on_step_raises_fails_alone(packing):
    """Packing forced (pack 2): one request's on_step raising stops its own slot at the read, its ticket raising
    that error (as Engine.calibrate alone raises it), and the other request's slot runs on to its own result within
    the packed step's tolerance (second probe of issue #52). Before, the error failed every slot of the packed step:
    the other request got the first one's ValueError."""
    prompts = [packing.prepare(request(q, demos=(("one" * (i + 1), "1"), ("seven", "7" * (i + 1)))))
               for i, q in enumerate(("five", "nine"))]
    cfg = packing.config(max_steps=6, N=4, tau=0.0)
    ref = packing.calibrate(prompts[1], cfg, reuse="off")

    def fails(step: int, f: float) -> None:
        if step == 2:
            raise ValueError("the request's own on_step")

    s = Scheduler(packing)
    try:
        with engine_lock(packing):
            bad = s.calibrate(prompts[0], cfg, on_step=fails)
            good = s.calibrate(prompts[1], cfg)
        with pytest.raises(ValueError, match="own on_step"):
            bad.result(60)
        got = good.result(60)
        assert got.steps == ref.steps and got.history == pytest.approx(ref.history, rel=1e-5, abs=0)
    finally:
        s.close()


def test_a_flow_whose_cleanup_fails_ends_alone(engine, stored, alone):
    """A flow (Scheduler.submit) cancelled while its answer decodes is closed; when its own cleanup fails (a
    `finally` that raises, a GeneratorExit it ignores) the request still ends Cancelled and the scheduler goes on
    (second probe of issue #52). Before, the failure ended the scheduler's thread: every later request waited for
    ever."""
    from sicl_fast.scheduler import Answer

    query = engine.prepare(request("nine"), reserve=200)

    def raising():
        try:
            return (yield Answer(query, 200, (), calibration=stored))
        finally:
            raise ValueError("the flow's own cleanup")

    def stubborn():
        ignored = False
        while True:
            try:
                return (yield Answer(query, 200, (), calibration=stored))
            except GeneratorExit:
                if ignored:  # the second close (its collection) ends it
                    raise
                ignored = True

    s = Scheduler(engine)
    try:
        for flow in (raising, stubborn):
            started = threading.Event()
            t = s.submit(flow(), "custom")
            s.answer(stored, request("five"), max_new_tokens=1, stop_strings=(),
                     on_text=lambda text: started.set()).result(10)  # the custom answer is in the batch by now
            t.cancel()
            with pytest.raises(Cancelled):
                t.result(10)
        assert tokens(s.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=())) == alone["five"]
    finally:
        assert s.close(10)


def test_a_done_callback_raising_a_base_exception_skips_nothing(engine, stored, alone):
    """A done-callback of a ticket's future that raises asyncio.CancelledError (a BaseException) is logged: the
    callbacks after it run (an asyncio task awaiting the ticket gets its result) and the scheduler goes on (second
    probe of issue #52). Before, concurrent.futures let it through: the awaiting task waited for ever and the
    scheduler's thread ended."""
    s = Scheduler(engine)

    async def main():
        t = s.answer(stored, request("nine"), max_new_tokens=NEW, stop_strings=())
        t.future.add_done_callback(lambda f: _raise(asyncio.CancelledError()))
        return await asyncio.wait_for(_awaited(t), 10)

    try:
        assert asyncio.run(main()).token_ids == alone["nine"]
        assert tokens(s.answer(stored, request("five"), max_new_tokens=NEW, stop_strings=())) == alone["five"]
    finally:
        assert s.close(10)


def test_one_work_item_yielded_twice_runs_twice(engine, sched, stored, alone):
    """A flow that yields one item object twice (`[Answer(...)] * 2`), and two requests whose flows yield the same
    item object at once, each get the item's own result, and nothing stays held (second probe of issue #52). Before,
    the scheduler kept one place per item object: the second use took the first's, its request waited for ever and
    its cost stayed held (the scheduler busy, the limits shrunk for good)."""
    from sicl_fast.scheduler import Answer, Cost

    query = engine.prepare(request("nine"), reserve=NEW)
    item = Answer(query, NEW, (), calibration=stored)

    def twice():
        return (yield [item] * 2)

    def once():
        return (yield item)

    with engine_lock(engine):  # taken in together: the same item in flight for two requests at once
        both = sched.submit(twice(), "twice")
        first, second = sched.submit(once(), "once"), sched.submit(once(), "once")
    assert [g.token_ids for g in both.result(30)] == [alone["nine"]] * 2
    assert tokens(first) == tokens(second) == alone["nine"]
    end = time.monotonic() + 30
    while sched.busy:
        assert time.monotonic() < end, "the repeated item is still held"
        time.sleep(0.01)
    assert sched.used == Cost()


def test_submit_takes_a_new_generator_only(engine, sched, stored, alone):
    """Scheduler.submit refuses, in one line naming what it got, what is not a generator not yet started: a number,
    a generator the caller advanced, one generator submitted twice (second probe of issue #52). Before, the first
    two failed later on their tickets (an AttributeError about `.send`), and the last two were resumed with None: a
    silent None result, or the other ticket's answer cut off."""
    from sicl_fast.scheduler import Answer

    query = engine.prepare(request("nine"), reserve=NEW)

    def flow():
        return (yield Answer(query, NEW, (), calibration=stored)).token_ids

    with pytest.raises(TypeError, match="got int"):
        sched.submit(5)
    started = flow()
    next(started)
    with pytest.raises(TypeError, match="already suspended"):
        sched.submit(started)
    started.close()
    twice = flow()
    first = sched.submit(twice)
    with pytest.raises(TypeError, match="already (submitted|suspended)"):  # queued, or started by now
        sched.submit(twice)
    assert first.result(30) == alone["nine"]
