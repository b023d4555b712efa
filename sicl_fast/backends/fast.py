"""`fast` backend: our own decoder forward (sicl_fast.models.transformer), with the prefix's K/V computed once.

Per ascent step the batch is [X, X + mu U_1, ..., X + mu U_N] over rows [0, b); rows [0, a) (the
demonstration-free prefix) are the same in every batch row and usually from step to step. So:

    prefix rows [0, a):  run once, batch 1, keep every layer's K/V  (reused while the rows are unchanged)
    rows [a, b):         run per batch row; attention = (prefix keys, shared) + (own keys, causal),
                         merged by log-sum-exp; the prefix K/V is never copied per row
    span positions:      hidden states at positions - 1 only go through the LM head (ops.span_head)
    near_row0 batches:   with a float32 model and diff_matmul on, every projection multiplies row 0 in float32
                         and the other rows' differences from it in bf16 (sicl_fast.models.diff)

The cache is keyed on the prefix rows' values (torch.equal against the cached rows, in the model dtype): the
ascent's cosine projection may rescale the whole matrix, and then the prefix is recomputed. K/V of rows [0, a)
depend on nothing else (positions start at 0), so two prompts with equal prefix embeddings share the entry.
A batch whose prefix rows differ between batch rows takes the full path (no cache).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..models.transformer import SUPPORTED_FAMILIES, PrefixKV, Transformer, UnsupportedModelError
from ..spans import Prompt
from .base import Backend


class FastBackend(Backend):
    """Own forward for Llama / Qwen3 / Gemma 2 / Gemma 3 text.

    attn: 'auto' (SDPA on the CPU; flash-attn or SDPA on CUDA; soft-capping always takes the math path), 'math',
    'sdpa', 'flash'. prefix_cache=False always runs the full rows [0, b). diff_matmul: 'auto' (bf16 difference
    products for perturbation batches of float32 models where bf16 products are fast), 'off', 'bf16'. ops: the
    implementation of the hot ops (sicl_fast.ops; make_backend passes it)."""

    name = "fast"

    def __init__(self, lm, attn: str = "auto", prefix_cache: bool = True, diff_matmul: str = "auto",
                 ops=None) -> None:
        super().__init__(lm, ops)
        # raises UnsupportedModelError for other families
        self.model = Transformer(lm, attn=attn, diff_matmul=diff_matmul, ops=self.ops)
        m = self.model
        if m.device.type == "cuda":  # trust a fused attention kernel only after comparing it with the math path
            m.attention.verify(m.H, m.Hk, m.hd, fallback=attn == "auto")
        self.prefix_cache = prefix_cache
        self._prefix: PrefixKV | None = None
        self.stats = {"prefix_builds": 0, "prefix_hits": 0, "full": 0}

    def clear_cache(self) -> None:
        self._prefix = None

    def _prefix_for(self, x: torch.Tensor, a: int) -> PrefixKV | None:
        """The prefix K/V for x [B, b, d] (model dtype), or None when batch rows disagree on rows [0, a)."""
        rows = x[0, :a]
        B = x.shape[0]
        if B > 1 and not torch.equal(x[1:, :a], rows.expand(B - 1, -1, -1)):
            return None
        c = self._prefix
        if c is not None and c.length == a and c.rows.dtype == rows.dtype and torch.equal(c.rows, rows):
            self.stats["prefix_hits"] += 1
            return c
        self._prefix = None  # free the old entry before building the new one
        c = self._prefix = self.model.prefix_kv(rows)
        self.stats["prefix_builds"] += 1
        return c

    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        m = self.model
        a, b = prompt.demo_start, prompt.demo_end
        x = embeds[:, :b].to(device=m.device, dtype=m.dtype)  # [B, b, d]
        B = x.shape[0]
        idx = prompt.positions - 1  # [P] (CPU): the hidden state at t-1 predicts token t
        with torch.no_grad():
            prefix = self._prefix_for(x, a) if (self.prefix_cache and a > 0) else None
            if prefix is None:
                self.stats["full"] += 1
                hidden = m.forward(x, near_row0=near_row0)  # [B, b, d]
                h = hidden.index_select(1, idx.to(m.device))  # [B, P, d]
            else:
                hidden = m.forward(x[:, a:], a, prefix, near_row0=near_row0)  # [B, b-a, d]
                if int(idx.min()) >= a:
                    h = hidden.index_select(1, (idx - a).to(m.device))
                else:  # a span starts right at row a: its first prediction is the prefix's last row
                    full = torch.cat([prefix.hidden.expand(B, -1, -1), hidden], dim=1)
                    h = full.index_select(1, idx.to(m.device))
            return self.ops.span_head(h, m.head, prompt.targets, softcap=m.final_softcap)

    def generate(self, embeds: torch.Tensor, prompt: Prompt, max_new_tokens: int, stop_strings=(),
                 stop_fn: Callable[[str], bool] | None = None):
        """Greedy answer from embeddings [L, d], with a static KV cache; same stop rules and result type
        (sicl_fast.generate.Generation) as the hf path's greedy_generate."""
        from ..generate import check_inputs, greedy_decode

        lm, m = self.lm, self.model
        check_inputs(lm, embeds, max_new_tokens)
        L = embeds.shape[0]
        embed = lm.model.get_input_embeddings()
        cache = m.new_cache(L + max(max_new_tokens, 1))

        def prefill():
            x = embeds.to(device=m.device, dtype=m.dtype).unsqueeze(0)  # [1, L, d]
            return m.logits(m.forward(x, 0, cache=cache)[:, -1])[0]

        def step(token: int):
            e = embed(torch.tensor([[token]], device=m.device))  # [1, 1, d], as the model embeds input_ids
            return m.logits(m.forward(e, cache.length, cache=cache)[:, -1])[0]

        return greedy_decode(lm, prefill, step, max_new_tokens, stop_strings, stop_fn)


__all__ = ["FastBackend", "SUPPORTED_FAMILIES", "UnsupportedModelError"]
