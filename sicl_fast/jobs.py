"""The `calibrate` command's work functions, run by sicl_fast.workers in this process or on a Ray actor.

Each takes the worker's Engine first and returns plain records, so the driver alone writes the results file.
"""
from __future__ import annotations

from typing import Sequence

from .ascent import CalibrationConfig
from .requests import Request


def check_requests(engine, requests: Sequence[Request], reserve: int = 0) -> int:
    """Tokenize every request (a RequestError names the first bad one) before anything is written; returns the count."""
    for r in requests:
        engine.prepare(r, reserve=reserve)
    return len(requests)


def calibrate_request(engine, request: Request, config: CalibrationConfig, max_new_tokens: int = 32,
                      stop_strings: Sequence[str] | None = None, generate: bool = False) -> list[dict]:
    """[record] of one request: id and the calibration summary; with `generate`, answer_base and answer_calibrated
    (greedy, at most max_new_tokens, stopping at stop_strings)."""
    prompt = engine.prepare(request, reserve=max_new_tokens if generate else 0)
    res = engine.calibrate(prompt, config)
    rec = {"id": prompt.id, **res.summary()}
    if generate:
        stops = list(stop_strings or ["\n"])
        rec["answer_base"] = engine.generate(prompt, max_new_tokens=max_new_tokens, stop_strings=stops).answer
        rec["answer_calibrated"] = engine.generate(prompt, res.embeddings, max_new_tokens=max_new_tokens,
                                                   stop_strings=stops).answer
    return [rec]


__all__ = ["check_requests", "calibrate_request"]
