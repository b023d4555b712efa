"""Label scoring for the classification baselines: log p(continuation | context) on any model the engine loads.

A label's score is the sum of the log-probabilities of the tokens of its continuation (" " + label) after the
context; the context is tokenized alone with the tokenizer's default special tokens (as ICLEval feeds the model)
and the continuation alone without special tokens, so every label is scored after the same context tokens.

Contexts that share a token prefix with the previous one (the same demonstrations with another query: content-free
inputs, the label-scoring passes of CC and DEmO) reuse its KV cache up to the shared prefix (`DynamicCache.crop`);
only the new tokens are run. A model whose cache cannot be cropped is run from scratch every time.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import SiclError


class LabelScorer:
    """log p(continuation | context) for a LoadedModel; `tokens_run` counts the positions actually computed."""

    def __init__(self, lm, add_special_tokens: bool = True, reuse_prefix: bool = True, memo_size: int = 256) -> None:
        self.lm = lm
        self.add_special_tokens = add_special_tokens
        self.reuse_prefix = reuse_prefix
        self.tokens_run = 0
        self.forwards = 0
        self._ids: list[int] = []
        self._cache = None
        self._memo: OrderedDict = OrderedDict()
        self._memo_size = memo_size

    # ---------------------------------------------------------------------------------------------------------
    def encode_context(self, text: str) -> list[int]:
        ids = list(self.lm.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])
        if not ids:
            raise SiclError("the context encodes to no token; a label needs at least one token before it")
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        ids = list(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise SiclError(f"continuation {text!r} encodes to no token")
        return ids

    def _forward(self, ids: list[int], cache, last_only: bool = False):
        x = torch.tensor([ids], dtype=torch.long, device=self.lm.device)
        self.forwards += 1
        self.tokens_run += len(ids)
        if last_only:  # the LM head at the last position only
            return self.lm.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return self.lm.model(input_ids=x, past_key_values=cache, use_cache=True)

    def _context_state(self, ids: list[int]):
        """Run the context (reusing the cached common prefix); returns the last position's log-softmax [V]."""
        common = 0
        if self.reuse_prefix and self._cache is not None:
            n = min(len(ids) - 1, len(self._ids))  # the last context token is always run: its logits are needed
            while common < n and ids[common] == self._ids[common]:
                common += 1
        cache = None
        if common > 0:
            if _crop_to(self._cache, common):
                cache = self._cache
            else:  # a cache that cannot be cropped (e.g. sliding-window layers): run every context from scratch
                self.reuse_prefix = False
                common = 0
        out = self._forward(ids[common:], cache, last_only=True)
        self._ids = list(ids)
        self._cache = out.past_key_values
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1)

    def token_logprobs(self, context: str, continuations: Sequence[str]) -> list[list[float]]:
        """Per continuation, the log-probabilities of its tokens after `context`."""
        key = (self.add_special_tokens, context, tuple(continuations))
        if key in self._memo:
            self._memo.move_to_end(key)
            return self._memo[key]
        ids = self.encode_context(context)
        conts = [self.encode_continuation(c) for c in continuations]
        with torch.no_grad():
            first = self._context_state(ids)
            out: list[list[float]] = []
            for toks in conts:
                lps = [float(first[toks[0]])]
                if len(toks) > 1:
                    res = self._forward(toks[:-1], self._cache)
                    lp = torch.log_softmax(res.logits[0].float(), dim=-1)
                    lps += [float(lp[i, t]) for i, t in enumerate(toks[1:])]
                    self._cache = res.past_key_values
                    if not _crop_to(self._cache, len(ids)):
                        self._cache, self._ids = None, []
                out.append(lps)
        self._memo[key] = out
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return out

    def score(self, context: str, continuations: Sequence[str]) -> np.ndarray:
        """[K] log p(continuation_k | context): the sum of its tokens' log-probabilities."""
        return np.array([sum(t) for t in self.token_logprobs(context, continuations)], dtype=float)

    def distribution(self, context: str, continuations: Sequence[str]) -> np.ndarray:
        """[K] the label probabilities normalised over the label set."""
        return normalise(self.score(context, continuations))


def _crop_to(cache, length: int) -> bool:
    """Cut the cache back to its first `length` positions; False if this cache cannot be rolled back exactly."""
    try:
        if not getattr(cache, "is_croppable", False):
            return False
        cur = cache.get_seq_length()
        if cur > length:
            cache.crop(length - cur)  # a negative value removes that many positions
        return cache.get_seq_length() == length
    except Exception:
        return False


def normalise(logp: np.ndarray) -> np.ndarray:
    """exp(logp) renormalised to sum 1 (computed stably)."""
    z = np.asarray(logp, dtype=float)
    e = np.exp(z - z.max())
    return e / e.sum()


__all__ = ["LabelScorer", "normalise"]
