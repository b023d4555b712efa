"""Samples -> engine inputs: a `Request` (character spans) and a tokenized `Prompt` (token spans, SPEC 5-6.1)."""
from __future__ import annotations

from ..formats.requests import Request
from ..formats.spans import Prompt, tokenize
from .loader import Sample
from .render import render
from .scoring import max_gen_len


def request_id(sample: Sample) -> str:
    """"classifier_order:0": uids are unique within a file only, so the file is part of the id."""
    return f"{sample.task_file}:{sample.uid}"


def to_request(sample: Sample, hash_suffix_only: bool = False) -> Request:
    """The sample as an engine Request: P, its output spans, demos_start=0 (ICLEval prompts have no instruction)."""
    r = render(sample, hash_suffix_only=hash_suffix_only)
    return Request(
        id=request_id(sample),
        prompt=r.prompt,
        output_spans=r.spans,
        demos_start=0,
        meta={"task": sample.task_file, "uid": sample.uid, "label": sample.label},
    )


def tokenize_sample(
    sample: Sample, tokenizer, max_context: int | None = None, hash_suffix_only: bool = False
) -> Prompt:
    """Tokenize as ICLEval feeds the model: the tokenizer's default special tokens (BOS where it adds one), no
    truncation. If the prompt plus max_gen_len new tokens exceeds `max_context`, ContextLengthError is raised
    (ICLEval would left-truncate, which drops demonstrations and invalidates the spans). A span that covers no
    token, or two spans sharing a token, raise RequestError naming "file:uid" and the span index.
    """
    return tokenize(
        to_request(sample, hash_suffix_only=hash_suffix_only),
        tokenizer,
        add_special_tokens=True,
        max_context=max_context,
        reserve=max_gen_len(sample),
    )
