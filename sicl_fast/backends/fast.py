"""`fast` backend: our own decoder forward (sicl_fast.models.transformer).

Per ascent step the batch is [X, X + mu U_1, ..., X + mu U_N] over rows [0, b); rows [0, a) (the
demonstration-free prefix) are the same in every batch row. One object runs a prompt's perturbation batches
(sicl_fast.backends.step_forward.StepForward, made by `step_forward`): it owns the prefix policy (the prefix's K/V
kept across steps, or run once per pass beside the batch rows, or not used), the span plan (only the hidden states
at span positions go through the LM head, ops.span_head) and the weight layout (with difference products on, the
batch runs in difference form: float32 activations, every projection one bf16 product of row 0's values and the
other rows' differences, sicl_fast.models.rows). `span_logprobs` runs through it too; decoding and the exact
gradient take the plain forward in the model dtype.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch

from ..errors import SiclWarning
from ..run.graphs import DEFAULT_CAPACITY, Captures, DecodeGraph, ReplayCheck, ShapeCache, cache_rows, off_by
from ..run.plan import fall_back
from ..models.projections import RowsDense
from ..models.transformer import SUPPORTED_FAMILIES, Transformer, UnsupportedModelError
from ..ops import attention_kernels
from ..formats.spans import Prompt
from .base import Backend
from .step_forward import PackedForward, SpanPlan, StepForward


class FastBackend(Backend):
    """Own forward for the families of sicl_fast.models.decoder_config, as the run plan `plan` says: its DecoderConfig,
    attention kernel (checked against the math path by the plan on CUDA), difference products, ops and the
    tokens decoded between two host reads (sicl_fast.run.plan). prefix_cache=False always runs the full rows [0, b)."""

    def __init__(self, lm, plan, prefix_cache: bool = True) -> None:
        super().__init__(lm, plan)
        p = self.plan
        self.model = Transformer(lm, p.decoder, self.decoder_ops, p.attention, p.diff_matmul,
                                 attention_kernels(p.attention), p.attention_precision)
        self.prefix_cache = prefix_cache
        self.read_every = p.read_every  # decoding: tokens between two host reads
        self.decoders: ShapeCache | None = None  # captured decode steps per cache length (use_graphs)

    @property
    def attention_kernel(self) -> str:
        """The kernel the model runs: the plan's ('math' where a fused one failed its check on CUDA:
        sicl_fast.run.plan.verify_attention)."""
        return self.model.attention.impl

    def use_graphs(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """Decode through captured CUDA graphs from now on: one static KV cache and graph per cache length
        (cache_rows buckets), at most `capacity` kept, each graph on a pool of its own, all on one capture stream
        (sicl_fast.run.graphs.Captures). The engine calls it once when its plan's graphs are on."""
        self._decode_captures = Captures(self.device, shared=False)
        self.decoders = ShapeCache(capacity, captures=self._decode_captures, graphs_of=lambda dec: [dec.graph])

    def torch_twin(self) -> FastBackend:
        """This backend on the torch ops and the math attention, graphs off, on the same weights (stacked once, and
        the same low-dtype copies: no copy of any weight) and the same rotary tables: what a new capture's first
        replay is checked against (sicl_fast.run.graphs.first_replay), and what a fallback to the torch ops runs on.
        A new one each call (its buffers go with it)."""
        twin = FastBackend(self.lm, dataclasses.replace(self.plan, impl="torch", attention="math", graphs=False),
                           self.prefix_cache)
        m, t = self.model, twin.model
        t.rotary = m.rotary
        if m.rows_on:  # the low-dtype weights too (a float32 model's bf16 copy, the FP8 copies), the products its own
            t._rows_dense = [RowsDense(rd.low, t.ops) for rd in m.rows_dense()]
            t._head_low = m.head_low
        return twin

    def fall_back(self, to: str, why: str) -> None:
        """Go on after the first replay of a new capture failed its check (run.graphs.first_replay): the plan says
        which and why (run.plan.fall_back), nothing is captured from now on (the decode graphs dropped), and with
        'torch' the model and the ops are the torch twin's (the steps that ran on the old ones switch in place:
        their owners' checks do it)."""
        warnings.warn(f"CUDA graphs: {why}; the run goes on "
                      + ("uncaptured" if to == "uncaptured" else "through the torch ops, uncaptured"), SiclWarning,
                      stacklevel=2)
        self.plan = fall_back(self.plan, to, why)
        self.decoders = None
        if to == "torch":
            twin = self.torch_twin()
            self.model, self.ops, self.decoder_ops = twin.model, twin.ops, twin.decoder_ops

    def step_forward(self, prompt: Prompt, prefix: str, B: int, X0: torch.Tensor | None = None,
                     rows: bool | None = None, bucket=None) -> StepForward:
        """The forward of this prompt's perturbation batches of B rows (sicl_fast.backends.step_forward): prefix
        policy 'kept' / 'pass' / 'none' ('none' always without the prefix cache); X0 [L, d]: the rows a kept prefix
        is computed from; rows: the difference form (None: the plan's, when difference products are on); bucket: a
        length bucket's sizes (sicl_fast.run.buckets), or None."""
        return StepForward(self, prompt, prefix if self.prefix_cache else "none", B, X0, rows, bucket)

    def packed_forward(self) -> PackedForward:
        """The forward of several prompts' perturbation batches in one pass (the packed step; its slots laid out by
        PackedForward.arrange)."""
        return PackedForward(self)

    def span_plan(self, prompt: Prompt) -> SpanPlan:
        """The prompt's span positions and targets laid out on the device once (see SpanPlan)."""
        return SpanPlan.of(prompt, self.model.device)

    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        """See Backend. Through a StepForward whose prefix rows run in the same call: the difference form when
        near_row0 (rows 1.. near row 0) and difference products are on, else the plain forward."""
        self.check_embeds(embeds, prompt)
        B = embeds.shape[0]
        x = embeds[:, :prompt.demo_end].to(device=self.model.device, dtype=torch.float32)
        rows = near_row0 and self.model.rows_on and B > 1
        return self.step_forward(prompt, "pass", B, x[0], rows=rows)(x)  # its references at this batch's row 0

    def differentiable_logprobs(self, embeds: torch.Tensor, prompt: Prompt, checkpoint: bool = False) -> torch.Tensor:
        """The full rows [0, b) (no prefix cache: its attention merge has no backward) through plain products (the
        difference form is for perturbation batches), with autograd recording; see Backend."""
        self.check_embeds(embeds, prompt)
        m, plan = self.model, self.span_plan(prompt)
        m.fit_rope(prompt.length)
        x = embeds[:, :prompt.demo_end].to(device=m.device, dtype=m.dtype)  # [1, b, d]
        with torch.enable_grad():
            h = m.forward(x, checkpoint=checkpoint).index_select(1, plan.idx)  # [1, P, d]
            return self.ops.span_head(h, m.head, plan.targets, softcap=m.final_softcap)

    def generate(self, embeds: torch.Tensor, prompt: Prompt, max_new_tokens: int, stop_strings=(),
                 stop_fn: Callable[[str], bool] | None = None):
        """Greedy answer from embeddings [L, d] with a static KV cache: fixed buffers, each token written in
        place at a device-held position and attended over the whole buffer with a mask (no shape changes with
        the length), the argmax on the device, and the tokens read every `read_every` tokens. Same stop rules
        and result type (sicl_fast.backends.generate.Generation) as the hf path's greedy_generate."""
        from .generate import check_inputs, greedy_decode

        lm, m = self.lm, self.model
        check_inputs(lm, embeds, max_new_tokens)
        L = embeds.shape[0]
        m.fit_rope(L)  # the prompt's tables; the rows decoded past it take their own length's (Rotary)
        rows = L + max(max_new_tokens, 1)
        if self.decoders is None:
            cache = m.new_cache(rows)
            step = lambda token: m.decode_logits(token, cache)  # noqa: E731
        else:  # graphs: a bucketed cache length, so a new prompt length mostly finds its graph captured
            n = cache_rows(rows)
            if lm.max_context is not None:
                n = max(min(n, lm.max_context), rows)
            dec, _ = self.decoders.get(n, lambda: DecodeGraph(m, n, self.ops, self._decode_captures,
                                                              check=lambda d: DecodeCheck(d, self)))
            cache, step = dec.cache, dec.step

        @torch.no_grad()  # the forward records autograd for inputs that require grad; decoding never needs it
        def prefill():
            x = embeds.to(device=m.device, dtype=m.dtype).unsqueeze(0)  # [1, L, d]
            logits = m.logits(m.forward(x, 0, cache=cache)[:, -1])[0]
            cache.pos.fill_(L)
            return logits

        return greedy_decode(lm, prefill, step, max_new_tokens, stop_strings, stop_fn, read_every=self.read_every)


