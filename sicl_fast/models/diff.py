"""Difference products: a perturbation batch's projections with row 0 in float32 and the other rows' differences
from it in bf16.

In the ascent's batch row 0 is X and rows 1.. are X + mu U_i, so at every projection the input rows 1.. are row
0's plus a small difference. With a float32 model the fast backend can then

    y_0 = x_0 W^T + b                              (float32: row 0 is exact)
    y_i = y_0 + bf16(x_i - x_0) bf16(W)^T          (a bf16 product, 4x the float32 rate on AVX512-BF16 / AMX
                                                    CPUs and on tensor cores, added to y_0 in float32)

Equal to x_i W^T + b in exact arithmetic; the bf16 rounding (about 2^-8 relative) applies to the difference term
only, never to the value. Norms, rotary, attention and the activations stay float32 on every row.

The functions here are the torch reference of each step; `diff_rows`, `add_rows` and `gated_diff` go to the C++
extension (csrc/diff.cpp, one pass, multithreaded) for CPU tensors when it is built, and are tested against the
reference. Tensors are contiguous; float32 and bf16.

    diff_rows(x [B, T, k] f32)                       -> dx [B-1, T, k] bf16:  bf16(x_i - x_0)
    product(x0 [1, T, k] f32, dx, ws, bs, low)       -> y0 [1, T, o] f32, yd [B-1, T, o] bf16
    add_rows(y0, yd)                                 -> y [B, T, o] f32:  y_0, y_0 + yd_i
    linear(x [B, T, k] f32, ws, bs, low)             -> y [B, T, o] f32:  the three above in a row
    gated_diff(y0 [1, T, 2I], yd [B-1, T, 2I], act)  -> a0 [1, T, I] f32, da [B-1, T, I] bf16
                                                        a = act(gate) * up on rows y0 and y0 + yd_i
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpp_ops
from ..fused import cpp_available

DIFF_DTYPE = torch.bfloat16
CPP_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


def _use_cpp(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and cpp_available()


def _bits(t: torch.Tensor):
    """A bf16 tensor's bits as an int16 numpy view (no copy)."""
    return t.view(torch.int16).numpy()


def diff_rows_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.sub(x[1:], x[:1]).to(DIFF_DTYPE)


def diff_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, k] float32 -> [B-1, T, k] bf16: each row's difference from row 0, rounded to bf16."""
    if not _use_cpp(x):
        return diff_rows_reference(x)
    x = x.contiguous()
    B = x.shape[0]
    out = torch.empty((B - 1,) + tuple(x.shape[1:]), dtype=DIFF_DTYPE)
    cpp_ops._ext().diff_rows(x.view(B, -1).numpy(), _bits(out.view(B - 1, -1)))
    return out


def add_rows_reference(y0: torch.Tensor, yd: torch.Tensor) -> torch.Tensor:
    return torch.cat([y0, y0 + yd.float()])


def add_rows(y0: torch.Tensor, yd: torch.Tensor) -> torch.Tensor:
    """y0 [1, T, o] float32, yd [R, T, o] bf16 -> [R+1, T, o] float32: y0, then y0 + yd_i."""
    if not _use_cpp(y0):
        return add_rows_reference(y0, yd)
    R = yd.shape[0]
    out = torch.empty((R + 1,) + tuple(y0.shape[1:]), dtype=torch.float32)
    cpp_ops._ext().add_rows(y0.contiguous().view(-1).numpy(), _bits(yd.contiguous().view(R, -1)),
                           out.view(R + 1, -1).numpy())
    return out


def gated_diff_reference(y0: torch.Tensor, yd: torch.Tensor, act) -> tuple[torch.Tensor, torch.Tensor]:
    g0, u0 = y0.chunk(2, dim=-1)
    a0 = act(g0) * u0
    g, u = (y0 + yd.float()).chunk(2, dim=-1)
    return a0, (act(g) * u - a0).to(DIFF_DTYPE)


def gated_diff(y0: torch.Tensor, yd: torch.Tensor, act, act_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated MLP activations from (gate | up) products: y0 [1, T, 2I] float32, yd [R, T, 2I] bf16 ->
    a0 [1, T, I] float32 (= act(g0) * u0) and da [R, T, I] bf16 (= a(y0 + yd_i) - a0). The C++ path has its
    own exp (about 1 ulp from torch's); other activations take the reference."""
    code = CPP_ACTIVATIONS.get(act_name)
    if code is None or not _use_cpp(y0):
        return gated_diff_reference(y0, yd, act)
    _, T, I2 = y0.shape
    R = yd.shape[0]
    a0 = torch.empty(1, T, I2 // 2, dtype=torch.float32)
    da = torch.empty(R, T, I2 // 2, dtype=DIFF_DTYPE)
    cpp_ops._ext().gated_diff(y0.contiguous().view(T, I2).numpy(), _bits(yd.contiguous()), code,
                             a0.view(T, -1).numpy(), _bits(da))
    return a0, da


def product(x0: torch.Tensor, dx: torch.Tensor, ws, bs, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 x0 [1, T, k] times each weight ws[j] [o_j, k] (+ bs[j]) in float32, concatenated: y0 [1, T, o];
    the differences dx [R, T, k] bf16 times low = bf16(stacked ws) [o, k]: yd [R, T, o] bf16."""
    y0 = F.linear(x0, ws[0], bs[0]) if len(ws) == 1 else torch.cat([F.linear(x0, w, b) for w, b in zip(ws, bs)], -1)
    return y0, F.linear(dx, low)


def linear(x: torch.Tensor, ws, bs, low: torch.Tensor) -> torch.Tensor:
    """x [B, T, k] float32 (rows 1.. near row 0) times the stacked weights ws (biases bs; low = their bf16
    stack) -> [B, T, sum o_j] float32: row 0's float32 product, the others' through their bf16 differences."""
    return add_rows(*product(x[:1], diff_rows(x), ws, bs, low))


__all__ = ["DIFF_DTYPE", "diff_rows", "add_rows", "gated_diff", "product", "linear", "diff_rows_reference",
           "add_rows_reference", "gated_diff_reference"]
