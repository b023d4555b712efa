"""The products of one decoder layer, as swappable objects with one interface, so the block has one path:

    Dense      plain products, any batch (F.linear in the model dtype)
    DiffDense  the difference products of a perturbation batch (rows 1.. near row 0; float32 models):
               row 0 in float32, the other rows' differences from it in bf16 (sicl_fast.models.diff), with the
               epilogues of the model's DecoderOps

    qkv(h [B, T, d]) -> q [B, T, H hd], k, v [B, T, Hk hd]
    out(o [B, T, H hd]) -> [B, T, d]
    mlp(h [B, T, d]) -> [B, T, d]          act(gate) * up, then down
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import diff


@dataclass
class LowWeights:
    """One layer's projection weights, concatenated per product and stored once in the difference format
    (diff.Bf16Weight or diff.Fp8Weight)."""

    qkv: object  # [(H + 2 Hk) hd, d]: q, k, v stacked
    o: object  # [d, H hd]
    gate_up: object  # [2 I, d]: gate, up stacked
    down: object  # [d, I]

    @classmethod
    def of(cls, L, fmt: str) -> LowWeights:
        """fmt: 'bf16' or 'fp8'."""
        W = diff.Fp8Weight if fmt == "fp8" else diff.Bf16Weight
        return cls(qkv=W(torch.cat([L.wq, L.wk, L.wv])), o=W(L.wo), gate_up=W(torch.cat([L.w_gate, L.w_up])),
                   down=W(L.w_down))


class Dense:
    """Plain products of one layer `L` (a transformer.Layer); the MLP's activation (act_name) by ops.gated."""

    def __init__(self, L, act_name: str, ops) -> None:
        self.L, self.act_name, self.ops = L, act_name, ops

    def qkv(self, h):
        L = self.L
        return F.linear(h, L.wq, L.bq), F.linear(h, L.wk, L.bk), F.linear(h, L.wv, L.bv)

    def out(self, o):
        return F.linear(o, self.L.wo, self.L.bo)

    def mlp(self, h):
        L = self.L
        a = self.ops.gated(F.linear(h, L.w_gate, L.b_gate), F.linear(h, L.w_up, L.b_up), self.act_name)
        return F.linear(a, L.w_down, L.b_down)


class DiffDense(Dense):
    """Difference products of one layer (module docstring): low = its LowWeights, ops = the model's DecoderOps."""

    def __init__(self, L, act_name: str, low: LowWeights, ops) -> None:
        super().__init__(L, act_name, ops)
        self.low = low

    def qkv(self, h):
        L = self.L
        qkv = diff.linear(self.ops, h, (L.wq, L.wk, L.wv), (L.bq, L.bk, L.bv), self.low.qkv)
        return qkv.split([L.wq.shape[0], L.wk.shape[0], L.wv.shape[0]], dim=-1)

    def out(self, o):
        return diff.linear(self.ops, o, (self.L.wo,), (self.L.bo,), self.low.o)

    def mlp(self, h):
        """The gated activations come out as row 0 and bf16 differences, ready for the down product."""
        L, ops = self.L, self.ops
        a0, da = ops.gated_diff(*diff.product(h[:1], ops.diff_rows(h), (L.w_gate, L.w_up), (L.b_gate, L.b_up),
                                              self.low.gate_up), self.act_name)
        return ops.add_rows(*diff.product(a0, da, (L.w_down,), (L.b_down,), self.low.down))


__all__ = ["LowWeights", "Dense", "DiffDense"]
