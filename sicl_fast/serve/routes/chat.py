"""POST /v1/chat/completions: the OpenAI Chat Completions API over a calibrated few-shot prompt.

    messages   system? (user assistant)+ user: the instruction, the demonstrations (each assistant turn an output
               span), the query (sicl_fast.answering.chat renders them with the model's chat template)
    sicl       extra body field: CalibrationConfig knobs and /v1/calibrate's run options: "reuse" ('auto' | 'on' |
               'off'), "timeout_s", "time_budget_s" (schema.RunOptions)
    ->         a chat.completion object (choices, finish_reason, usage) plus "sicl": the calibration's summary and
               what the store did (reused, reuse, key, exact); with "stream": true, chat.completion.chunk server-sent
               events ending with "data: [DONE]" (the last chunk carries finish_reason and "sicl"; with
               stream_options.include_usage a usage chunk follows)

Decoding is greedy: temperature (0 only), top_p (1 only) and n (1 only) are accepted for compatibility. Errors are
OpenAI error objects (errors.py): a bad request is a 400, a wrong key a 401, an unknown model a 404.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ...calibration.ascent import CalibrationConfig, CalibrationResult
from ...answering.chat import StreamCut, render
from ...errors import SiclError
from ...backends.generate import check_stops
from ...answering.reuse import reuse_info
from ...formats.spans import Prompt
from ...scheduler import Answer, Cancelled, ShuttingDown
from ..dispatch import POLL_S, outcome, read_call, run_job, submit, timing, watch
from ..errors import ServeHTTPError, from_sicl_error
from ..jobs import calibrated
from ..metrics import note
from ..openapi import body_doc
from ..schema import CalibrationKnobs, RunOptions
from ..state import ServeState, serve_state

router = APIRouter(tags=["openai"])
log = logging.getLogger("sicl_fast.serve")

_OPEN = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ChatMessage(BaseModel):
    """One message. What the OpenAI API allows beyond text (image, audio and file parts; tool calls) is taken here
    and refused by sicl_fast.answering.chat with a message that names it, not with the schema's branches."""

    model_config = _OPEN
    role: str = Field(description="system (or developer), user, assistant")
    content: str | list[dict[str, Any]] | None = Field(
        None, description='a string or a list of text parts {"type": "text", "text": ...}; other parts (images, '
                          'audio, files) are not supported')
    name: str | None = Field(None, description="not supported (refused): the chat template renders roles only")
    tool_calls: list[Any] | None = Field(None, description="not supported (refused): the turns are text")
    function_call: Any = Field(None, description="not supported (refused)")
    tool_call_id: str | None = Field(None, description="not supported (refused)")


class StreamOptions(BaseModel):
    model_config = _OPEN
    include_usage: bool = False


class SiclOptions(CalibrationKnobs, RunOptions):
    """The `sicl` extra body field: CalibrationConfig knobs, and the run options of /v1/calibrate (reuse, timeout_s,
    time_budget_s)."""


class ChatBody(BaseModel):
    """POST /v1/chat/completions (the OpenAI Chat Completions request, greedy decoding, plus `sicl`)."""

    model_config = _OPEN
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="0 only: decoding is greedy")
    top_p: float | None = Field(None, description="1 only")
    n: int | None = Field(None, description="1 only")
    logprobs: bool | None = Field(None, description="false only: no log-probabilities are returned")
    top_logprobs: int | None = Field(None, description="0 only")
    presence_penalty: float | None = Field(None, description="0 only")
    frequency_penalty: float | None = Field(None, description="0 only")
    seed: int | None = Field(None, description="any: greedy decoding gives one answer whatever the seed (the "
                                               "calibration's seed is sicl.seed)")
    user: str | None = None
    sicl: SiclOptions | None = Field(None, description="calibration knobs, reuse, timeout_s, time_budget_s")


BODIES = (ChatBody,)
KNOBS = tuple(f.name for f in dataclasses.fields(CalibrationConfig))


