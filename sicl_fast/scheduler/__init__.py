"""The scheduler that owns an engine and runs it in iterations, as vLLM's does: answers decode together (one batch
per calibration prefix, joining at the next token and leaving at their stop), calibrations step between them (one
at a time, or as slots of the packed step where `pack` says so), within limits on rows, tokens and bytes in flight.
The server (sicl_fast.serve) is one front end of it; a Python program is another (Engine.scheduler()).

    tickets.py        Ticket (one request: its flow, future, deadline, cancellation, timing); QueueFull,
                      Cancelled, ShuttingDown
    work.py           what a flow yields: Calibrate, Answer, Call
    limits.py         Limits and what each piece of work costs in rows, tokens and bytes
    answers.py        the answers lane: a decode batch per prefix (answering.decode_batch)
    calibrations.py   the calibrations lane: one at a time in turns (coroutine.py), or slots of the packed step
    coroutine.py      a function that runs in turns on a thread of its own (Engine.calibrate between steps)
    loop.py           Scheduler: intake, admission, the iterations, fair share of the engine, drain and close
"""
from __future__ import annotations

from .limits import Cost, Limits
from .loop import Observer, Scheduler, engine_lock
from .tickets import Cancelled, QueueFull, ShuttingDown, Ticket
from .work import Answer, Calibrate, Call

__all__ = ["Scheduler", "Limits", "Cost", "Observer", "engine_lock", "Ticket", "QueueFull", "Cancelled",
           "ShuttingDown", "Calibrate", "Answer", "Call"]
