"""Answering queries from a stored calibration (sicl_fast.store.Calibration).

    engine.answer(calibration, query)          one greedy answer
    engine.answer_many(calibration, queries)   many, decoded as one batch

A query is a Prompt or a request (either JSON form) whose rows [0, b) are the calibration's (same token ids, spans
and first demonstration row; sicl_fast.reuse.fits refuses any other). Its answer is the greedy decoding of the
full calibrated matrix: the calibration's rows [0, b), then the query's own embeddings.
"""
from __future__ import annotations

from .errors import SiclError
from .generate import Generation
from .reuse import full_embeddings
from .spans import Prompt
from .store import Calibration


def calibration_of(obj) -> Calibration:
    """A Calibration, or the one a ReusedResult holds."""
    cal = getattr(obj, "calibration", obj)
    if not isinstance(cal, Calibration):
        raise SiclError("calibration: must be a stored Calibration (or the result of Engine.calibrate with reuse "
                        f"'auto' / 'on' that holds one), got {type(obj).__name__}")
    return cal


def query_prompt(engine, query, reserve: int) -> Prompt:
    return query if isinstance(query, Prompt) else engine.prepare(query, reserve=reserve)


def answer_one(engine, calibration, query, max_new_tokens: int = 32, stop_strings=("\n",),
               stop_fn=None) -> Generation:
    cal = calibration_of(calibration)
    prompt = query_prompt(engine, query, max_new_tokens)
    return engine.generate(prompt, full_embeddings(engine, cal, prompt), max_new_tokens=max_new_tokens,
                           stop_strings=stop_strings, stop_fn=stop_fn)


def answer_batch(engine, calibration, queries, max_new_tokens: int = 32, stop_strings=("\n",)) -> list[Generation]:
    cal = calibration_of(calibration)
    return [answer_one(engine, cal, q, max_new_tokens, stop_strings) for q in queries]


def answer_result(engine, res, prompt: Prompt, max_new_tokens: int = 32, stop_strings=("\n",),
                  stop_fn=None) -> Generation:
    """The greedy answer for `prompt` after its calibration `res` (Engine.calibrate's result, reused or not)."""
    return engine.generate(prompt, res.embeddings, max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                           stop_fn=stop_fn)


__all__ = ["answer_one", "answer_batch", "answer_result", "calibration_of", "query_prompt"]
