"""`hf` backend: any transformers causal LM, truncated at the last output token, LM head at span positions only."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.utils.checkpoint

from ..errors import SiclError
from ..formats.spans import Prompt
from ..models.output_head import own_logits, own_rows
from .base import Backend


class HFBackend(Backend):
    """Runs the model's decoder on rows [0, demo_end) and the LM head on the P span positions only.

    The query rows cannot change the proxy (causal attention), so they are never run. The span rows' logits are
    the model's own (the run plan's OutputHead, sicl_fast.models.output_head, checked against the model's forward
    when the plan was made): mode 'table' takes the output module's weight a vocabulary chunk at a time with the
    family's bias, multiplier, soft-cap and vocabulary (at most [B*P, chunk] logits); mode 'own' runs the model's
    own forward at the span rows ([B, P, V], a few batch rows a call). The full [B, L, V] logits never exist. The
    same forward is differentiable (`differentiable_logprobs`, the exact-gradient ascent).
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
        lm, head = self.lm, self.plan.head
        # a copy: some forwards scale or shift their inputs_embeds in place (CTRL, GIT)
        x = embeds[:, :prompt.demo_end].to(device=lm.device, dtype=lm.dtype, copy=True)  # [B, b, d]
        pos = (prompt.positions - 1).to(lm.device)  # the hidden state at t-1 predicts token t
        if head.mode == "own":
            return self._own_head(x, pos, prompt.targets.to(lm.device))
        hidden = lm.decoder(inputs_embeds=x, use_cache=False).last_hidden_state  # [B, b, d]
        h = hidden.index_select(1, pos)  # [B, P, d]
        w, b = head.weight_and_bias(lm)
        return self.ops.span_head(h if head.scale is None else h * head.scale, w, prompt.targets,
                                  softcap=head.softcap, bias=b)

    def _own_head(self, x: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mode 'own': the model's forward at the span rows, log_softmax at the targets, a few batch rows a call."""
        head, V = self.plan.head, self.lm.model.get_output_embeddings().weight.shape[0]
        per_row = pos.numel() if head.keep else x.shape[1]
        rows = own_rows(per_row, V)
        out = []
        for r in range(0, x.shape[0], rows):
            z = own_logits(self.lm, x[r:r + rows], pos, head.keep)  # [rows, P, V] float32
            t = targets.view(1, -1, 1).expand(z.shape[0], -1, 1)
            out.append(z.gather(-1, t).squeeze(-1) - torch.logsumexp(z, dim=-1))
        return torch.cat(out)


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
