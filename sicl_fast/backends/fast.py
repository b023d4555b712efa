"""`fast` backend: our own decoder forward (sicl_fast.models.transformer), with the prefix's K/V computed once.

Per ascent step the batch is [X, X + mu U_1, ..., X + mu U_N] over rows [0, b); rows [0, a) (the
demonstration-free prefix) are the same in every batch row and usually from step to step. So:

    prefix rows [0, a):  run once, batch 1, keep every layer's K/V  (reused while the rows are unchanged)
    rows [a, b):         run per batch row; attention = (prefix keys, shared) + (own keys, causal): one
                         Triton launch with impl 'triton', else two parts merged by log-sum-exp; the prefix
                         K/V is never copied per row
    span positions:      hidden states at positions - 1 only go through the LM head (ops.span_head)
    near_row0 batches:   with a float32 model and diff_matmul on, every projection multiplies row 0 in float32
                         and the other rows' differences from it in bf16 (sicl_fast.models.diff)

The cache is keyed on the prefix rows' values (torch.equal against the cached rows, in the model dtype): the
ascent's cosine projection may rescale the whole matrix, and then the prefix is recomputed. K/V of rows [0, a)
depend on nothing else (positions start at 0), so two prompts with equal prefix embeddings share the entry.
A batch whose prefix rows differ between batch rows takes the full path (no cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from ..graphs import DEFAULT_CAPACITY, DecodeGraph, ShapeCache, cache_rows
from ..models.transformer import SUPPORTED_FAMILIES, PrefixKV, Transformer, UnsupportedModelError
from ..spans import Prompt
from .base import Backend


@dataclass(frozen=True)
class SpanPlan:
    """Where one prompt's span predictions are read, on the device: idx [P] int64, the rows t - 1 of the span
    tokens t among rows [0, b); idx_suffix = idx - a, the same rows among [a, b) (the prefix path's hidden
    states, unless from_prefix: a span starts right at row a); targets [P] the span tokens."""

    a: int
    b: int
    idx: torch.Tensor
    idx_suffix: torch.Tensor
    from_prefix: bool
    targets: torch.Tensor


class FastBackend(Backend):
    """Own forward for Llama / Qwen3 / Gemma 2 / Gemma 3 text, as the run plan `plan` says: its DecoderConfig,
    attention kernel (and whether to check it against the math path first), difference products, ops and the
    tokens decoded between two host reads (sicl_fast.plan). prefix_cache=False always runs the full rows [0, b)."""

    name = "fast"

    def __init__(self, lm, plan, prefix_cache: bool = True) -> None:
        super().__init__(lm, plan)
        p = self.plan
        self.model = Transformer(lm, p.decoder, self.decoder_ops, p.attention, p.diff_matmul)
        m = self.model
        if p.attention_check:  # trust a fused attention kernel only after comparing it with the math path
            m.attention.verify(m.H, m.Hk, m.hd, fallback=p.attention_fallback)
        self.prefix_cache = prefix_cache
        self.read_every = p.read_every  # decoding: tokens between two host reads
        self._prefix: PrefixKV | None = None
        self.stats = {"prefix_builds": 0, "prefix_hits": 0, "full": 0}
        self.decoders: ShapeCache | None = None  # captured decode steps per cache length (use_graphs)

    @property
    def attention_kernel(self) -> str:
        """The plan's kernel, or 'math' where it failed its check on CUDA and fell back (Attention.verify)."""
        return self.model.attention.impl

    def use_graphs(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """Decode through captured CUDA graphs from now on: one static KV cache and graph per cache length
        (cache_rows buckets), at most `capacity` kept. The engine calls it once when its plan's graphs are on."""
        self.decoders = ShapeCache(capacity)

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

    def span_plan(self, prompt: Prompt) -> SpanPlan:
        """The prompt's span positions and targets laid out on the device once (see SpanPlan)."""
        a, idx = prompt.demo_start, prompt.positions - 1  # the hidden state at t-1 predicts token t
        dev = self.model.device
        return SpanPlan(a=a, b=prompt.demo_end, idx=idx.to(dev), idx_suffix=(idx - a).to(dev),
                        from_prefix=a > 0 and int(idx.min()) < a, targets=prompt.targets.to(dev))

    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        m = self.model
        a, b = prompt.demo_start, prompt.demo_end
        x = embeds[:, :b].to(device=m.device, dtype=m.dtype)  # [B, b, d]
        with torch.no_grad():
            prefix = self._prefix_for(x, a) if (self.prefix_cache and a > 0) else None
            self.stats["full"] += prefix is None
            return self.span_forward(x, self.span_plan(prompt), prefix, near_row0)

    def differentiable_logprobs(self, embeds: torch.Tensor, prompt: Prompt, checkpoint: bool = False) -> torch.Tensor:
        """The full rows [0, b) (no prefix cache: its attention merge has no backward) through plain products (the
        difference products are for perturbation batches), with autograd recording; see Backend."""
        self.check_embeds(embeds, prompt)
        m, plan = self.model, self.span_plan(prompt)
        x = embeds[:, :prompt.demo_end].to(device=m.device, dtype=m.dtype)  # [1, b, d]
        with torch.enable_grad():
            h = m.forward(x, checkpoint=checkpoint).index_select(1, plan.idx)  # [1, P, d]
            return self.ops.span_head(h, m.head, plan.targets, softcap=m.final_softcap)

    def span_forward(self, x: torch.Tensor, plan: SpanPlan, prefix: PrefixKV | None,
                     near_row0: bool = False) -> torch.Tensor:
        """x [B, b, d] in the model dtype -> [B, P] float32 span log-probs, with the prefix K/V of rows [0, a)
        (or None: the full rows). No checks and no host reads: what a loop without host synchronisation calls."""
        m = self.model
        if prefix is None:
            h = m.forward(x, near_row0=near_row0).index_select(1, plan.idx)  # [B, P, d]
        else:
            hidden = m.forward(x[:, plan.a:], plan.a, prefix, near_row0=near_row0)  # [B, b-a, d]
            if plan.from_prefix:  # a span starts right at row a: its first prediction is the prefix's last row
                h = torch.cat([prefix.hidden.expand(x.shape[0], -1, -1), hidden], dim=1).index_select(1, plan.idx)
            else:
                h = hidden.index_select(1, plan.idx_suffix)
        return self.ops.span_head(h, m.head, plan.targets, softcap=m.final_softcap)

    def generate(self, embeds: torch.Tensor, prompt: Prompt, max_new_tokens: int, stop_strings=(),
                 stop_fn: Callable[[str], bool] | None = None):
        """Greedy answer from embeddings [L, d] with a static KV cache: fixed buffers, each token written in
        place at a device-held position and attended over the whole buffer with a mask (no shape changes with
        the length), the argmax on the device, and the tokens read every `read_every` tokens. Same stop rules
        and result type (sicl_fast.generate.Generation) as the hf path's greedy_generate."""
        from ..generate import check_inputs, greedy_decode

        lm, m = self.lm, self.model
        check_inputs(lm, embeds, max_new_tokens)
        L = embeds.shape[0]
        rows = L + max(max_new_tokens, 1)
        if self.decoders is None:
            cache = m.new_cache(rows)
            step = lambda token: m.decode_logits(token, cache)  # noqa: E731
        else:  # graphs: a bucketed cache length, so a new prompt length mostly finds its graph captured
            n = cache_rows(rows)
            if lm.max_context is not None:
                n = max(min(n, lm.max_context), rows)
            dec, _ = self.decoders.get(n, lambda: DecodeGraph(m, n, self.ops, m.device))
            cache, step = dec.cache, dec.step

        @torch.no_grad()  # the forward records autograd for inputs that require grad; decoding never needs it
        def prefill():
            x = embeds.to(device=m.device, dtype=m.dtype).unsqueeze(0)  # [1, L, d]
            logits = m.logits(m.forward(x, 0, cache=cache)[:, -1])[0]
            cache.pos.fill_(L)
            return logits

        return greedy_decode(lm, prefill, step, max_new_tokens, stop_strings, stop_fn, read_every=self.read_every)


__all__ = ["FastBackend", "SUPPORTED_FAMILIES", "UnsupportedModelError"]
