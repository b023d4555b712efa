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
kept in memory only, counted in `nbytes` (the memory store's budget). `Expected` is what a lookup of a key expects
its entry to be (from its prompt and the engine's model): the disk store checks every entry it reads against it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..calibration.ascent import CalibrationConfig, CalibrationResult
from ..formats.inputs import of_type

SCOPES = ("stem", "prompt")
NUMBER = (int, float)
# every field of an entry's metadata (Calibration.meta, the disk store's sidecar "meta") and the JSON types it may
# hold: an entry whose metadata lacks one, has another or holds another type is corrupt (meta_problem), never served
META = {"key": str, "scope": str, "token_spans": list, "demo_start": int, "demo_end": int, "initial_proxy": NUMBER,
        "best_proxy": NUMBER, "steps": int, "best_step": int, "gated": bool, "stop_reason": str, "history": list,
        "projections": int, "seconds": NUMBER, "config": dict, "impl": str, "model": str, "exact": bool,
        "min_cosine": (*NUMBER, type(None))}


def fields_problem(obj, schema: dict, what: str) -> str | None:
    """Why the parsed JSON `obj` is not an object with exactly the fields of `schema`, each of its type (of_type), or
    None; `what` names it in the message ('the sidecar', 'the metadata')."""
    if not isinstance(obj, dict):
        return f"{what} is a JSON {type(obj).__name__}, not an object"
    missing, extra = sorted(schema.keys() - obj.keys()), sorted(obj.keys() - schema.keys())
    if missing:
        return f"{what} lacks {', '.join(missing)}"
    if extra:
        return f"{what} has unknown fields {', '.join(extra)}"
    wrong = [name for name, typ in schema.items() if not of_type(obj[name], typ)]
    if wrong:
        return f"{what}'s {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} of the wrong type"
    return None


def meta_problem(meta) -> str | None:
    """Why `meta` (parsed JSON) cannot be an entry's metadata, or None: its fields and their types (META), the scope
    one of SCOPES, the token spans pairs of ints, the history numbers (the config is checked by CalibrationConfig
    itself when the entry is built)."""
    why = fields_problem(meta, META, "the metadata")
    if why is not None:
        return why
    if meta["scope"] not in SCOPES:
        return f"the metadata's scope {meta['scope']!r} is not one of {', '.join(SCOPES)}"
    if not all(isinstance(s, list) and len(s) == 2 and all(of_type(x, int) for x in s) for s in meta["token_spans"]):
        return "the metadata's token_spans are not pairs of token positions"
    if not all(of_type(x, NUMBER) for x in meta["history"]):
        return "the metadata's history holds a value that is not a number"
    return None


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
        """The entry of metadata `meta` (Calibration.meta's, passed by meta_problem) and its tensors."""
        fields = dict(meta)
        fields["token_spans"] = tuple(tuple(s) for s in meta["token_spans"])
        fields["config"] = CalibrationConfig(**meta["config"])
        return cls(rows=rows, input_ids=input_ids, **fields)

    def summary(self) -> dict:
        """As CalibrationResult.summary (the calibration's own seconds)."""
        return {"initial_proxy": self.initial_proxy, "best_proxy": self.best_proxy, "steps": self.steps,
                "best_step": self.best_step, "gated": self.gated, "stop_reason": self.stop_reason,
                "seconds": round(self.seconds, 4), "projections": self.projections, "impl": self.impl}


@dataclass(frozen=True)
class Expected:
    """What a lookup of a key expects its entry to be, from the prompt it serves and the engine's model: the key is
    a hash of these, so an entry that differs is damaged (or forged) whatever its checksums say.

    scope       'stem' or 'prompt' (n: demo_end, or the prompt's length)
    input_ids   [n] int64: the token ids of rows [0, n)
    token_spans, demo_start, demo_end: the prompt's
    width       the model's hidden size d (rows [n, d] float32)"""

    scope: str
    input_ids: torch.Tensor
    token_spans: tuple[tuple[int, int], ...]
    demo_start: int
    demo_end: int
    width: int

    @classmethod
    def of(cls, prompt, scope: str, width: int) -> Expected:
        n = prompt.demo_end if scope == "stem" else prompt.length
        return cls(scope=scope, input_ids=prompt.input_ids[:n], token_spans=tuple(prompt.token_spans),
                   demo_start=prompt.demo_start, demo_end=prompt.demo_end, width=width)

    def problem(self, cal: Calibration) -> str | None:
        """Why `cal` cannot be what this key serves (None: it can): its scope, its rows' width, dtype and count, its
        token ids, spans and demonstration rows, and every number it serves finite (rows, proxies, history). The
        types of its metadata's fields were checked when it was read (meta_problem)."""
        n, rows = self.input_ids.numel(), cal.rows
        if cal.scope != self.scope:
            return f"scope {cal.scope!r} under a {self.scope!r} key"
        if rows.dim() != 2 or rows.shape[1] != self.width or rows.dtype != torch.float32:
            return (f"rows of shape {tuple(rows.shape)} and dtype {str(rows.dtype).replace('torch.', '')}; the model "
                    f"takes [n, {self.width}] float32")
        if rows.shape[0] != n:
            what = f"the key's demo_end is {self.demo_end}" if self.scope == "stem" else f"the prompt has {n} tokens"
            return f"{rows.shape[0]} rows; {what}"
        if cal.input_ids.shape != self.input_ids.shape or not torch.equal(cal.input_ids, self.input_ids.cpu()):
            return "token ids other than the key's"
        if (tuple(map(tuple, cal.token_spans)), cal.demo_start, cal.demo_end) != (
                self.token_spans, self.demo_start, self.demo_end):
            return "token spans or demonstration rows other than the key's"
        if not bool(torch.isfinite(rows).all()):
            return "rows that hold NaN or inf"
        numbers = [cal.initial_proxy, cal.best_proxy, *cal.history] + ([cal.min_cosine] if cal.min_cosine is not None
                                                                       else [])
        if not all(of_type(x, NUMBER) and math.isfinite(x) for x in numbers):
            return "a proxy, history value or cosine that is not a finite number"
        counts = (cal.steps, cal.best_step, cal.projections)
        if not all(of_type(x, int) and x >= 0 for x in counts) or cal.best_step > cal.steps:
            return "step counts of the wrong type or out of range"
        return None


__all__ = ["Calibration", "Expected", "META", "SCOPES", "fields_problem", "meta_problem"]
