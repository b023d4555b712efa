"""`hf` backend: any transformers causal LM, truncated at the last output token, LM head at span positions only."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.utils.checkpoint

from ..errors import SiclError
from ..formats.spans import Prompt
from .base import Backend


class HFBackend(Backend):
    """Runs the model's decoder on rows [0, demo_end) and the LM head on the P span positions only.

    The query rows cannot change the proxy (causal attention), so they are never run; the full [B, L, V]
    logits never exist (at most [B, chunk, V], chunked along P). The same forward is differentiable
    (`differentiable_logprobs`, the exact-gradient ascent).
    """

    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        with torch.no_grad():
            return self._span_forward(embeds, prompt)

    def differentiable_logprobs(self, embeds: torch.Tensor, prompt: Prompt, checkpoint: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        with torch.enable_grad(), layer_checkpointing(self.lm, checkpoint):
            return self._span_forward(embeds, prompt)

    def _span_forward(self, embeds: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        lm = self.lm
        x = embeds[:, :prompt.demo_end].to(device=lm.device, dtype=lm.dtype)  # [B, b, d]
        hidden = lm.decoder(inputs_embeds=x, use_cache=False).last_hidden_state  # [B, b, d]
        pos = (prompt.positions - 1).to(lm.device)  # the hidden state at t-1 predicts token t
        h = hidden.index_select(1, pos)  # [B, P, d]
        return self.ops.span_head(h, lm.head_weight, prompt.targets, softcap=lm.final_softcap)


def _dropout_probabilities(lm) -> list[float]:
    """Every dropout probability the decoder could apply in training mode (modules and config fields)."""
    ps = [float(m.p) for m in lm.decoder.modules() if isinstance(m, torch.nn.Dropout)]
    cfg = lm.text_config
    ps += [float(getattr(cfg, k) or 0.0) for k in ("attention_dropout", "hidden_dropout", "dropout")
           if isinstance(getattr(cfg, k, None), (int, float))]
    return ps


@contextlib.contextmanager
def layer_checkpointing(lm, on: bool):
    """Per-layer activation checkpointing of a transformers decoder for the duration of the block.

    transformers checkpoints a layer (GradientCheckpointingLayer) only when the layer is in training mode; we set
    that flag on the layer objects alone, so their submodules stay in eval mode, and refuse a model with a nonzero
    dropout probability anywhere (a training-mode layer must not be able to drop anything)."""
    if not on:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = list(getattr(lm.decoder, "layers", []))
    if not layers or not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        raise SiclError(f"checkpoint: the layers of {lm.name!r} do not support activation checkpointing in "
                        "transformers; run without checkpoint (--checkpoint)")
    if any(p > 0 for p in _dropout_probabilities(lm)):
        raise SiclError(f"checkpoint: {lm.name!r} has a nonzero dropout probability, and transformers checkpoints "
                        "only layers in training mode; run without checkpoint (--checkpoint)")
    saved = [(layer.training, layer.gradient_checkpointing, layer.__dict__.get("_gradient_checkpointing_func"))
             for layer in layers]
    fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    try:
        for layer in layers:
            layer.training, layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, True, fn
        yield
    finally:
        for layer, (training, gc, f) in zip(layers, saved):
            layer.training, layer.gradient_checkpointing = training, gc
            if f is None:
                layer.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                layer._gradient_checkpointing_func = f
