"""Difference products: a perturbation batch's projections with row 0 in float32 and the other rows' differences
from it in bf16.

In the ascent's batch row 0 is X and rows 1.. are X + mu U_i, so at every projection the input rows 1.. are row
0's plus a small difference. With a float32 model the fast backend can then

    y_0 = x_0 W^T + b                              (float32: row 0 is exact)
    y_i = y_0 + bf16(x_i - x_0) bf16(W)^T          (a bf16 product, 4x the float32 rate on AVX512-BF16 / AMX
                                                    CPUs and on tensor cores, added to y_0 in float32)
    or  y_0 + fp8(x_i - x_0) fp8(W)^T              (diff_matmul 'fp8': e4m3 with a scale per row; emulated on
                                                    machines without FP8 tensor cores, for its accuracy)

Equal to x_i W^T + b in exact arithmetic; the bf16 rounding (about 2^-8 relative) applies to the difference term
only, never to the value. Norms, rotary, attention and the activations stay float32 on every row.

The `*_reference` functions here are the torch reference of each epilogue; the implementation that runs is the
`DecoderOps` object's (sicl_fast.ops: TorchDecoderOps binds these, CppDecoderOps the C++ extension's one-pass,
multithreaded forms in csrc/diff.cpp, tested against them). Tensors are contiguous; float32 and bf16.

    diff_rows(x [B, T, k] f32)                       -> dx [B-1, T, k] bf16:  bf16(x_i - x_0)
    product(x0 [1, T, k] f32, dx, ws, bs, low)       -> y0 [1, T, o] f32, yd [B-1, T, o] bf16
    add_rows(y0, yd)                                 -> y [B, T, o] f32:  y_0, y_0 + yd_i
    linear(ops, x [B, T, k] f32, ws, bs, low)        -> y [B, T, o] f32:  the three above in a row
    gated_diff(y0 [1, T, 2I], yd [B-1, T, 2I], act_name) -> a0 [1, T, I] f32, da [B-1, T, I] bf16
                                                        a = act(gate) * up on rows y0 and y0 + yd_i
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .elementwise import ACTIVATIONS

DIFF_DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def diff_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, k] float32 -> [B-1, T, k] bf16: each row's difference from row 0, rounded to bf16."""
    return torch.sub(x[1:], x[:1]).to(DIFF_DTYPE)


def add_rows_reference(y0: torch.Tensor, yd: torch.Tensor) -> torch.Tensor:
    """y0 [1, T, o] float32, yd [R, T, o] bf16 -> [R+1, T, o] float32: y0, then y0 + yd_i."""
    return torch.cat([y0, y0 + yd.float()])


def gated_diff_reference(y0: torch.Tensor, yd: torch.Tensor, act_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated MLP activations from (gate | up) products: y0 [1, T, 2I] float32, yd [R, T, 2I] bf16 ->
    a0 [1, T, I] float32 (= act(g0) * u0) and da [R, T, I] bf16 (= a(y0 + yd_i) - a0); act: the activation
    act_name names (sicl_fast.models.elementwise.ACTIVATIONS)."""
    act = ACTIVATIONS[act_name]
    g0, u0 = y0.chunk(2, dim=-1)
    a0 = act(g0) * u0
    g, u = (y0 + yd.float()).chunk(2, dim=-1)
    return a0, (act(g) * u - a0).to(DIFF_DTYPE)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] -> (q [..., k] float8 e4m3, scale [..., 1] float32) with x ~ q * scale, one scale per row (its
    largest magnitude maps to 448): 3 mantissa bits, so each element within 2^-4 relative of x's."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(FP8), scale


def mkldnn_packed(w: torch.Tensor):
    """w [o, k] bf16 reordered once into oneDNN's blocked layout for its bf16 inner-product kernel (CPU, where torch
    has oneDNN and the CPU multiplies bf16: AVX512-BF16 / AMX), or None where that is not available. The product
    through it (`packed_linear`) is the same oneDNN kernel F.linear dispatches to, without the per-call reorder of
    the weight: the same bits, a few per cent faster (bench/matmul_rates.py measures both side by side)."""
    try:
        if w.device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except (AttributeError, RuntimeError):  # a torch build without oneDNN or these ops
        return None


def packed_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., k] bf16 @ w.T for w packed by mkldnn_packed -> [..., o] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Bf16Weight:
    """The stacked weights of one difference product in bf16, kept once (never cast per step): yd = dx [R, T, k]
    bf16 @ w.T -> [R, T, o] bf16; on CPUs with oneDNN's bf16 kernels the weight is also kept in its packed layout
    (mkldnn_packed), made once here."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.to(DIFF_DTYPE)
        self.packed = mkldnn_packed(self.w)

    def linear(self, dx: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and dx.dtype == DIFF_DTYPE and dx.device.type == "cpu":
            return packed_linear(dx, self.packed)
        return F.linear(dx, self.w)


class Fp8Weight:
    """The stacked weights in FP8 e4m3 with a scale per output row; the differences are quantised the same way
    per token row. On CUDA with FP8 tensor cores (sm_89+) the product is torch._scaled_mm; elsewhere it is
    emulated: the quantised values dequantised and multiplied in float32 (the same rounding of the inputs, an
    exact product), for measuring what FP8 does to the ascent on a machine without FP8 hardware."""

    def __init__(self, w: torch.Tensor) -> None:
        self.q, self.scale = fp8_rows(w)  # [o, k], [o, 1]
        self._deq = None

    def linear(self, dx: torch.Tensor) -> torch.Tensor:
        qx, sx = fp8_rows(dx)
        k, o = dx.shape[-1], self.q.shape[0]
        if dx.is_cuda and torch.cuda.get_device_capability(dx.device) >= (8, 9):
            y = torch._scaled_mm(qx.reshape(-1, k), self.q.t(), scale_a=sx.reshape(-1, 1),
                                 scale_b=self.scale.view(1, -1), out_dtype=DIFF_DTYPE)
            return y.view(*dx.shape[:-1], o)
        if self._deq is None:
            self._deq = self.q.float() * self.scale
        return F.linear(qx.float() * sx, self._deq).to(DIFF_DTYPE)


def product(x0: torch.Tensor, dx: torch.Tensor, ws, bs, low) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 x0 [1, T, k] times each weight ws[j] [o_j, k] (+ bs[j]) in float32, concatenated: y0 [1, T, o];
    the differences dx [R, T, k] bf16 times low (a Bf16Weight or Fp8Weight of the stacked ws): yd [R, T, o] bf16."""
    y0 = F.linear(x0, ws[0], bs[0]) if len(ws) == 1 else torch.cat([F.linear(x0, w, b) for w, b in zip(ws, bs)], -1)
    return y0, low.linear(dx)


def linear(ops, x: torch.Tensor, ws, bs, low) -> torch.Tensor:
    """x [B, T, k] float32 (rows 1.. near row 0) times the stacked weights ws (biases bs; low = their Bf16Weight
    or Fp8Weight) -> [B, T, sum o_j] float32: row 0's float32 product, the others' through their differences.
    ops: the DecoderOps object whose epilogues run."""
    return ops.add_rows(*product(x[:1], ops.diff_rows(x), ws, bs, low))


__all__ = ["DIFF_DTYPE", "FP8", "fp8_rows", "mkldnn_packed", "packed_linear", "Bf16Weight", "Fp8Weight", "product",
           "linear", "diff_rows_reference", "add_rows_reference", "gated_diff_reference"]