@dataclass(frozen=True)
class ChatCall:
    prompt: Prompt
    config: CalibrationConfig
    reuse: str | None
    max_new_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    timeout_s: float | None
    time_budget_s: float | None


def chat_call(state: ServeState, body: ChatBody, rid: str) -> ChatCall:
    """The body as an engine call, with the server's caps (runs before the job is queued)."""
    engine, settings = state.engine, state.settings
    if body.model != engine.lm.name:
        raise ServeHTTPError(404, "model_not_found", f"model {body.model!r} is not served here; this server serves "
                                                     f"{engine.lm.name!r} (GET /v1/models)")
    # the sampling fields a client may send with their neutral values (front ends often send them all): accepted
    # at those values, the only ones greedy decoding has
    neutral = (("temperature", body.temperature, 0), ("top_p", body.top_p, 1), ("n", body.n, 1),
               ("logprobs", body.logprobs, False), ("top_logprobs", body.top_logprobs, 0),
               ("presence_penalty", body.presence_penalty, 0), ("frequency_penalty", body.frequency_penalty, 0))
    for name, value, allowed in neutral:
        if value is not None and value != allowed:
            raise ServeHTTPError(400, "invalid_request", f"field {name!r}: only {json.dumps(allowed)} is supported "
                                                         "(the answer is decoded greedily from the calibrated prompt)")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"  # what was sent
    new = state.validator.new_tokens(getattr(body, field), rid, field, default=settings.max_new_tokens)
    request = render(engine.lm, [m.model_dump() for m in body.messages], rid)
    prompt = state.validator.prompt(request, reserve=new)
    sicl = body.sicl.model_dump(exclude_none=True) if body.sicl is not None else {}
    knobs = CalibrationKnobs(**{k: v for k, v in sicl.items() if k in KNOBS})
    stop = check_stops((body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
                       f"request {rid!r}: field 'stop'")
    state.scheduler.refuse_alone(Answer(prompt, new, stop), least=True)  # before its calibration runs
    return ChatCall(prompt=prompt, config=state.validator.config(knobs, rid), reuse=sicl.get("reuse"),
                    max_new_tokens=new, stop=stop, stream=body.stream,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                    timeout_s=sicl.get("timeout_s"), time_budget_s=sicl.get("time_budget_s"))


def note_sicl(request, sicl: dict) -> None:
    """The calibration on the request's log line: steps, proxy before -> after, how the store served it."""
    note(request, steps=sicl["steps"], proxy=(sicl["initial_proxy"], sicl["best_proxy"]), reuse=sicl["reuse"])


async def read_chat(request: Request, state: ServeState) -> ChatCall:
    """The call, every refusal of the body a 400 (the OpenAI API's status for a bad request)."""
    try:
        return await read_call(request, ChatBody, lambda body: chat_call(state, body, request.state.request_id))
    except ServeHTTPError as exc:
        if exc.status == 422:
            raise ServeHTTPError(400, exc.kind, exc.message, exc.headers) from None
        raise
    except SiclError as exc:
        raise from_sicl_error(exc, 400) from None


def chat_flow(state: ServeState, call: ChatCall, push=None):
    """The request on the scheduler: its calibration (through the store), then its answer as a row of the decode
    batch of its calibration; push(delta) streams the answer as it is decoded."""
    metrics = state.metrics
    res = yield from calibrated(call, lambda step, f: metrics.steps.inc(),
                                lambda res: metrics.calibration_done(res.steps, res.seconds))
    cut = StreamCut(call.stop)

    def on_text(text: str) -> None:
        if push is not None and (delta := cut.push(text)):
            push(delta)

    gen = yield Answer.after(res, call.prompt, call.max_new_tokens, call.stop, on_text)
    sicl = {**CalibrationResult.summary(res), **reuse_info(res)}
    return {"content": gen.answer, "rest": cut.finish(gen.answer), "completion_tokens": len(gen.token_ids),
            "finish_reason": "length" if gen.stop_reason == "max_new_tokens" else "stop", "sicl": sicl}


def usage(call: ChatCall, out: dict) -> dict:
    n = out["completion_tokens"]
    return {"prompt_tokens": call.prompt.length, "completion_tokens": n, "total_tokens": call.prompt.length + n}


@router.post("/v1/chat/completions", openapi_extra=body_doc(ChatBody))
async def chat_completions(request: Request, state: ServeState = Depends(serve_state)):
    """OpenAI Chat Completions: the last user turn answered from the calibrated few-shot conversation."""
    call = await read_chat(request, state)
    note(request, id=call.prompt.id)
    head = {"id": f"chatcmpl-{request.state.request_id}", "created": int(time.time()), "model": state.engine.lm.name}
    deadline = time.monotonic() + call.timeout_s if call.timeout_s is not None else None
    if call.stream:
        return await stream(request, state, call, head, deadline)
    out, ticket = await run_job(request, "chat", chat_flow(state, call), deadline, limit_status=400)
    note_sicl(request, out["sicl"])
    return {**head, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out["content"], "refusal": None},
                         "finish_reason": out["finish_reason"], "logprobs": None}],
            "usage": usage(call, out), "sicl": {**out["sicl"], "timing": timing(ticket)}}


