"""`naive` backend: the reference implementation's form, kept for benchmarks and as a parity oracle.

Full prompt (query included) through the whole model, full [B, L, V] logits, log_softmax over the vocabulary,
then a gather at the span positions. Correct, and as slow and memory-hungry as it sounds.
"""
from __future__ import annotations

import torch

from ..formats.spans import Prompt
from .base import Backend


class NaiveBackend(Backend):
    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        lm = self.lm
        x = embeds.to(device=lm.device, dtype=lm.dtype, copy=True)  # [B, L, d]; CTRL, GIT change it in place
        with torch.no_grad():
            logits = lm.model(inputs_embeds=x, use_cache=False).logits.float()  # [B, L, V]: the model's own
            logp = torch.log_softmax(logits, dim=-1)
            pos = prompt.positions.to(lm.device)
            tgt = prompt.targets.to(lm.device)
            return logp[:, pos - 1, tgt]  # [B, P]
