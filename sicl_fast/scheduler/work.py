"""The work a flow yields to the scheduler, one kind a lane:

    Calibrate(prompt, config, reuse, time_budget_s, on_step)  -> a CalibrationResult (Engine.calibrate's): answered
        at once from the store's memory when it holds the prompt's calibration (Engine.stored_result), else a
        calibration in flight, stopped by the request's deadline, cancellation or the drain at a step boundary
    Answer(prompt, max_new_tokens, stop_strings, on_text, calibration=, embeddings=)  -> a Generation: one row of
        the decode batch of its prefix: a stored calibration's rows [0, b) (`calibration`), else the rows of
        `embeddings` [L, d] (a run without the store), else the prompt's own (its uncalibrated answer)
    Call(fn)  -> fn(engine): anything else on the engine, run whole as one unit (a proxy)

on_text(text): called with the decoded text after each token of the answer (streaming); on_step(step, f): each
calibration step's proxy, as Engine.calibrate's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..calibration.ascent import CalibrationConfig, CalibrationResult
from ..formats.spans import Prompt


@dataclass(eq=False)
class Calibrate:
    prompt: Prompt
    config: CalibrationConfig
    reuse: str | None = None  # the engine's plan's mode when None (Engine.calibrate)
    time_budget_s: float | None = None
    on_step: Callable[[int, float], None] | None = None


@dataclass(eq=False)
class Answer:
    prompt: Prompt
    max_new_tokens: int = 32
    stop_strings: tuple[str, ...] = ("\n",)
    on_text: Callable[[str], Any] | None = None
    calibration: Any = None  # a stored Calibration whose rows [0, b) the prompt's are (answering.reuse.fits)
    embeddings: torch.Tensor | None = None  # X [L, d]: the answer of these embeddings (no calibration given)

    @classmethod
    def after(cls, res: CalibrationResult, prompt: Prompt, max_new_tokens: int = 32, stop_strings=("\n",),
              on_text=None) -> Answer:
        """The answer after a calibration: from the stored calibration it holds, else from its embeddings (as
        answering.answer.answer_result)."""
        cal = getattr(res, "calibration", None)
        return cls(prompt, max_new_tokens, tuple(stop_strings), on_text, calibration=cal,
                   embeddings=None if cal is not None else res.embeddings)


@dataclass(eq=False)
class Call:
    fn: Callable[[Any], Any]


WORK = (Calibrate, Answer, Call)

__all__ = ["Calibrate", "Answer", "Call", "WORK"]