def sse(obj) -> bytes:
    """One server-sent event holding a JSON object."""
    return f"data: {json.dumps(obj)}\n\n".encode()


async def stream(request: Request, state: ServeState, call: ChatCall, head: dict, deadline) -> StreamingResponse:
    """The request is submitted and admitted first (a full queue is still a 429, before any byte is sent); the reply
    then sends the role, the answer's deltas as the scheduler decodes them, the last chunk, the usage chunk, and
    [DONE]. A client that goes away cancels the request: its answer leaves the batch at the next token."""
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue = asyncio.Queue()
    push = lambda text: loop.call_soon_threadsafe(deltas.put_nowait, text)  # noqa: E731 (from the scheduler)
    ticket = submit(request, "chat", chat_flow(state, call, push), deadline)
    await watch(request, ticket, ticket.decided)  # admitted, or ended (a 429, a 503, an error: replied as such)
    if ticket.done:
        outcome(request, ticket, limit_status=400)
    fut = asyncio.wrap_future(ticket.future)

    def chunk(delta: dict, finish=None, **extra) -> bytes:
        return sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra})

    async def events():
        try:
            yield chunk({"role": "assistant", "content": ""})
            while not (fut.done() and deltas.empty()):
                get = asyncio.ensure_future(deltas.get())
                done, _ = await asyncio.wait({get, fut}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    yield chunk({"content": get.result()})
                    continue
                get.cancel()
                if not done and (await request.is_disconnected() or state.shutdown.expired()):
                    ticket.cancel()
                    return
            try:
                out = fut.result()
            except Cancelled:
                return
            except Exception as exc:  # noqa: BLE001 - the reply has begun: the error goes in the stream
                rid = request.state.request_id
                if not isinstance(exc, (SiclError, ShuttingDown)):
                    log.error("internal error in request %s (chat, streaming)", rid, exc_info=exc)
                err = (from_sicl_error(exc) if isinstance(exc, SiclError) else
                       ServeHTTPError(503, "shutting_down", "the server shut down before this request was answered")
                       if isinstance(exc, ShuttingDown) else
                       ServeHTTPError(500, "internal", f"internal error ({type(exc).__name__}) (request id {rid})"))
                yield sse({"error": {"message": err.message, "type": "server_error", "code": err.kind,
                                     "param": None}})
                return
            if out["rest"]:
                yield chunk({"content": out["rest"]})
            yield chunk({}, out["finish_reason"], sicl=out["sicl"])
            if call.include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": [],
                           "usage": usage(call, out)})
            yield b"data: [DONE]\n\n"
            note_sicl(request, out["sicl"])
        finally:
            ticket.cancel()  # a no-op once the request is over; stops it when the client went away mid-stream
            fut.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


__all__ = ["router", "BODIES", "ChatBody", "chat_call", "chat_flow"]
