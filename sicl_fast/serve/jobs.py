"""What a queued job does on the engine (on the worker thread): the proxy, or a calibration with its answers and
embeddings. Each returns the JSON-ready response body."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..ascent import Calibrator
from ..export import CalibratedEmbeddings
from ..records import proxy_record
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
    res = Calibrator(engine.backend, call.config).run(prompt, on_step=on_step, should_stop=job.stop_reason,
                                                      time_budget_s=call.time_budget_s)
    if res.stop_reason == "cancelled":
        raise Cancelled()
    body = {"id": prompt.id, "model": engine.lm.name, "summary": res.summary(), "history": res.history,
            "config": dataclasses.asdict(res.config), "prompt": prompt_info(prompt)}
    if call.generate:
        # a cancellation mid-decoding stops it at the next token (the reply is dropped anyway)
        def gen(embeds):
            return engine.generate(prompt, embeds, max_new_tokens=call.max_new_tokens, stop_strings=call.stop,
                                   stop_fn=lambda _text: job.cancelled).answer
        body["answers"] = {"base": gen(None), "calibrated": gen(res.embeddings)}
        if job.cancelled:
            raise Cancelled()
    if call.return_embeddings:
        emb = CalibratedEmbeddings.from_result(prompt, res.embeddings, engine.lm.name, rows=call.embeddings_rows,
                                               dtype=call.embeddings_dtype)
        body["embeddings"] = emb.to_json()
    return body
