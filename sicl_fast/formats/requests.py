"""Requests: the two JSON forms a prompt arrives in, their validation, and rendering of structured ones.

raw:        {"id", "prompt", "output_spans": [[char_start, char_end], ...], "demos_start"?: int}
structured: {"id", "demos": [{"input", "output"}, ...], "query", "template"?: {...}, "instruction"?: str}

Both become a `Request`: the full prompt text, the character span [start, end) of every demonstrated output
(in order), and `demos_start`, the character offset where the demonstrations begin. Text before
`demos_start` is the demonstration-free prefix and is never perturbed.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from ..errors import RequestError, SiclWarning, TextError
from .inputs import BOM, json_value, open_input

DEFAULT_TEMPLATE: dict[str, str] = {
    # one demonstration; {input} and {output} are filled in, the output's characters become its span
    "demo": "Input: {input}\nOutput: {output}",
    # between demonstrations, and between the last demonstration and the query
    "separator": "\n\n",
    # the query, which ends with the output delimiter the model continues from
    "query": "Input: {query}\nOutput:",
    # between the instruction (if any) and the first demonstration
    "instruction_separator": "\n\n",
}

# the placeholders each template entry fills in; any other {name} is left in the text as it is
_PLACEHOLDERS = {"demo": {"{input}", "{output}"}, "query": {"{query}"}, "separator": set(),
                 "instruction_separator": set()}
_PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


@dataclass(frozen=True)
class Request:
    """A prompt with its demonstrated-output character spans.

    prompt:       the full text fed to the model
    output_spans: ((start, end), ...) half-open character intervals, in order, non-empty, non-overlapping
    demos_start:  character offset of the first demonstration; text before it is the fixed prefix
    """

    id: str
    prompt: str
    output_spans: tuple[tuple[int, int], ...]
    demos_start: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        validate(self)


def _fail(rid: Any, fld: str, msg: str) -> RequestError:
    return RequestError(f"request {rid!r}: field {fld!r}: {msg}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: Any, where: str, field: str = "") -> None:
    """Every string in `value` (a JSON-like tree: dicts, their keys, lists, strings) is valid Unicode: no lone
    surrogate (U+D800..U+DFFF, what a JSON escape such as \\ud800 without its pair decodes to, or an undecodable
    byte of a command-line argument), which no encoder can write and no tokenizer can read. The one check of every
    text that comes in, run before any work (the request parser, the stop strings, the server's bodies). Raises
    TextError "{where}: field 'demos[0].input': ..." naming the first bad string."""
    stack = [(field, value)]
    while stack:  # iterative: a deeply nested tree must not overflow the stack
        path, v = stack.pop()
        if isinstance(v, str):
            bad = _SURROGATE.search(v)
            if bad is not None:
                name = f"field {path!r}: " if path else ""
                raise TextError(f"{where}: {name}is not valid Unicode: a lone surrogate "
                                f"U+{ord(bad.group()):04X} at character {bad.start()} (an unpaired \\u escape, or "
                                "bytes that are not UTF-8)")
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and _SURROGATE.search(k):
                    stack.append((f"{path} (a key)" if path else "(a key)", k))
                else:
                    stack.append((sub, item))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))


def validate(req: Request) -> None:
    """Check the text and the spans against the prompt. Raises RequestError naming the request id and field."""
    check_text(req.id, "request", "id")
    rid = req.id
    check_text(req.prompt, f"request {rid!r}", "prompt")
    if not isinstance(req.prompt, str) or not req.prompt:
        raise _fail(rid, "prompt", "must be a non-empty string")
    if not req.output_spans:
        raise _fail(rid, "output_spans", "no demonstrations: at least one output span is required")
    n = len(req.prompt)
    if not isinstance(req.demos_start, int) or isinstance(req.demos_start, bool) or not 0 <= req.demos_start <= n:
        raise _fail(rid, "demos_start", f"must be an integer in [0, {n}], got {req.demos_start!r}")
    prev_end = req.demos_start
    for i, span in enumerate(req.output_spans):
        if len(span) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in span):
            raise _fail(rid, f"output_spans[{i}]", f"must be [char_start, char_end] integers, got {span!r}")
        a, e = span
        if not (0 <= a <= n and 0 <= e <= n):
            raise _fail(rid, f"output_spans[{i}]", f"span [{a}, {e}) is outside the prompt (length {n})")
        if e <= a:
            raise _fail(rid, f"output_spans[{i}]", f"span [{a}, {e}) is empty")
        if a < prev_end:
            what = (f"starts before demos_start ({prev_end}), where the demonstrations begin" if i == 0
                    else f"overlaps or precedes output_spans[{i - 1}] (which ends at {prev_end})")
            raise _fail(rid, f"output_spans[{i}]", f"span [{a}, {e}) {what}")
        prev_end = e


def render_structured(
    rid: str,
    demos: list[dict[str, str]],
    query: str,
    template: dict[str, str] | None = None,
    instruction: str | None = None,
) -> Request:
    """Render a structured request with `template` (DEFAULT_TEMPLATE's keys; missing keys take the defaults)."""
    tpl = dict(DEFAULT_TEMPLATE)
    if template is not None:
        if not isinstance(template, dict):
            raise _fail(rid, "template", f"must be an object, got {type(template).__name__}")
        unknown = set(template) - set(DEFAULT_TEMPLATE)
        if unknown:
            raise _fail(rid, "template", f"unknown keys {sorted(unknown)}; allowed: {sorted(DEFAULT_TEMPLATE)}")
        for k, v in template.items():
            if not isinstance(v, str):
                raise _fail(rid, f"template.{k}", f"must be a string, got {type(v).__name__}")
        tpl.update(template)
    for k, v in tpl.items():
        stray = sorted(set(_PLACEHOLDER.findall(v)) - _PLACEHOLDERS[k])
        if stray:
            warnings.warn(f"request {rid!r}: field 'template.{k}': {', '.join(stray)} is not a placeholder here "
                          f"and stays in the prompt as literal text", SiclWarning, stacklevel=3)
    demo_tpl = tpl["demo"]
    if demo_tpl.count("{output}") != 1 or demo_tpl.count("{input}") != 1:
        raise _fail(rid, "template.demo", "must contain {input} and {output} exactly once each")
    if tpl["query"].count("{query}") != 1:
        raise _fail(rid, "template.query", "must contain {query} exactly once")
    if not isinstance(demos, list) or not demos:
        raise _fail(rid, "demos", "no demonstrations: a non-empty list of {input, output} is required")
    if not isinstance(query, str):
        raise _fail(rid, "query", "must be a string")

    # Split the demo template around {output} so we know exactly where the output's characters land.
    before_out, after_out = demo_tpl.split("{output}")
    parts: list[str] = []
    pos = 0
    if instruction is not None and not isinstance(instruction, str):
        raise _fail(rid, "instruction", f"must be a string, got {type(instruction).__name__}")
    if instruction:
        parts.append(instruction + tpl["instruction_separator"])
        pos = len(parts[0])
    demos_start = pos
    spans = []
    for i, demo in enumerate(demos):
        if (
            not isinstance(demo, dict)
            or not isinstance(demo.get("input"), str)
            or not isinstance(demo.get("output"), str)
        ):
            raise _fail(rid, f"demos[{i}]", "must be an object with string fields 'input' and 'output'")
        if set(demo) - {"input", "output"}:
            raise _fail(rid, f"demos[{i}]", f"unknown key(s) {sorted(set(demo) - {'input', 'output'})}; "
                                            "a demonstration has only 'input' and 'output'")
        if not demo["output"]:
            raise _fail(rid, f"demos[{i}].output", "is empty: every demonstration needs a non-empty output")
        head = before_out.replace("{input}", demo["input"])
        tail = after_out.replace("{input}", demo["input"])
        text = head + demo["output"] + tail + tpl["separator"]
        spans.append((pos + len(head), pos + len(head) + len(demo["output"])))
        parts.append(text)
        pos += len(text)
    parts.append(tpl["query"].replace("{query}", query))
    return Request(id=rid, prompt="".join(parts), output_spans=tuple(spans), demos_start=demos_start)


def parse_request(obj: Any, where: str = "request") -> Request:
    """A JSON object (either form) -> Request. `where` names the source (file:line) in errors."""
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: must be a JSON object, got {type(obj).__name__}")
    check_text(obj, where)
    rid = obj.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        got = ("nothing (no 'id')" if "id" not in obj else "an empty string" if rid == "" else "null" if rid is None
               else type(rid).__name__)
        raise RequestError(f"{where}: field 'id': must be a non-empty string, or an integer (kept as its decimal "
                           f"string: 5 is \"5\"), got {got}")
    rid = str(rid)
    if "demos" in obj:
        extra = set(obj) - {"id", "demos", "query", "template", "instruction"}
        if extra:
            raise _fail(rid, sorted(extra)[0], "unknown field for a structured request")
        if "query" not in obj:
            raise _fail(rid, "query", "missing")
        return render_structured(rid, obj["demos"], obj["query"], obj.get("template"), obj.get("instruction"))
    if "prompt" in obj:
        extra = set(obj) - {"id", "prompt", "output_spans", "demos_start"}
        if extra:
            raise _fail(rid, sorted(extra)[0], "unknown field for a raw request")
        spans = obj.get("output_spans")
        if not isinstance(spans, list):
            raise _fail(rid, "output_spans", "missing or not a list of [char_start, char_end]")
        spans_t = tuple(tuple(s) if isinstance(s, (list, tuple)) else (s,) for s in spans)
        return Request(id=rid, prompt=obj["prompt"], output_spans=spans_t, demos_start=obj.get("demos_start", 0))
    raise RequestError(
        f"{where}: request {rid!r}: needs either 'prompt' + 'output_spans' (raw) or 'demos' + 'query' (structured)"
    )


def read_requests(path: str | Path) -> Iterator[Request]:
    """Yield the requests of a JSONL file (or a stream: a pipe, `-` for standard input; sicl_fast.formats.inputs); blank
    lines are skipped; duplicate ids are an error."""
    seen: set[str] = set()
    with open_input(path, "requests file", "give a JSONL file, one request a line", RequestError) as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if not raw.decode("utf-8", "replace").removeprefix(BOM).strip():
                continue
            req = parse_request(json_value(raw, where, RequestError), where)
            if req.id in seen:
                raise RequestError(f"{where}: duplicate request id {req.id!r}")
            seen.add(req.id)
            yield req
    if not seen:
        raise RequestError(f"requests file {path}: holds no requests (it is empty or blank)")
