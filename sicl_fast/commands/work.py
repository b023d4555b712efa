"""The `calibrate` command's work functions, run by sicl_fast.run.workers in this process or on a Ray actor.

Each takes the worker's Engine first and returns plain records, so the driver alone writes the results file.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..answering.answer import answer_result
from ..answering.reuse import reuse_info
from ..calibration.ascent import CalibrationConfig
from ..answering.export import CalibratedEmbeddings
from ..formats.requests import Request
from ..run.settings import fallback_settings


def check_requests(
    engine, requests: Sequence[Request], reserve: int = 0, config: CalibrationConfig | None = None
) -> int:
    """Tokenize every request (a RequestError names the first bad one) and, with `config`, refuse what calibrating
    them would refuse on the way (Engine.check_steps: a step too big for memory, with --pack P P such steps at once;
    packed prompts of different rotary tables), before anything is written; returns the count."""
    prompts = [engine.prepare(r, reserve=reserve) for r in requests]
    if config is not None:
        engine.check_steps(prompts, [config])
    return len(requests)


def group_requests(engine, requests: Sequence[Request], config: CalibrationConfig) -> list[list[int]]:
    """The requests' indices grouped by the key of their calibration (sicl_fast.answering.reuse: the same instruction,
    demonstrations and config), groups in order of first appearance. A request that cannot share its calibration
    (its query is perturbed) is a group of its own."""
    cfg = engine.reuser.resolve(engine.config(config))
    groups: dict = {}
    for i, r in enumerate(requests):
        key = i if cfg.perturb_query else engine.reuser.key(engine.prepare(r), cfg)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def calibrate_settings(args, engine: dict, config: CalibrationConfig, max_new_tokens: int) -> dict:
    """The settings of calibrate's records (sicl_fast.run.settings): the engine's part, the config, the time budget,
    the special tokens and the outputs the flags add (answers: their length and stop strings; exported
    embeddings)."""
    from ..run.settings import run_settings

    gen = bool(args.generate)
    outputs = {"generate": gen, "max_new_tokens": max_new_tokens if gen else None,
               "stop": list(args.stop or ["\n"]) if gen else None, "export": bool(args.export)}
    return run_settings("calibrate", engine, config, time_budget_s=args.time_budget,
                        add_special_tokens=bool(args.add_special_tokens), outputs=outputs)


def store_counts(engine) -> dict:
    """How many of the engine's calibrations came from its store, and how many ran."""
    return dict(engine.reuser.counts)


def calibrate_requests(engine, requests: Sequence[Request], config: CalibrationConfig, max_new_tokens: int = 32,
                       stop_strings: Sequence[str] | None = None, generate: bool = False,
                       export: bool = False, time_budget_s: float | None = None) -> list[dict]:
    """The records of a chunk of requests (one, or engine.plan.pack of them, calibrated packed): id and the calibration
    summary; with `generate`, answer_base and answer_calibrated (greedy, at most max_new_tokens, stopping at
    stop_strings); with `export`, the calibrated embeddings (every row) as a CalibratedEmbeddings under
    "embeddings", for the driver to save (sicl_fast.answering.export.ExportingWriter); time_budget_s: each calibration's
    (Engine.calibrate; the summary's stop_reason says "time_budget" when it ended one). In the order of
    `requests`. The calibrated answers of the requests that share a stored calibration (a group of the calibration
    store, answering.reuse) are decoded together at the end, as Engine.answer_many batches: the same tokens as one
    by one (tests/test_answer.py), several times faster."""
    prompts = [engine.prepare(r, reserve=max_new_tokens if generate else 0) for r in requests]
    records: list = [None] * len(prompts)
    stops = list(stop_strings or ["\n"])
    shared: dict[int, tuple] = {}  # id(calibration) -> (calibration, the indices of its requests)

    def record(i: int, res) -> None:
        p = prompts[i]
        rec = {"id": p.id, **res.summary(), **reuse_info(res)}  # the packed step's and reuse off's too
        if generate:
            rec["answer_base"] = engine.generate(p, max_new_tokens=max_new_tokens, stop_strings=stops).answer
            cal = getattr(res, "calibration", None)
            if cal is not None:
                rec["answer_calibrated"] = None  # below, with the other queries of its calibration
                shared.setdefault(id(cal), (cal, []))[1].append(i)
            else:
                rec["answer_calibrated"] = answer_result(engine, res, p, max_new_tokens, stops).answer
        if export:
            rec["embeddings"] = CalibratedEmbeddings.from_result(p, res.embeddings, engine.lm.name, rows="all")
        rec.update(fallback_settings(engine))  # after a failed capture check: what the run went on with
        records[i] = rec

    engine.calibrate_many(prompts, config, on_result=record, time_budget_s=time_budget_s)
    for cal, idx in shared.values():
        for i, gen in zip(idx, engine.answer_many(cal, [prompts[i] for i in idx], max_new_tokens, stops)):
            records[i]["answer_calibrated"] = gen.answer
    return records


__all__ = ["check_requests", "group_requests", "calibrate_settings", "store_counts", "calibrate_requests"]
