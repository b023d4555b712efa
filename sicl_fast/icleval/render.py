"""Rendering a sample into the prompt P and locating every demonstrated output in it (SPEC 3-4).

render(sample) -> Rendered(prompt, query_start, spans):
  prompt       P, exactly the text ICLEval feeds the model (rules R-CAT, R-EXM, R-DICT, R-CONTENT)
  query_start  Q, where the query line begins; nothing at or after Q is a demonstration
  spans        ((a, e), ...) half-open code-point intervals of P, one per demonstration, in order

The section-4 invariants are checked on every render (cheap: linear in len(P)); a violation raises
ICLEvalError naming the file, the uid and the span index.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ICLEvalError, where
from .loader import Sample
from .tasks import TaskSpec

SPAN_SEP = " \u26f1 "  # " ⛱ ": the value separator of dict_search_number lines (S-LINE)


@dataclass(frozen=True)
class Rendered:
    """A rendered sample. `last_span_end` is the boundary of the method: rows at and after it are never perturbed."""

    prompt: str
    query_start: int
    spans: tuple[tuple[int, int], ...]

    @property
    def last_span_end(self) -> int:
        return self.spans[-1][1]

    def span_texts(self) -> list[str]:
        return [self.prompt[a:e] for a, e in self.spans]


# ---------------------------------------------------------------------------------------------------------------
# Rendering rules (SPEC 3)


def render_prompt(sample: Sample) -> tuple[str, int]:
    """(P, Q) by the file's rendering rule."""
    rule = sample.spec.render_rule
    raw = sample.raw
    prompt = sample.prompt
    if rule == "R-CAT":
        p = raw["examples"] + prompt
    elif rule == "R-EXM":
        p = raw["exmaples"] + prompt  # sic: the data's spelling (SPEC 7.2)
    elif rule == "R-CONTENT":
        p = raw["content"] + prompt
    elif rule == "R-DICT":
        # key order is significant: JSON order, which json.loads keeps
        lines = "".join(k + " : " + v + "\n" for k, v in raw["dict"].items())
        p = lines + prompt + " :"  # no trailing space after the colon
        return p, len(p) - len(prompt) - 2  # Q is the start of the query line
    else:  # pragma: no cover - TaskSpec values are fixed
        raise ICLEvalError(f"{where(sample.task_file, sample.uid)}: unknown render rule {rule!r}")
    return p, len(p) - len(prompt)


# ---------------------------------------------------------------------------------------------------------------
# Span locators (SPEC 4). Each returns a list of (a, e); empty outputs are reported by index.


def spans_delim(p: str, delim: str, term: str, ctx: str = "?") -> list[tuple[int, int]]:
    """S-DELIM(D, T): after each D (and at most one following space) up to the next T, right-stripped."""
    spans: list[tuple[int, int]] = []
    c = 0
    while True:
        d = p.find(delim, c)
        if d < 0:
            break
        a = d + len(delim)
        if a < len(p) and p[a] == " ":
            a += 1  # one space only: it belongs to the delimiter, as in "Output: True"
        t = p.find(term, a)
        if t < 0:
            break  # this D is the query's: its output is what the model generates
        e = a + len(p[a:t].rstrip())
        if e == a:
            # the reference silently drops empty outputs; we refuse them (it never happens in the data)
            raise ICLEvalError(f"{ctx}: span {len(spans)}: empty demonstration output at character {a}")
        spans.append((a, e))
        c = t + len(term)
    return spans


def spans_line(p: str) -> list[tuple[int, int]]:
    """S-LINE: on each line holding " ⛱ ", from just after its last " ⛱ " to the end of the line."""
    spans: list[tuple[int, int]] = []
    start = 0
    for line in p.split("\n"):
        k = line.rfind(SPAN_SEP)
        if k >= 0:
            spans.append((start + k + len(SPAN_SEP), start + len(line)))
        start += len(line) + 1
    return spans


def spans_dict(p: str, keys: list[str], ctx: str = "?") -> list[tuple[int, int]]:
    """S-DICT: for each key in dict order, find "k : " after the previous span; the value runs to the next newline."""
    spans: list[tuple[int, int]] = []
    c = 0
    for i, k in enumerate(keys):
        pos = p.find(k + " : ", c)
        if pos < 0:
            raise ICLEvalError(f"{ctx}: span {i}: key {k!r} not found after character {c}")
        a = pos + len(k) + 3
        e = p.find("\n", a)
        if e < 0:
            raise ICLEvalError(f"{ctx}: span {i}: the value of key {k!r} has no terminating newline")
        spans.append((a, e))
        c = e
    return spans


