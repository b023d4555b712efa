"""Character spans -> token spans, and the tokenized `Prompt` every backend and the ascent work on.

Rules (as the reference implementation, and ICLEval SPEC section 5):
  * token j belongs to output span [a, e) iff its character range [s_j, t_j) overlaps it: s_j < e and t_j > a;
    special tokens have no characters ((0, 0) offsets) and never belong to a span;
  * a span's first token at position 0 has no prediction, so it is dropped;
  * the perturbed rows are [first demonstration token, end of the last output span): the first demonstration
    token is the first non-special token that ends after `demos_start`.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from collections.abc import Sequence
from functools import cached_property

import torch

from ..errors import ContextLengthError, RequestError
from .requests import Request


def span_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """[T] token counts per output span -> [T+1] int64 offsets into the pooled [P] axis."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + int(n))
    return torch.tensor(offs, dtype=torch.int64)


@dataclass(frozen=True)
class Prompt:
    """A tokenized request.

    input_ids:   [L] int64 token ids of the whole prompt (query included)
    token_spans: ((start, end), ...) per demonstration, half-open token positions, each >= 1 token, start >= 1
    demo_start:  a, first perturbed row (first demonstration token)
    demo_end:    b, one past the last output token: rows >= b (the query) never change the proxy
    vocabulary:  vocabulary_key of the tokenizer that made input_ids (None: unknown), so that an engine refuses a
                 prompt of another model's vocabulary (sicl_fast.run.checks.check_prompt)
    """

    request: Request
    input_ids: torch.Tensor
    token_spans: tuple[tuple[int, int], ...]
    demo_start: int
    demo_end: int
    vocabulary: str | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_demos(self) -> int:
        return len(self.token_spans)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[P] int64: the predicted token positions t, spans concatenated in order."""
        return torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in self.token_spans])

    @cached_property
    def targets(self) -> torch.Tensor:
        """[P] int64: the token ids at `positions` (what the model should predict)."""
        return self.input_ids[self.positions]

    @cached_property
    def offsets(self) -> torch.Tensor:
        """[T+1] int64 offsets of each span into the pooled [P] axis."""
        return span_offsets([e - s for s, e in self.token_spans])


_VOCABULARY_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABULARY_SAMPLE = 512  # token ids whose strings go into the key, spread over the vocabulary


def vocabulary_key(tokenizer) -> str:
    """A short digest of a tokenizer's vocabulary: its size and the strings of ids spread evenly over it (computed
    once per tokenizer object). Two tokenizers of one model give the same key; another model's vocabulary (another
    size, or other tokens at the same ids) gives another."""
    try:
        return _VOCABULARY_KEYS[tokenizer]
    except (KeyError, TypeError):
        pass
    n = len(tokenizer)
    ids = list(range(0, n, max(1, n // _VOCABULARY_SAMPLE)))
    toks = tokenizer.convert_ids_to_tokens(ids)
    key = f"{n}:" + hashlib.sha256("\x00".join(map(str, toks)).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    try:
        _VOCABULARY_KEYS[tokenizer] = key
    except TypeError:  # not weakly referenceable: computed again next time
        pass
    return key


def vocabulary_size(key: str) -> int:
    """The vocabulary size a vocabulary_key was made from."""
    return int(key.split(":", 1)[0])


def token_spans_from_offsets(
    offsets: list[tuple[int, int]],
    char_spans: tuple[tuple[int, int], ...],
    special: list[bool],
    rid: str = "?",
) -> list[tuple[int, int]]:
    """Map character spans to half-open token spans by overlap. Raises RequestError on empty or shared spans."""
    out: list[tuple[int, int]] = []
    j = 0
    n = len(offsets)
    for i, (a, e) in enumerate(char_spans):
        # skip tokens that end at or before the span's start (offsets are non-decreasing)
        while j < n and (special[j] or offsets[j][1] <= a):
            j += 1
        first = j
        k = j
        while k < n and (special[k] or offsets[k][0] < e):
            k += 1
        # trim special tokens inside the tail
        toks = [t for t in range(first, k) if not special[t] and offsets[t][0] < e and offsets[t][1] > a]
        if not toks:
            raise RequestError(f"request {rid!r}: output_spans[{i}] [{a}, {e}) covers no token")
        start, end = toks[0], toks[-1] + 1
        if out and start < out[-1][1]:
            raise RequestError(
                f"request {rid!r}: output_spans[{i}] [{a}, {e}) shares token {start} with output_spans[{i - 1}]"
            )
        out.append((start, end))
        j = end - 1  # the next span may not reuse this token, but the check above reports it
    return out


def tokenize(
    request: Request,
    tokenizer,
    add_special_tokens: bool = False,
    max_context: int | None = None,
    reserve: int = 0,
) -> Prompt:
    """Tokenize a request with offsets and locate its output spans.

    max_context: the model's context window; the prompt plus `reserve` tokens (to generate) must fit.
    """
    enc = tokenizer(request.prompt, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offs = [tuple(o) for o in enc["offset_mapping"]]
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    # A special token added by the tokenizer has no characters; a special token spelled out in the text keeps its
    # characters and is treated like text.
    special = [(tid in special_ids and s == t) for tid, (s, t) in zip(ids, offs)]
    rid = request.id
    L = len(ids)
    if max_context is not None and L + reserve > max_context:
        extra = f" plus {reserve} tokens to generate" if reserve else ""
        raise ContextLengthError(
            f"request {rid!r}: field 'prompt': {L} tokens{extra} exceed the model's context of {max_context} tokens"
        )
    spans = token_spans_from_offsets(offs, request.output_spans, special, rid)
    if spans[0][0] == 0:
        # no prediction exists for position 0
        spans[0] = (1, spans[0][1])
        if spans[0][0] >= spans[0][1]:
            raise RequestError(
                f"request {rid!r}: output_spans[0] is the prompt's first token only; it has no prediction"
            )
    demo_start = next(
        (j for j in range(L) if not special[j] and offs[j][1] > request.demos_start), spans[0][0]
    )
    demo_start = min(demo_start, spans[0][0])
    return Prompt(
        request=request,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        token_spans=tuple(spans),
        demo_start=demo_start,
        demo_end=spans[-1][1],
        vocabulary=vocabulary_key(tokenizer),
    )
