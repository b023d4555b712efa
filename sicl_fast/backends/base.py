"""The backend interface: batched span log-probabilities (and greedy generation) from prompt embeddings.

A backend knows nothing of the ascent: it maps a batch of embedding matrices to the log-probabilities of the
demonstrated output tokens. The ascent knows nothing of a backend's insides. Each backend runs one run plan
(`plan`, sicl_fast.run.plan) and holds the ops of the plan's implementation (sicl_fast.ops): `ops`, the StepOps
that the ascent on it uses too, and `decoder_ops`, the DecoderOps of the fast decoder.
"""
from __future__ import annotations

import abc

import torch

from ..errors import NumericalError, SiclError
from ..ops import make_ops
from ..run.plan import RunPlan, no_differentiable_forward
from ..formats.spans import Prompt
from ..models.facts import transformers_attention


class SpanLogprobsForward:
    """The step forward of a backend without one of its own: each batch through span_logprobs; nothing kept, so
    nothing to refresh."""

    refresh_every = 0

    def __init__(self, backend, prompt: Prompt) -> None:
        self.backend, self.prompt = backend, prompt

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.backend.span_logprobs(batch, self.prompt, near_row0=True)

    def refresh(self, X: torch.Tensor) -> None:
        pass


class Backend(abc.ABC):
    """Base class. `lm` is a `sicl_fast.models.LoadedModel`; plan the RunPlan it runs, made for `lm` by
    sicl_fast.run.plan.make_plan (build_backend(plan, lm), or make_backend(name, lm, **choices), which makes both):
    a backend decides nothing of its own."""

    def __init__(self, lm, plan: RunPlan) -> None:
        if not isinstance(plan, RunPlan):
            raise SiclError(f"{type(self).__name__} runs a RunPlan (sicl_fast.run.plan.make_plan), got "
                            f"{type(plan).__name__}; make_backend(name, lm, ...) makes both")
        self.lm = lm
        self.plan = plan
        self.ops, self.decoder_ops = make_ops(self.plan.impl, lm.device)

    @property
    def name(self) -> str:
        """The plan's backend: 'fast', 'fast-fp32' (the fast class with plain products), 'hf' or 'naive'."""
        return self.plan.backend

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def attention_kernel(self) -> str:
        """The attention that runs (the store's key holds it, RunPlan.result_axes): here transformers' own, as the
        loaded model's config names it ('transformers:sdpa', 'transformers:eager', ...)."""
        return transformers_attention(self.lm)

    def embed(self, prompt: Prompt) -> torch.Tensor:
        """X0 [L, d] float32: what the model's input-embedding module returns for the prompt's tokens."""
        with torch.no_grad():
            ids = prompt.input_ids.to(self.device)
            return self.lm.model.get_input_embeddings()(ids).float()

    @abc.abstractmethod
    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        """embeds [B, n, d] (rows 0..n-1 of the prompt, n >= prompt.demo_end; float32 or the model's dtype)
        -> [B, P] float32 log p(target_t | x_<t) at the prompt's span positions.

        near_row0: a promise that rows 1.. are small perturbations of row 0 (the ascent's batch); a backend may
        use it to compute the rows' differences more cheaply (the fast backend's difference products)."""

    def step_forward(self, prompt: Prompt, prefix: str, B: int, X0: torch.Tensor | None = None):
        """The forward of this prompt's perturbation batches (B rows, rows 1.. near row 0): a callable batch
        [B, n, d] float32 -> [B, P] log-probs, with refresh(X) and refresh_every (the steps between two calls of
        refresh the loops make). prefix: how rows [0, a) may be treated ('kept': unchanged during the run, computed
        from X0; 'pass': may change between calls; 'none'; StepSpec.prefix_policy). Here: SpanLogprobsForward; the
        fast backend's own object is sicl_fast.backends.step_forward.StepForward."""
        return SpanLogprobsForward(self, prompt)

    def differentiable_logprobs(self, embeds: torch.Tensor, prompt: Prompt, checkpoint: bool = False) -> torch.Tensor:
        """embeds [1, n, d] (float32 or float64; may require grad) -> [1, P] log-probs (float32, or float64 from
        a float64 model) with autograd recording, so that the proxy's gradient in the embeddings can be taken
        (calibration.grad). checkpoint: recompute each layer in the backward instead of keeping its activations.
        Backends without a differentiable forward refuse (the run plan's grad_refusal says so first)."""
        raise SiclError(no_differentiable_forward(self.name))

    def check_embeds(self, embeds: torch.Tensor, prompt: Prompt) -> None:
        """Shape and value checks shared by every backend; raise with what is wrong."""
        if embeds.dim() != 3:
            raise SiclError(f"request {prompt.id!r}: embeddings must be [B, n, d], got shape {tuple(embeds.shape)}")
        d = self.lm.hidden_size
        if embeds.shape[2] != d:
            raise SiclError(f"request {prompt.id!r}: embeddings have width {embeds.shape[2]}, the model needs {d}")
        if embeds.shape[1] < prompt.demo_end:
            raise SiclError(
                f"request {prompt.id!r}: embeddings cover {embeds.shape[1]} rows, the output spans end at row "
                f"{prompt.demo_end}"
            )
        if not bool(torch.isfinite(embeds).all()):
            bad = torch.nonzero(~torch.isfinite(embeds))[0].tolist()
            raise NumericalError(
                f"request {prompt.id!r}: embeddings contain NaN or inf (first at batch {bad[0]}, row {bad[1]})"
            )

    def generate(self, embeds: torch.Tensor, prompt: Prompt, max_new_tokens: int, stop_strings=(), stop_fn=None):
        """Greedy answer from prompt embeddings [L, d] (calibrated demos + original query)."""
        from .generate import greedy_generate

        return greedy_generate(
            self.lm, embeds, max_new_tokens=max_new_tokens, stop_strings=stop_strings, stop_fn=stop_fn
        )
