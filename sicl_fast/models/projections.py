"""The products of one decoder layer, over its stacked weights (sicl_fast.models.weights), in two forms:

    Dense      plain products in the model dtype, any batch (F.linear), for the forwards whose rows are not a
               perturbation batch (decoding, prefill, single rows, the exact gradient)
        qkv(h [..., d]) -> q [..., H hd], k, v [..., Hk hd]     one product, split by views
        out(o [..., H hd]) -> [..., d]
        mlp(h [..., d]) -> [..., d]                             gate | up in one product, act(gate) * up, down
    RowsDense  the difference form's products (sicl_fast.models.rows): every row of a pass, values and differences,
               in one low-precision product per projection (with FP8 differences, one bf16 product of the value
               rows and one FP8 product of the difference rows), without the bias (the row epilogue that reads the
               product adds it to the float32 rows: a difference carries none)
        qkv(h [R, d] low) -> [R, (H + 2 Hk) hd] low,  out(o) -> [R, d] low,  gate_up(h) -> [R, 2I] low,
        down(a [R, I] low) -> [R, d] low
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rows import RowLayout
from .weights import LayerWeights, LowWeight, LowWeights


class Dense:
    """Plain products of one layer's stacked weights `w`; the MLP's activation (act_name) by ops.gated."""

    def __init__(self, w: LayerWeights, act_name: str, ops) -> None:
        self.w, self.act_name, self.ops = w, act_name, ops

    def qkv(self, h):
        w = self.w
        return F.linear(h, w.qkv, w.qkv_bias).split([w.q_rows, w.kv_rows, w.kv_rows], dim=-1)

    def out(self, o):
        return F.linear(o, self.w.o, self.w.o_bias)

    def mlp(self, h):
        w = self.w
        gate, up = F.linear(h, w.gate_up, w.gate_up_bias).split([w.inter, w.inter], dim=-1)
        return F.linear(self.ops.gated(gate, up, self.act_name), w.down, w.down_bias)


def _product(low: LowWeight, x: torch.Tensor, rows: RowLayout, ops) -> torch.Tensor:
    """x [R, k] low (difference form) -> [R, o] low. One bf16 product of every row; with FP8 differences, one
    product of each kind of row: the value rows' in bf16 (their change from the reference, which FP8's 3 mantissa
    bits would blur), the difference rows' in FP8 (quantised by ops.fp8_rows, a scale a row), each written into its
    rows of y. One prompt's pass has its value rows first (rows.value_end): two slices; a packed pass's are
    gathered and scattered by index."""
    n = rows.differences.numel()
    if low.fp8 is None or not n:
        return low.linear(x)
    y = x.new_empty(x.shape[0], low.out_features)
    s = rows.value_end
    if s is not None:
        low.linear(x[:s], out=y[:s])
        low.linear_fp8(*ops.fp8_rows(x[s:]), out=y[s:])
        return y
    value, diff = rows.value_rows, rows.difference_rows
    y.index_copy_(0, value, low.linear(x.index_select(0, value)))
    y.index_copy_(0, diff, low.linear_fp8(*ops.fp8_rows(x.index_select(0, diff))))
    return y


class RowsDense:
    """The difference form's products of one layer (module docstring): low = its LowWeights; ops: the DecoderOps
    whose fp8_rows quantises FP8 differences."""

    def __init__(self, low: LowWeights, ops) -> None:
        self.low, self.ops = low, ops

    def qkv(self, h, rows: RowLayout):
        return _product(self.low.qkv, h, rows, self.ops)

    def out(self, o, rows: RowLayout):
        return _product(self.low.o, o, rows, self.ops)

    def gate_up(self, h, rows: RowLayout):
        return _product(self.low.gate_up, h, rows, self.ops)

    def down(self, a, rows: RowLayout):
        return _product(self.low.down, a, rows, self.ops)


__all__ = ["Dense", "RowsDense"]
