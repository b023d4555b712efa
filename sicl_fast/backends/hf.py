"""`hf` backend: any transformers causal LM, truncated at the last output token, LM head at span positions only."""
from __future__ import annotations

import torch

from ..spans import Prompt
from .base import Backend


class HFBackend(Backend):
    """Runs the model's decoder on rows [0, demo_end) and the LM head on the P span positions only.

    The query rows cannot change the proxy (causal attention), so they are never run; the full [B, L, V]
    logits never exist (at most [B, chunk, V], chunked along P).
    """

    name = "hf"

    def span_logprobs(self, embeds: torch.Tensor, prompt: Prompt, near_row0: bool = False) -> torch.Tensor:
        self.check_embeds(embeds, prompt)
        lm = self.lm
        b = prompt.demo_end
        x = embeds[:, :b].to(device=lm.device, dtype=lm.dtype)  # [B, b, d]
        with torch.no_grad():
            hidden = lm.decoder(inputs_embeds=x, use_cache=False).last_hidden_state  # [B, b, d]
            pos = (prompt.positions - 1).to(lm.device)  # the hidden state at t-1 predicts token t
            h = hidden.index_select(1, pos)  # [B, P, d]
            return self.ops.span_head(h, lm.head_weight, prompt.targets, softcap=lm.final_softcap)
