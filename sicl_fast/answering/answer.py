"""Answering queries from a stored calibration (sicl_fast.store.Calibration).

    engine.answer(calibration, query)          one greedy answer
    engine.answer_many(calibration, queries)   many, decoded as one batch

A query is a Prompt of this model or a request (either JSON form) whose rows [0, b) are the calibration's (same
token ids, spans and first demonstration row, a calibration of the model's width; sicl_fast.answering.reuse.fits refuses
any other). Its answer is the greedy decoding of the full calibrated matrix: the calibration's rows [0, b), then the
query's own embeddings. On the fast backends it runs query-only (sicl_fast.answering.answer_kv): the query's rows are
prefilled against the stored K/V of rows [0, b), computed once per calibration and counted in the store's memory;
other backends decode the full matrix.
"""
from __future__ import annotations

from .answer_kv import supports_kv_answers
from .decode_batch import decode_queries
from ..run.checks import check_prompt
from ..errors import SiclError
from ..backends.generate import Generation, check_stops
from ..run.knobs import check_range
from .reuse import fits, full_embeddings
from ..calibration.ascent import CalibrationConfig
from ..formats.spans import Prompt
from ..store import Calibration

# queries decoded at once: a batch's own K/V is B x (its longest query + max_new_tokens) rows a layer, so a long
# list is answered in batches of this many (the gain of batching has flattened out well before it)
ANSWER_BATCH = 32


def calibration_of(obj) -> Calibration:
    """A Calibration, or the one a ReusedResult holds."""
    cal = getattr(obj, "calibration", obj)
    if not isinstance(cal, Calibration):
        raise SiclError("calibration: must be a stored Calibration (or the result of Engine.calibrate with reuse "
                        f"'auto' / 'on' that holds one), got {type(obj).__name__}")
    return cal


def query_prompt(engine, query, reserve: int) -> Prompt:
    """A query as a Prompt of this engine's model: prepared here from a request, or a Prompt checked as every Engine
    method checks one (sicl_fast.run.checks.check_prompt: another model's vocabulary is refused)."""
    if isinstance(query, Prompt):
        return check_prompt(query, engine.lm, "query")
    return engine.prepare(query, reserve=reserve)


def checked_queries(engine, calibration, queries, max_new_tokens: int, stop_strings) -> tuple:
    """(the Calibration, the stop strings, the queries as Prompts that fit it): the checks of an answer, made before
    any query is prepared or any K/V computed (answer_batch's, and the scheduler's before it queues one);
    generation's own checks (greedy_decode) are not on the K/V path, where an empty stop string would end every
    answer at once."""
    cal = calibration_of(calibration)
    stop_strings = check_stops(stop_strings)
    check_range("max_new_tokens", max_new_tokens, "answer")
    prompts = [query_prompt(engine, q, max_new_tokens) for q in queries]
    for p in prompts:
        fits(cal, p, engine.lm)
    return cal, stop_strings, prompts


def answer_batch(engine, calibration, queries, max_new_tokens: int = 32, stop_strings=("\n",),
                 stop_fn=None) -> list[Generation]:
    """Greedy answers to `queries` from one calibration, as one batch on the fast backends."""
    cal, stop_strings, prompts = checked_queries(engine, calibration, queries, max_new_tokens, stop_strings)
    backend = engine.backend
    if not supports_kv_answers(backend):
        return [engine.generate(p, full_embeddings(engine, cal, p), max_new_tokens=max_new_tokens,
                                stop_strings=stop_strings, stop_fn=stop_fn) for p in prompts]
    out = []
    for s in range(0, len(prompts), ANSWER_BATCH):
        part = prompts[s:s + ANSWER_BATCH]
        rows = [backend.embed(p)[cal.length:] for p in part]
        out += decode_queries(backend, cal, part, rows, max_new_tokens, stop_strings, stop_fn, store=engine.store)
    return out


def embeddings_prefix(prompt: Prompt, X, model: str) -> Calibration:
    """The rows [0, b) of embeddings X [L, d] of `prompt` as a Calibration kept nowhere (key ''): the prefix an
    answer from X (a calibration run without the store, or the prompt's own embeddings) decodes against, query-only,
    as a stored calibration's (the server's scheduler batches such answers so)."""
    b = prompt.demo_end
    return Calibration(key="", scope="stem", rows=X[:b].detach().float().contiguous(),
                       input_ids=prompt.input_ids[:b].clone(), token_spans=tuple(prompt.token_spans),
                       demo_start=prompt.demo_start, demo_end=b, initial_proxy=float("nan"),
                       best_proxy=float("nan"), steps=0, best_step=0, gated=False, stop_reason="", history=[],
                       projections=0, seconds=0.0, config=CalibrationConfig(), impl="", model=model, exact=True)


def answer_one(engine, calibration, query, max_new_tokens: int = 32, stop_strings=("\n",),
               stop_fn=None) -> Generation:
    return answer_batch(engine, calibration, [query], max_new_tokens, stop_strings, stop_fn)[0]


def answer_result(engine, res, prompt: Prompt, max_new_tokens: int = 32, stop_strings=("\n",),
                  stop_fn=None) -> Generation:
    """The greedy answer for `prompt` after its calibration `res` (Engine.calibrate's result): from the stored
    calibration it holds (query-only on the fast backends), else from its embeddings."""
    cal = getattr(res, "calibration", None)
    if cal is not None:
        return answer_one(engine, cal, prompt, max_new_tokens, stop_strings, stop_fn)
    return engine.generate(prompt, res.embeddings, max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                           stop_fn=stop_fn)


__all__ = ["ANSWER_BATCH", "answer_one", "answer_batch", "answer_result", "calibration_of", "checked_queries",
           "query_prompt", "embeddings_prefix"]