def spans_hash(p: str, full_hash: str, q: int, suffix_only: bool = False) -> list[tuple[int, int]]:
    """S-HASH: every non-overlapping occurrence of the 16-char hash starting before Q, left to right.

    suffix_only=False covers all 16 chars (the reference's choice); True covers only the last 8 chars, the part the
    model must produce after the 8-char prefix it is given.
    """
    spans: list[tuple[int, int]] = []
    half = len(full_hash) // 2
    c = 0
    while True:
        a = p.find(full_hash, c)
        if a < 0 or a >= q:
            break
        e = a + len(full_hash)
        spans.append((a + half, e) if suffix_only else (a, e))
        c = e
    return spans


# ---------------------------------------------------------------------------------------------------------------
# Invariants (SPEC 3 endings, SPEC 4 invariants)


def expected_span_count(sample: Sample) -> int:
    """The span count SPEC 4 expects, derived from the data itself (not from the span locator)."""
    spec = sample.spec
    raw = sample.raw
    if spec.span_rule == "S-HASH":
        return raw["count"]
    if spec.span_rule == "S-DICT":
        return len(raw["dict"])
    if spec.span_rule == "S-LINE":
        return sum(1 for line in raw["examples"].split("\n") if line.strip())
    # demonstration blocks: the marker at the very start, or right after a blank line
    examples = raw["exmaples"] if spec.render_rule == "R-EXM" else raw["examples"]
    marker = spec.block_marker
    return int(examples.startswith(marker)) + examples.count("\n\n" + marker)


def check_invariants(sample: Sample, rendered: Rendered) -> None:
    """Raise ICLEvalError (file, uid, span index) if `rendered` breaks a SPEC 3/4 invariant."""
    spec = sample.spec
    ctx = where(sample.task_file, sample.uid)
    p, q, spans = rendered.prompt, rendered.query_start, rendered.spans
    ending = spec.ending_for(sample.task_type)
    if ending is not None and not p.endswith(ending):
        raise ICLEvalError(f"{ctx}: field 'prompt': the query must end with {ending!r}, it ends with {p[-12:]!r}")
    if not 0 <= q <= len(p) or not p[q:].startswith(sample.prompt):
        raise ICLEvalError(f"{ctx}: field 'prompt': query start {q} does not begin the query")
    prev = 0
    for i, (a, e) in enumerate(spans):
        if e <= a:
            raise ICLEvalError(f"{ctx}: span {i}: [{a}, {e}) is empty")
        if a < prev:
            raise ICLEvalError(f"{ctx}: span {i}: [{a}, {e}) overlaps or precedes span {i - 1} (ending at {prev})")
        if e > q:
            raise ICLEvalError(f"{ctx}: span {i}: [{a}, {e}) runs past the query start {q}")
        text = p[a:e]
        if text != text.strip():
            raise ICLEvalError(f"{ctx}: span {i}: [{a}, {e}) has leading or trailing whitespace: {text!r:.60}")
        prev = e
    want = expected_span_count(sample)
    if len(spans) != want:
        raise ICLEvalError(f"{ctx}: found {len(spans)} spans, the data has {want} demonstrations")
    if spec.demos is not None and want != spec.demos:
        raise ICLEvalError(f"{ctx}: {want} demonstrations, every {spec.file_name} sample has {spec.demos}")
    if not spans:
        raise ICLEvalError(f"{ctx}: no demonstrations")


# ---------------------------------------------------------------------------------------------------------------


def locate_spans(
    sample: Sample, prompt: str, query_start: int, hash_suffix_only: bool = False
) -> list[tuple[int, int]]:
    """The file's span rule applied to the rendered prompt."""
    spec: TaskSpec = sample.spec
    ctx = where(sample.task_file, sample.uid)
    rule = spec.span_rule
    if rule == "S-DELIM":
        delim, term = spec.delims_for(sample.task_type)
        return spans_delim(prompt, delim, term, ctx)
    if rule == "S-LINE":
        return spans_line(prompt)
    if rule == "S-DICT":
        return spans_dict(prompt, list(sample.raw["dict"]), ctx)
    if rule == "S-HASH":
        return spans_hash(prompt, sample.prompt + sample.label, query_start, hash_suffix_only)
    raise ICLEvalError(f"{ctx}: unknown span rule {rule!r}")  # pragma: no cover


def render(sample: Sample, hash_suffix_only: bool = False, check: bool = True) -> Rendered:
    """Render a sample and locate its output spans.

    hash_suffix_only: String Completion only; spans cover the hash's last 8 chars instead of all 16 (SPEC 4,
    the non-reference variant; the invariants hold for both).
    check: verify the SPEC 3/4 invariants (on by default; raise ICLEvalError on a violation).
    """
    prompt, q = render_prompt(sample)
    spans = locate_spans(sample, prompt, q, hash_suffix_only)
    out = Rendered(prompt=prompt, query_start=q, spans=tuple(spans))
    if check:
        check_invariants(sample, out)
    return out