class DecodeCheck(ReplayCheck):
    """The first replay of a decode graph (DecodeGraph) against the torch twin's decode step on a copy of its cache:
    the next-token logits within 1e-3 of their largest magnitude for a float32 model, 2^-4 for a bf16 / fp16 one
    (the model dtype's rounding through every layer; a wrong kernel or a stale graph is off by far more)."""

    name = "decode step"

    def __init__(self, dec: DecodeGraph, backend: FastBackend) -> None:
        self.dec, self.backend = weakref.ref(dec), weakref.ref(backend)  # both own the graph this check is held by

    def state(self) -> list:
        c = self.dec().cache
        return [*c.k, *c.v, c.pos, self.dec().logits]

    def reference(self) -> list:
        dec, twin = self.dec(), self.backend().torch_twin()
        cache = twin.model.new_cache(dec.max_len)
        for mine, theirs in zip([*cache.k, *cache.v, cache.pos], [*dec.cache.k, *dec.cache.v, dec.cache.pos]):
            mine.copy_(theirs)
        with torch.no_grad():
            return [twin.model.decode_logits(dec.token, cache).clone()]

    def outputs(self) -> list:
        return [self.dec().logits]

    @staticmethod
    def tolerance(logits: torch.Tensor) -> float:
        """The stated tolerance for the reference's next-token logits (class docstring)."""
        share = 1e-3 if logits.dtype == torch.float32 else 2.0 ** -4
        return share * float(logits.float().abs().max())

    def compare(self, got: list, want: list) -> str | None:
        return off_by("the logits", got[0], want[0], self.tolerance(want[0]))

    def fall_back(self, to: str, why: str) -> None:
        backend, dec = self.backend(), self.dec()
        backend.fall_back(to, why)
        if to == "torch":
            dec.model = backend.model
            dec._decode()


__all__ = ["FastBackend", "DecodeCheck", "SUPPORTED_FAMILIES", "UnsupportedModelError", "SpanPlan", "StepForward"]
