"""Request bodies: their types (pydantic, strict: "8" is not an int) and their OpenAPI schema.

The prompt itself (`request`) is an object in either JSON form of sicl_fast.formats.requests; it is checked by
`parse_request` and the tokenizer, so the server answers bad spans with the CLI's own messages. The config knobs
are the fields of CalibrationConfig, read from the dataclass so the two never drift apart; their values are
checked by CalibrationConfig itself.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..calibration.ascent import CalibrationConfig
from ..answering.export import ROW_CHOICES, WIRE_DTYPES
from ..run.knobs import RANGES
from ..formats.requests import DEFAULT_TEMPLATE
from ..run.plan import REUSE_MODES

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

# The two request forms, for the OpenAPI page only (parse_request is what checks them). An integer id is taken as its
# decimal string.
_ID = {"type": ["string", "integer"]}
REQUEST_SCHEMA = {
    "description": "One prompt, in either JSON form of a requests JSONL line. 'id' defaults to the server's "
                   "request id.",
    "oneOf": [
        {"title": "raw", "type": "object", "required": ["prompt", "output_spans"], "additionalProperties": False,
         "properties": {"id": _ID, "prompt": {"type": "string"},
                        "output_spans": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                                    "minItems": 2, "maxItems": 2},
                                         "description": "[char_start, char_end) of each demonstrated output"},
                        "demos_start": {"type": "integer", "description": "where the demonstrations begin"}}},
        {"title": "structured", "type": "object", "required": ["demos", "query"], "additionalProperties": False,
         "properties": {"id": _ID, "instruction": {"type": "string"}, "query": {"type": "string"},
                        "demos": {"type": "array", "items": {
                            "type": "object", "properties": {"input": {"type": "string"}, "output": {"type": "string"}},
                            "required": ["input", "output"]}},
                        "template": {"type": "object", "properties": {k: {"type": "string", "default": v}
                                                                      for k, v in DEFAULT_TEMPLATE.items()}}}},
    ],
    "example": {"id": "q1", "instruction": "Write each number word as a digit.",
                "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"}], "query": "five"},
}


def _knobs_model() -> type[BaseModel]:
    """Every CalibrationConfig field, optional (unset: the model family's preset, capped by the server)."""
    hints = typing.get_type_hints(CalibrationConfig)
    fields = {f.name: (hints[f.name] | None, Field(None, description=f"preset: {f.default}"))
              for f in dataclasses.fields(CalibrationConfig)}
    return create_model("CalibrationKnobs", __config__=_STRICT, **fields)


CalibrationKnobs = _knobs_model()


class RunOptions(BaseModel):
    """What a request asks of its calibration besides the knobs: the store, and when to stop it from outside
    (sicl_fast.run.run_args). One definition for /v1/calibrate's body and the chat endpoint's `sicl` object."""

    model_config = _STRICT
    reuse: Literal[REUSE_MODES] | None = Field(  # type: ignore[valid-type]
        None, description="the calibration store (docs/store.md): 'auto' reuses a stored calibration where exact, "
                          "'on' always, 'off' never (default: the server's --reuse)")
    timeout_s: float | None = Field(None, gt=0, description="deadline from arrival; when it passes the best X "
                                                               "so far is returned with stop_reason 'deadline'")
    time_budget_s: float | None = Field(None, ge=0, le=RANGES["time_budget_s"].hi,
                                           description="seconds of calibration, from its start: the run stops at the "
                                                       "first step boundary after them with the best X so far and "
                                                       "stop_reason 'time_budget' (at least one step runs)")


class ProxyBody(BaseModel):
    """POST /v1/proxy: f, C, R, G (and c per demonstration) of the prompt's own embeddings."""

    model_config = _STRICT
    request: dict[str, Any] = Field(json_schema_extra=REQUEST_SCHEMA)
    config: CalibrationKnobs | None = Field(None, description="knobs of CalibrationConfig (alpha, beta, gamma, "
                                                                 "q matter here)")


class CalibrateBody(ProxyBody, RunOptions):
    """POST /v1/calibrate: the ascent on one prompt; optionally both greedy answers and the calibrated rows."""

    generate: bool = Field(False, description="also decode the greedy answers before and after calibration")
    max_new_tokens: int | None = Field(None, ge=0, le=RANGES["max_new_tokens"].hi,
                                       description="tokens an answer may take (default 32, capped by the server's "
                                                   "--max-new-tokens)")
    stop: list[str] | None = Field(None, description="stop strings (default: a newline)")
    return_embeddings: bool = Field(False, description="return the calibrated rows as base64")
    embeddings_dtype: Literal[tuple(WIRE_DTYPES)] = "float32"  # type: ignore[valid-type]
    embeddings_rows: Literal[ROW_CHOICES] = Field(  # type: ignore[valid-type]
        "demos", description="'demos': the perturbed rows [a, b); 'all': every row of the prompt")


def _field_path(loc: tuple, body: Any, missing: bool) -> str:
    """The dotted path of an error's location in the body, without pydantic's union branch names ('str',
    'list[dict[str,any]]', a model's name), which are no field of the body: a part of `loc` names a field when the
    body has it there (a key of that object, an index of that list), or when it is the missing field itself (the
    last part of a 'missing' error); any other part is a branch and is left out."""
    parts, here = [], body
    for k, p in enumerate(loc):
        if isinstance(here, dict) and p in here:
            here = here[p]
        elif isinstance(here, list) and isinstance(p, int) and 0 <= p < len(here):
            here = here[p]
        elif not (missing and k == len(loc) - 1):
            continue  # a union branch's name
        parts.append(str(p))
    return ".".join(parts) or "body"


def validation_message(exc: ValidationError, body: Any) -> str:
    """One line in the CLI's style: request id, the field's dotted path, what is wrong. A value that fits no
    branch of a union (content: a string or a list of parts) is one error of that field, not one per branch."""
    errs = exc.errors()
    paths = list(dict.fromkeys(_field_path(tuple(e["loc"]), body, e["type"] == "missing") for e in errs))
    first = errs[0]
    rid = (
        body.get("request", {}).get("id") if isinstance(body, dict) and isinstance(body.get("request"), dict) else None
    )
    head = f"request {str(rid)!r}: " if rid is not None else ""
    more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
    return f"{head}field {paths[0]!r}: {first['msg']}{more}"


__all__ = ["CalibrationKnobs", "RunOptions", "ProxyBody", "CalibrateBody", "validation_message", "REQUEST_SCHEMA"]
