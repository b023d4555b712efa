"""Calibration: the stored object, what one calibration of rows [0, n) of a prompt leaves behind.

A prompt's calibration depends only on its rows [0, b) (instruction and demonstrations, up to the end of the last
output span): the forwards, the proxy, the gate, patience and best X read nothing after b. So it is stored by
content (sicl_fast.store.keys) and serves every query that follows the same rows. Two scopes:

    "stem"    rows [0, b): query-free; serves any prompt whose rows [0, b) have these token ids
    "prompt"  rows [0, L): one whole prompt, query included (a calibration that depended on its query: a
              whole-matrix projection fired, or the query changed the tokens of rows [0, b); kept for reruns)

    rows       [n, d] float32   the best X found, rows [0, n)
    input_ids  [n] int64        the token ids of those rows (the boundary check compares them)
    exact      bool             "stem": no query could have changed the result (answering.reuse); "prompt": True
    min_cosine float | None     the lowest whole-matrix cosine any query could have given over the run (None when
                                no whole-matrix projection applies)

The K/V of the calibrated rows (`kv`, for answering a query from its own rows only) is computed on first use and
kept in memory only, counted in `nbytes` (the memory store's budget).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..calibration.ascent import CalibrationConfig, CalibrationResult

SCOPES = ("stem", "prompt")


@dataclass
class Calibration:
    key: str
    scope: str
    rows: torch.Tensor
    input_ids: torch.Tensor
    token_spans: tuple[tuple[int, int], ...]
    demo_start: int
    demo_end: int
    initial_proxy: float
    best_proxy: float
    steps: int
    best_step: int
    gated: bool
    stop_reason: str
    history: list[float]
    projections: int
    seconds: float
    config: CalibrationConfig
    impl: str
    model: str
    exact: bool
    min_cosine: float | None = None
    kv: Any = field(default=None, repr=False, compare=False)  # runtime only (sicl_fast.answering.answer)

    @property
    def length(self) -> int:
        """n: the rows this calibration covers."""
        return int(self.input_ids.numel())

    @property
    def nbytes(self) -> int:
        """Memory held: rows, ids, history and the K/V when attached."""
        kv = self.kv.nbytes if self.kv is not None else 0
        return self.rows.numel() * self.rows.element_size() + self.input_ids.numel() * 8 + 8 * len(self.history) + kv

    @classmethod
    def from_result(cls, key: str, scope: str, res: CalibrationResult, prompt, n: int, model: str, exact: bool,
                    min_cosine: float | None) -> Calibration:
        """Rows [0, n) of a finished calibration of `prompt` (a Prompt whose first n ids these rows are)."""
        return cls(key=key, scope=scope, rows=res.embeddings[:n].detach().float().cpu().contiguous().clone(),
                   input_ids=prompt.input_ids[:n].clone(), token_spans=tuple(prompt.token_spans),
                   demo_start=prompt.demo_start, demo_end=prompt.demo_end, initial_proxy=res.initial_proxy,
                   best_proxy=res.best_proxy, steps=res.steps, best_step=res.best_step, gated=res.gated,
                   stop_reason=res.stop_reason, history=list(res.history), projections=res.projections,
                   seconds=res.seconds, config=res.config, impl=res.impl, model=model, exact=exact,
                   min_cosine=min_cosine)

    def meta(self) -> dict:
        """Everything but the tensors, JSON-ready (the disk store's sidecar)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rows", "input_ids", "kv", "config")}
        out["token_spans"] = [list(s) for s in self.token_spans]
        out["config"] = dataclasses.asdict(self.config)
        return out

    @classmethod
    def from_parts(cls, meta: dict, rows: torch.Tensor, input_ids: torch.Tensor) -> Calibration:
        fields = dict(meta)
        fields["token_spans"] = tuple(tuple(s) for s in meta["token_spans"])
        fields["config"] = CalibrationConfig(**meta["config"])
        return cls(rows=rows, input_ids=input_ids, **fields)

    def summary(self) -> dict:
        """As CalibrationResult.summary (the calibration's own seconds)."""
        return {"initial_proxy": self.initial_proxy, "best_proxy": self.best_proxy, "steps": self.steps,
                "best_step": self.best_step, "gated": self.gated, "stop_reason": self.stop_reason,
                "seconds": round(self.seconds, 4), "projections": self.projections, "impl": self.impl}


__all__ = ["Calibration", "SCOPES"]
