"""Span log-probabilities from hidden states: the LM head at span positions only.

`vocab_chunked_logprobs` is the torch reference (the span head of TorchStepOps, sicl_fast.ops): log_softmax of the
targets with an online log-sum-exp over vocabulary chunks, so the head weight is read once and only [B*P, chunk]
logits exist. CppStepOps's span head (torch's products, the log-sum-exp in csrc/span_head.cpp) and the Triton kernel
`sicl_fast.kernels.span_logprobs` compute the same function; all are tested against it and against the definition
on whole vocabulary rows (tests/conftest.py's span_logprobs_oracle).

`rows_logprobs` is the span head of a difference-form pass (sicl_fast.models.rows): the hidden states come as values
and differences in the low dtype, one low-precision product gives every row's logits in the same form, and the
log-sum-exp runs on the float32 logits z_0 and z_0 + dz_i (StepOps.span_head_rows; the reference of its fused forms).
"""
from __future__ import annotations

import math

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every model dtype but float64, which stays float64 (so a float64 model's proxy and its exact
    gradient can be checked against finite differences without a float32 rounding in the way)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fold_chunk(z: torch.Tensor, v0: int, tgt: torch.Tensor, softcap: float | None, m: torch.Tensor,
                s: torch.Tensor, picked: torch.Tensor) -> tuple:
    """One vocabulary chunk's logits z [N, c] (vocabulary rows v0 .. v0 + c) soft-capped and folded into the running
    max m, the sum s rescaled to it and the targets' logits picked ([N] each; tgt [N] the targets) -> (m, s, picked)."""
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    m_new = torch.maximum(m, z.amax(dim=-1))
    s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=-1)
    # the target's logit, where it falls in this chunk: a select, not a data-dependent branch (no host read)
    v1 = v0 + z.shape[1]
    here = (tgt >= v0) & (tgt < v1)
    picked = torch.where(here, z.gather(1, (tgt - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), picked)
    return m_new, s, picked


def vocab_chunked_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    max_elems: int = 1 << 22,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """log_softmax(hidden @ head_weight.T + bias) at the targets: hidden [B, P, d], head_weight [V, d], targets [P],
    bias [V] or None -> [B, P] float32 (float64 from a float64 model: the exact-gradient checks). Walks the
    vocabulary in chunks (256 to 8192 rows, B*P*chunk <= max_elems when it can) with a running max and rescaled sum,
    so only [B*P, chunk] float32 logits exist and the weight is read once."""
    B, P, d = hidden.shape
    V = head_weight.shape[0]
    chunk = min(8192, max(256, max_elems // max(1, B * P)))
    h = hidden.reshape(B * P, d)
    tgt = targets.to(hidden.device).repeat(B)  # [B*P]
    acc = accumulation_dtype(hidden.dtype)
    m = torch.full((B * P,), -math.inf, dtype=acc, device=hidden.device)
    s = torch.zeros(B * P, dtype=acc, device=hidden.device)
    picked = torch.zeros(B * P, dtype=acc, device=hidden.device)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        z = torch.matmul(h, head_weight[v0:v1].t()).to(acc)  # [B*P, c]
        if bias is not None:  # an output module's bias (Phi-2, GPT-J: the hf backend's head)
            z = z + bias[v0:v1].to(acc)
        m, s, picked = _fold_chunk(z, v0, tgt, softcap, m, s, picked)
    return (picked - (m + torch.log(s))).view(B, P)


def rows_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, anchor: torch.Tensor,
                  softcap: float | None = None, z_ref: torch.Tensor | None = None,
                  value_slot: torch.Tensor | None = None, max_elems: int = 1 << 22) -> torch.Tensor:
    """hidden [B, P, d] in difference form over the batch (anchor [B]; sicl_fast.models.rows), head_weight [V, d]
    in the same low dtype, targets [P] -> [B, P] float32 log p(target). z_ref [Vb, P, V] float32: the value rows'
    reference logits (value batch row j's at z_ref[value_slot[j]]; its hidden states are then changes from the
    reference's); None: none, the value rows' hidden states are values and their logits are their float32 products
    with the low-precision weights (a logit of 16 rounded to bf16 would move by up to 0.03, and the proxy with it).
    Per vocabulary chunk, one low-precision product of every row gives the changes (rounded as the product rounds
    them: relative to a change); the value rows' logits are the reference's plus their change, a difference row's
    its anchor's plus its own; soft-capped, then folded into a running max and sum as vocab_chunked_logprobs
    does."""
    from ..models.rows import from_form, is_value

    B, P, d = hidden.shape
    V = head_weight.shape[0]
    chunk = min(8192, max(256, max_elems // max(1, B * P)))
    tgt = targets.to(hidden.device).repeat(B)  # [B*P]
    value = is_value(anchor).view(B, 1, 1)
    ref = z_ref.index_select(0, value_slot) if z_ref is not None else None  # [B, P, V]
    m = torch.full((B * P,), -math.inf, device=hidden.device)
    s = torch.zeros(B * P, device=hidden.device)
    picked = torch.zeros(B * P, device=hidden.device)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        w = head_weight[v0:v1]
        if ref is None:
            z = torch.where(value, torch.matmul(hidden.float(), w.float().t()), torch.matmul(hidden, w.t()).float())
            z = from_form(z, anchor)
        else:
            z = from_form(torch.matmul(hidden, w.t()), anchor, ref[..., v0:v1])
        m, s, picked = _fold_chunk(z.view(B * P, v1 - v0), v0, tgt, softcap, m, s, picked)  # float32 rows
    return (picked - (m + torch.log(s))).view(B, P)
