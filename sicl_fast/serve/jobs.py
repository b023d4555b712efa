"""What a request does on the engine, as a flow of the scheduler (sicl_fast.scheduler): the proxy (a call), or a
calibration with its answers (two rows of the decode batch: the uncalibrated prompt's and the calibrated one's)
and embeddings. Each returns the JSON-ready response body; it runs on the scheduler's thread between its yields."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..answering.export import CalibratedEmbeddings
from ..answering.reuse import reuse_info
from ..calibration.ascent import CalibrationResult
from ..formats.records import proxy_record
from ..scheduler import Answer, Calibrate, Call, Cancelled
from .validate import CalibrateCall, ProxyCall


def prompt_info(prompt) -> dict:
    return {"length": prompt.length, "demo_start": prompt.demo_start, "demo_end": prompt.demo_end,
            "token_spans": [list(s) for s in prompt.token_spans]}


def run_proxy(engine, call: ProxyCall) -> dict:
    out = engine.proxy(call.prompt, call.config)
    return {**proxy_record(call.prompt, out), "c": [float(x) for x in out.c[0]], "prompt": prompt_info(call.prompt)}


def proxy_flow(call: ProxyCall):
    return (yield Call(lambda engine: run_proxy(engine, call)))


def calibrated(call, on_step: Callable[[int, float], None] | None, done: Callable[[CalibrationResult], None]):
    """A flow's calibration of call.prompt (the request's run options): its result, Cancelled when its client went
    away; done(result) hears of it (metrics)."""
    res = yield Calibrate(call.prompt, call.config, call.reuse, call.time_budget_s, on_step)
    if res.stop_reason == "cancelled":
        raise Cancelled()
    done(res)
    return res


def refuse_early(scheduler, call: CalibrateCall) -> CalibrateCall:
    """The call, once its answers are known to fit the scheduler's limits (the uncalibrated one, priced exactly:
    Scheduler.refuse_alone), so that an answer over a limit is refused before the calibration runs."""
    if call.generate:
        scheduler.refuse_alone(Answer(call.prompt, call.max_new_tokens, call.stop))
    return call


def calibrate_flow(engine, call: CalibrateCall, on_step=None, done=lambda res: None):
    """The ascent (stopped early by the request's deadline, its cancellation or its time budget), then the optional
    answers and rows."""
    prompt = call.prompt
    res = yield from calibrated(call, on_step, done)
    body = {"id": prompt.id, "model": engine.lm.name, "summary": CalibrationResult.summary(res), "history": res.history,
            "config": dataclasses.asdict(res.config), "prompt": prompt_info(prompt)}
    body["reuse"] = reuse_info(res)
    if call.generate:
        base, cal = yield [Answer(prompt, call.max_new_tokens, call.stop),
                           Answer.after(res, prompt, call.max_new_tokens, call.stop)]
        body["answers"] = {"base": base.answer, "calibrated": cal.answer}
    if call.return_embeddings:
        emb = CalibratedEmbeddings.from_result(prompt, res.embeddings, engine.lm.name, rows=call.embeddings_rows,
                                               dtype=call.embeddings_dtype)
        body["embeddings"] = emb.to_json()
    return body
