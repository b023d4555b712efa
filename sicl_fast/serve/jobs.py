"""What a queued job does on the engine (on the worker thread): the proxy, or a calibration with its answers and
embeddings. Each returns the JSON-ready response body."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..answering.answer import answer_result
from ..calibration.ascent import CalibrationResult
from ..answering.export import CalibratedEmbeddings
from ..answering.reuse import reuse_info
from ..formats.records import proxy_record
from .queue import Cancelled, Job
from .validate import CalibrateCall, ProxyCall


def prompt_info(prompt) -> dict:
    return {"length": prompt.length, "demo_start": prompt.demo_start, "demo_end": prompt.demo_end,
            "token_spans": [list(s) for s in prompt.token_spans]}


def run_proxy(engine, call: ProxyCall, job: Job) -> dict:
    out = engine.proxy(call.prompt, call.config)
    return {**proxy_record(call.prompt, out), "c": [float(x) for x in out.c[0]], "prompt": prompt_info(call.prompt)}


def run_calibrate(engine, call: CalibrateCall, job: Job, on_step: Callable[[int, float], None] | None = None) -> dict:
    """The ascent (stopped early by the job's deadline, its cancellation or the request's time budget), then the
    optional answers and rows."""
    prompt = call.prompt
    res = engine.calibrate(prompt, call.config, on_step=on_step, reuse=call.reuse, should_stop=job.stop_reason,
                           time_budget_s=call.time_budget_s)
    if res.stop_reason == "cancelled":
        raise Cancelled()
    body = {"id": prompt.id, "model": engine.lm.name, "summary": CalibrationResult.summary(res), "history": res.history,
            "config": dataclasses.asdict(res.config), "prompt": prompt_info(prompt)}
    body["reuse"] = reuse_info(res)
    if call.generate:
        # a cancellation mid-decoding stops it at the next token (the reply is dropped anyway)
        stop = dict(max_new_tokens=call.max_new_tokens, stop_strings=call.stop, stop_fn=lambda _text: job.cancelled)
        body["answers"] = {"base": engine.generate(prompt, **stop).answer,
                           "calibrated": answer_result(engine, res, prompt, **stop).answer}
        if job.cancelled:
            raise Cancelled()
    if call.return_embeddings:
        emb = CalibratedEmbeddings.from_result(prompt, res.embeddings, engine.lm.name, rows=call.embeddings_rows,
                                               dtype=call.embeddings_dtype)
        body["embeddings"] = emb.to_json()
    return body
