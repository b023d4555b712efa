"""Span log-probabilities from hidden states: the torch reference of the LM head at span positions.

The Triton kernel `sicl_fast.kernels.span_logprobs` computes the same function with an online log-sum-exp over
vocabulary chunks and is tested against `gather_logprobs_chunked`.
"""
from __future__ import annotations

import torch


def gather_logprobs_chunked(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    max_elems: int = 1 << 25,
) -> torch.Tensor:
    """hidden [B, P, d] @ head_weight[V, d].T -> log_softmax -> gather targets [P]. Returns [B, P] float32.

    Only [B, chunk, V] logits exist at a time (chunks along P sized so B*chunk*V <= max_elems);
    log_softmax is taken in float32 whatever the weights' dtype.
    """
    B, P, _ = hidden.shape
    V = head_weight.shape[0]
    chunk = max(1, max_elems // max(1, B * V))
    out = torch.empty(B, P, dtype=torch.float32, device=hidden.device)
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        logits = torch.matmul(hidden[:, s:e], head_weight.t()).float()  # [B, c, V]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        lse = torch.logsumexp(logits, dim=-1)  # [B, c]
        tgt = targets[s:e].to(hidden.device)
        picked = logits.gather(-1, tgt.view(1, -1, 1).expand(B, -1, 1)).squeeze(-1)
        out[:, s:e] = picked - lse
    return out
