"""Query-only answering on the fast decoder: a query's prefill against the stored K/V of the calibrated rows
[0, b), then greedy decoding; many queries (of any lengths) as one batch.

    kv = stored_kv(model, calibration)          the K/V of rows [0, b), per layer [1, b, Hk, hd] (once per entry)
    QueryKV(kv.kv[i], k, v, slot)               one layer's K/V of a batch of queries after those rows

The batch that decodes them (its rows joining and leaving: answering.decode_batch.DecodeBatch; a fixed list:
decode_batch.decode_queries) is built on these.

Layout: query j's own rows [b, L_j) (T_j of them) sit at positions b .. L_j - 1, and own-key slot s of row j holds
position b + s. The prefill runs the B queries right-padded to T = max T_j (a row's padding comes after its real
rows, so causal attention never lets a real row see it) and reads row j's first answer token at T_j - 1. Decoding
step t writes row j's token at slot T_j + t (over its padding) at position b + T_j + t: rotary tables and masks per
row, so ragged queries decode together. Every row attends to the stored keys (batch 1, shared, never copied) and to
its own, merged by log-sum-exp: the prefill through the decoder's own attention with the stored K/V as its prefix,
a decoding step through the math attention with a mask per row (sicl_fast.models.attention).

Each layer's K/V object (`QueryKV`) plugs into the decoder's one block path (Transformer.run), as RowsKV and CacheKV
do. The answers are the greedy tokens of the full calibrated matrix (the calibration's rows, then the query's own
embeddings) decoded by FastBackend.generate: tested on every family and on SmolLM2 (tests/test_answer.py).
"""
from __future__ import annotations

import math

import torch

from ..backends.step_forward import fixed_rows_kv
from ..models.attention import attend_math, merge
from ..models.transformer import Positions


class StoredKV:
    """The K/V of a calibration's rows [0, b): per layer (k, v), each [1, b, Hk, hd] in the model dtype; last: the
    final-normed hidden state [d] of row b - 1 (the first answer token of a query with no rows of its own); rope: the
    rotary tables' prompt lengths they were computed under (Transformer.rope_lengths)."""

    def __init__(self, kv: list, last: torch.Tensor, rope: tuple = ()) -> None:
        self.kv, self.last, self.rope = kv, last, rope

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv for t in kv) + self.last.numel() * 4


def stored_kv(model, cal, store=None) -> StoredKV:
    """The calibration's K/V on `model` (a Transformer), computed on first use and kept on the entry (the memory
    store re-counts it, `store.touch`, and drops it again when the entry with it would not fit); computed again where
    the rotary tables are another prompt length's (a rope type that depends on it, past its threshold)."""
    if cal.kv is not None and cal.kv.rope == model.rope_lengths:
        return cal.kv
    prefix = fixed_rows_kv(model, cal.rows)  # the rows' K/V as the step forward makes a kept prefix's
    kv = cal.kv = StoredKV(prefix.kv, prefix.hidden[0, -1], model.rope_lengths)
    if store is not None:
        store.touch(cal)
    return kv


def _bias(ok: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, -math.inf)


class QueryKV:
    """One layer's K/V of a batch of queries after the stored rows (module docstring). prefix: the stored (k, v)
    [1, b, Hk, hd]; k, v: the rows' own keys [B, S, Hk, hd]; slot: int64 [B] on the device, the slot a decoding
    step writes (shared by every layer and advanced by the caller)."""

    __slots__ = ("prefix", "k", "v", "slot")

    def __init__(self, prefix, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        self.prefix, self.k, self.v, self.slot = prefix, k, v, slot

    def targets(self, pos: Positions) -> tuple:
        if pos.at is not None:
            return None, None
        return self.k[:, :pos.T], self.v[:, :pos.T]

    def attend(self, attention, q, k, v, pos: Positions, window):
        if pos.at is None:  # prefill: the rows' own keys causally, the stored ones as a shared prefix
            own_k, own_v = self.k[:, :pos.T], self.v[:, :pos.T]
            if own_k.data_ptr() != k.data_ptr():
                own_k.copy_(k)
                own_v.copy_(v)
            return attention(q, own_k, own_v, pos.start, window, self.prefix)
        B, S = self.k.shape[:2]
        at = self.slot.view(B, 1, 1, 1).expand(B, 1, *self.k.shape[2:])
        self.k.scatter_(1, at, k)
        self.v.scatter_(1, at, v)
        b = self.prefix[0].shape[1]
        slots = torch.arange(S, device=self.k.device)
        own = slots[None, :] <= self.slot[:, None]  # [B, S]: what row j has written, its own token included
        pre = torch.ones(B, b, dtype=torch.bool, device=self.k.device)
        if window is not None:  # key position > query position - window; the query sits at b + slot
            own &= slots[None, :] > self.slot[:, None] - window
            pre &= torch.arange(b, device=self.k.device)[None, :] > (b + self.slot[:, None]) - window
        o1, lse1 = attend_math(q, *self.prefix, _bias(pre).view(1, 1, B, 1, 1, b), attention.scale, attention.softcap)
        o2, lse2 = attend_math(q, self.k, self.v, _bias(own).view(B, 1, 1, 1, 1, S), attention.scale,
                               attention.softcap)
        return merge(o1, lse1, o2, lse2)


def decoding_positions(model, at: torch.Tensor) -> Positions:
    """One decoding step at a position per row (at: int64 [B]); rotary tables [B, 1, 1, hd]."""
    return Positions(1, {k: (r.cos.index_select(0, at)[:, None, None], r.sin.index_select(0, at)[:, None, None])
                         for k, r in model.rotary.items()}, at=at)


def supports_kv_answers(backend) -> bool:
    """Does the backend run our decoder (the fast backends)? Others answer from the full calibrated matrix."""
    return hasattr(backend, "model") and hasattr(backend.model, "run")


__all__ = ["StoredKV", "QueryKV", "stored_kv", "decoding_positions", "supports_kv_answers"]
