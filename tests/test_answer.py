"""Query-only answering (sicl_fast.answering.answer_kv): a query's prefill against the stored K/V of the calibrated rows
[0, b) and greedy decoding, many ragged queries as one batch, give the tokens of decoding the full calibrated matrix
(FastBackend.generate): on tiny random-weight models of all four families (sliding windows and soft-caps
included), and on SmolLM2 after a real calibration. The K/V is counted in the store's memory budget."""
from __future__ import annotations

import pytest
import torch

from sicl_fast import Engine
from sicl_fast.answering.decode_batch import decode_queries
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.errors import SiclError
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from sicl_fast.store import Calibration, CalibrationStore

from test_fast_backend import SUPPORTED_FAMILIES, V, tiny_models  # noqa: E402

B_ROWS, SPANS = 10, ((3, 6), (8, 10))
NEW = 12


@pytest.fixture(scope="module")
def engines(one_thread):
    return {f: Engine(lm, impl="torch") for f, lm in tiny_models().items()}


def prompt(ids: list[int]) -> Prompt:
    return Prompt(request=Request(id=f"q{len(ids)}", prompt="x" * 100, output_spans=((1, 2),)),
                  input_ids=torch.tensor(ids), token_spans=SPANS, demo_start=1, demo_end=B_ROWS)


def stored(eng: Engine, stem: torch.Tensor, seed: int = 0) -> Calibration:
    """A calibration of rows [0, b): the stem's embeddings moved a little (as an ascent would)."""
    g = torch.Generator().manual_seed(seed)
    X = eng.backend.embed(prompt(stem.tolist()))
    return Calibration(key=f"k{seed}", scope="stem", rows=X + 0.05 * torch.randn(X.shape, generator=g),
                       input_ids=stem, token_spans=SPANS, demo_start=1, demo_end=B_ROWS, initial_proxy=0.1,
                       best_proxy=0.2, steps=2, best_step=1, gated=False, stop_reason="max_steps", history=[0.1, 0.2],
                       projections=0, seconds=0.0, config=CalibrationConfig(), impl="torch", model="tiny",
                       exact=True)


def full_matrix_answer(eng: Engine, cal: Calibration, p: Prompt):
    X = eng.backend.embed(p)
    X[:cal.length] = cal.rows
    return eng.generate(p, X, max_new_tokens=NEW, stop_strings=())


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_batched_ragged_answers_equal_the_full_matrix(engines, family):
    eng = engines[family]
    g = torch.Generator().manual_seed(1)
    stem = torch.randint(0, V, (B_ROWS,), generator=g)
    # own rows 1 .. 12 (past Gemma's window of 8, with the answer), and a prompt that ends at b (no own rows)
    prompts = [prompt(torch.cat([stem, torch.randint(0, V, (n,), generator=g)]).tolist()) for n in (1, 5, 12, 0, 3)]
    cal = stored(eng, stem)
    got = eng.answer_many(cal, prompts, max_new_tokens=NEW, stop_strings=())
    for p, gen in zip(prompts, got):
        ref = full_matrix_answer(eng, cal, p)
        assert gen.token_ids == ref.token_ids and gen.stop_reason == ref.stop_reason, (family, p.length)
        assert eng.answer(cal, p, max_new_tokens=NEW, stop_strings=()).token_ids == ref.token_ids


def test_masked_keys_never_poison_a_batch(engines):
    """A batch of one after a batch of five on the same entry (its own buffers are new, its masked slots zero)."""
    eng = engines["llama"]
    stem = torch.arange(B_ROWS) + 7
    cal = stored(eng, stem, seed=3)
    ps = [prompt(stem.tolist() + list(range(20, 20 + n))) for n in (6, 2, 9)]
    eng.answer_many(cal, ps, max_new_tokens=NEW, stop_strings=())
    for p in ps:
        one = eng.answer(cal, p, max_new_tokens=NEW, stop_strings=())
        assert one.token_ids == full_matrix_answer(eng, cal, p).token_ids


def test_the_kv_is_counted_in_the_store_budget(engines):
    eng = engines["qwen3"]
    stem = torch.arange(B_ROWS) + 1
    cal = stored(eng, stem, seed=4)
    store = CalibrationStore(10 * cal.nbytes)
    store.put(cal)
    before = store.memory.bytes
    p = prompt(stem.tolist() + [5, 6])
    decode_queries(eng.backend, cal, [p], [eng.backend.embed(p)[B_ROWS:]], NEW, (), store=store)
    m = eng.backend.model
    kv_bytes = len(m.layers) * 2 * B_ROWS * m.Hk * m.hd * 4
    assert cal.kv is not None and store.memory.bytes - before == cal.kv.nbytes >= kv_bytes
    tight = CalibrationStore(cal.nbytes - 1)  # rows fit, rows + K/V do not: the K/V is dropped, the rows kept
    cal.kv = None
    tight.put(cal)
    decode_queries(eng.backend, cal, [p], [eng.backend.embed(p)[B_ROWS:]], NEW, (), store=tight)
    assert tight.get(cal.key) is cal and cal.kv is None


def test_a_query_that_does_not_fit_is_refused(engines):
    eng = engines["llama"]
    stem = torch.arange(B_ROWS) + 2
    cal = stored(eng, stem)
    other = prompt((torch.arange(B_ROWS) + 3).tolist() + [1, 2])
    with pytest.raises(SiclError, match="calibrate it"):
        eng.answer_many(cal, [other], max_new_tokens=2)
    with pytest.raises(SiclError, match="context"):
        eng.answer(cal, prompt(stem.tolist() + [1]), max_new_tokens=10_000)


def test_the_hf_backend_answers_from_the_full_matrix(engines):
    fast = engines["llama"]
    eng = Engine(fast.lm, backend="hf")
    stem = torch.arange(B_ROWS) + 5
    cal = stored(fast, stem)
    p = prompt(stem.tolist() + [9, 8, 7])
    X = eng.backend.embed(p)
    X[:B_ROWS] = cal.rows
    ref = eng.generate(p, X, max_new_tokens=NEW, stop_strings=())
    assert eng.answer(cal, p, max_new_tokens=NEW, stop_strings=()).token_ids == ref.token_ids
    assert cal.kv is None  # no K/V kept for a backend that does not use it


@pytest.mark.slow
def test_smollm2_answers_from_a_real_calibration(smol, one_thread):
    eng = Engine(smol, reuse="auto")
    demos = [{"input": w, "output": d} for w, d in (("one", "1"), ("seven", "7"), ("three", "3"))]
    reqs = [{"id": q, "instruction": "Write each number word as a digit.", "demos": demos, "query": q}
            for q in ("five", "nine", "forty-two", "two")]
    res = eng.calibrate(eng.prepare(reqs[0], reserve=6), max_steps=3, N=2, tau=0.0, patience=0)
    assert res.exact and res.calibration.scope == "stem"
    got = eng.answer_many(res.calibration, reqs, max_new_tokens=6)
    for r, gen in zip(reqs, got):
        p = eng.prepare(r, reserve=6)
        own = eng.calibrate(p, reuse="off", max_steps=3, N=2, tau=0.0, patience=0)
        ref = eng.generate(p, own.embeddings, max_new_tokens=6)
        assert gen.token_ids == ref.token_ids and gen.answer == ref.answer, r["id"]
    assert [g.answer for g in got] == ["5", "9", "42", "2"]
