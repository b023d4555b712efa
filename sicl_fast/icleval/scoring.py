"""ICLEval's decoding budget and scorers (SPEC 6.2-6.4).

score(sample, response) takes the decoded *new* text only (prompt excluded, special tokens skipped) and returns
whether ICLEval counts it correct. The scorers keep ICLEval's quirks on purpose (they define the reported numbers):
  * FMT builds its regular expression from the label as written, without escaping, so "(key)" is a group and
    accepts any response with exactly one capital A-E;
  * FMT checks the answer's format, not its value (ans_content is ignored);
  * BOOL counts anything that is not "true" (any case) as a False prediction.
"""
from __future__ import annotations

import re

from .errors import ICLEvalError, where
from .loader import Sample
from .render import render_prompt

# FMT placeholders (SPEC 6.4): what "value" / "key" become in the template's regular expression
_NUMBER = r"-?\$?\d+"  # output_format_01: optional minus, optional dollar, digits (commas removed beforehand)
_LETTER = r"[A-E]"  # output_format_02: one option letter
_CAPTURE = r"(.*)"  # output_format_03: greedy, and "." stops at a newline


def max_gen_len(sample: Sample) -> int:
    """New tokens to generate for this sample (depends on task_type for Order Adjustment and De-Duplication)."""
    return sample.spec.max_gen_len_for(sample.task_type)


def cut_strings(sample: Sample) -> tuple[str, ...]:
    """The scorer's cut string(s): one for every task, the nine end characters for String Completion."""
    return sample.spec.cut_for(sample.task_type)


def _cut(text: str, seps: tuple[str, ...]) -> str:
    """The part before the earliest occurrence of any of `seps` (the whole text if none occurs)."""
    end = len(text)
    for s in seps:
        k = text.find(s)
        if 0 <= k < end:
            end = k
    return text[:end]


def prediction(sample: Sample, response: str) -> str:
    """The text the scorer compares: strip(response), cut at the task's cut string(s) (no further processing)."""
    return _cut(response.strip(), cut_strings(sample))


# ---------------------------------------------------------------------------------------------------------------
# The five scorers


def score_exact(pred: str, label: str) -> bool:
    """EXACT: case-sensitive equality after stripping both sides."""
    return pred.strip() == label.strip()


def score_bool(pred: str, label: bool) -> bool:
    """BOOL: the model predicts True iff the cut text is "true" in any case; anything else predicts False."""
    return (pred.strip().lower() == "true") == label


def score_nl(pred: str, label: str) -> bool:
    """NL: an 's' glued to the hash (possessive or plural) is dropped when it makes the prediction 9 chars long."""
    if len(pred) == 9 and pred.endswith("s"):
        pred = pred[:-1]
    return pred == label


def score_set(pred: str, label: str) -> bool:
    """SET: the ", "-separated items of prediction and label form equal sets (order and duplicates ignored)."""
    return set(pred.strip().split(", ")) == set(label.split(", "))


def option_candidates(prompt: str) -> list[str]:
    """output_format_03's accepted answers: the options after the last "\\nOptions:" of the rendered prompt.

    The line is split on "," and each piece keeps what follows its first ")"; a piece without ")" (a fragment
    of a value with a thousands separator) is kept whole. Both quirks are ICLEval's.
    """
    k = prompt.rfind("\nOptions:")
    if k < 0:
        return []
    line = prompt[k + len("\nOptions:"):].split("\n", 1)[0]
    return [piece.split(")", 1)[-1].strip() for piece in line.split(",")]


def score_fmt(sample: Sample, pred: str) -> bool:
    """FMT: format compliance with the label template (see module docstring); dispatched on task_type."""
    try:
        return _score_fmt(sample, pred)
    except re.error as exc:  # a template that is not a valid regular expression is a data error
        raise ICLEvalError(
            f"{where(sample.task_file, sample.uid, 'label')}: template {sample.label!r}: {exc}"
        ) from None


def _score_fmt(sample: Sample, pred: str) -> bool:
    label = sample.label
    kind = sample.task_type
    if kind == "output_format_01":
        pattern = label.replace("value", _NUMBER)  # not escaped: ICLEval's behaviour
        return len(re.findall(pattern, pred.replace(",", ""))) == 1
    if kind == "output_format_02":
        pattern = label.replace("key", _LETTER)  # "(key)" becomes a group: any single A-E passes
        return len(re.findall(pattern, pred)) == 1
    if kind == "output_format_03":
        matches = list(re.finditer(label.replace("value", _CAPTURE), pred))
        if len(matches) != 1:
            return False
        prompt, _ = render_prompt(sample)
        return matches[0].group(1) in option_candidates(prompt)
    raise ICLEvalError(f"{where(sample.task_file, sample.uid, 'task_type')}: no FMT scorer for {kind!r}")


def score(sample: Sample, response: str) -> bool:
    """Whether ICLEval scores `response` (the decoded new tokens) correct for `sample`."""
    pred = prediction(sample, response)
    scorer = sample.spec.scorer
    if scorer == "EXACT":
        return score_exact(pred, sample.label)
    if scorer == "BOOL":
        return score_bool(pred, sample.label)
    if scorer == "NL":
        return score_nl(pred, sample.label)
    if scorer == "SET":
        return score_set(pred, sample.label)
    if scorer == "FMT":
        return score_fmt(sample, pred)
    raise ICLEvalError(f"{where(sample.task_file, sample.uid)}: unknown scorer {scorer!r}")  # pragma: no cover


# ---------------------------------------------------------------------------------------------------------------
# Early stop (SPEC 6.2)


def should_stop(sample: Sample, text_so_far: str) -> bool:
    """True once no further generated text can change score(sample, ...): decoding may stop here.

    The rule of SPEC 6.2: the continuation so far, with leading whitespace removed, contains a cut string. The
    scorer only looks at the text before the first cut, and that part is already fixed, so
    score(text_so_far) == score(text_so_far + anything).

    One refinement keeps this exact for NL, the only scorer that does not strip its prediction again: when the
    first cut is a whitespace end character (" " or "\\n") preceded by other whitespace (e.g. a tab), whether that
    whitespace is part of the prediction depends on text not generated yet, so we wait for a non-space character
    after the cut (or for max_gen_len / EOS). For every other scorer the trailing whitespace is stripped anyway, or
    the cut string ends in a non-space character.
    """
    text = text_so_far.lstrip()
    seps = cut_strings(sample)
    first = _cut(text, seps)
    if len(first) == len(text):
        return False  # no cut string yet
    if sample.spec.scorer == "NL" and first != first.rstrip() and text[len(first)].isspace():
        return text[len(first):].strip() != ""
    return True
