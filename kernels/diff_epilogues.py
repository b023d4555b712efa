"""The epilogues of the difference products (sicl_fast.models.diff), one launch each:

    diff_rows(x [B, T, k] float32) -> [B-1, T, k] bf16                    bf16(x_i - x_0)
    add_rows(y0 [1, T, o] float32, yd [R, T, o] bf16) -> [R+1, T, o] f32   y_0, then y_0 + yd_i
    gated_diff(y0 [1, T, 2I] f32, yd [R, T, 2I] bf16, act_name) -> (a0 [1, T, I] f32, da [R, T, I] bf16)
        a = act(gate) * up on the rows y0 and y0 + yd_i; da_i = bf16(a_i - a0)

Contiguous inputs. The float32 arithmetic is the reference's, op for op, and bf16 rounding is to nearest even
(kernels._math.to_bf16), so diff_rows and add_rows equal the references bit for bit, on a GPU and under the
interpreter; gated_diff's activation is within an ulp of torch's. References: diff.*_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._math import gated_act, to_bf16
from ._utils import launch
from .gated import ACT_CODES

BLOCK = 1024


@triton.jit
def _diff_rows_kernel(x_ptr, out_ptr, n, row, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over the B-1 output rows
    m = offs < n
    x = tl.load(x_ptr + row + offs, mask=m)
    x0 = tl.load(x_ptr + offs % row, mask=m)
    tl.store(out_ptr + offs, to_bf16(x - x0), mask=m)


@triton.jit
def _add_rows_kernel(y0_ptr, yd_ptr, out_ptr, n, row, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over the R+1 output rows
    m = offs < n
    y0 = tl.load(y0_ptr + offs % row, mask=m)
    first = offs < row
    yd = tl.load(yd_ptr + offs - row, mask=m & (first == 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, tl.where(first, y0, y0 + yd), mask=m)


@triton.jit
def _gated_diff_kernel(y0_ptr, yd_ptr, a0_ptr, da_ptr, n, TI, I, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over (R+1) * T * I outputs
    m = offs < n
    r = offs // TI  # 0: a0, else the difference row r - 1
    t = (offs % TI) // I
    i = offs % I
    g0 = tl.load(y0_ptr + t * 2 * I + i, mask=m)
    u0 = tl.load(y0_ptr + t * 2 * I + I + i, mask=m)
    a0 = gated_act(g0, ACT) * u0
    first = r == 0
    dm = m & (first == 0)
    base = (r - 1) * TI * 2 + t * 2 * I + i
    g = g0 + tl.load(yd_ptr + base, mask=dm, other=0.0).to(tl.float32)
    u = u0 + tl.load(yd_ptr + base + I, mask=dm, other=0.0).to(tl.float32)
    tl.store(a0_ptr + offs, a0, mask=m & first)
    tl.store(da_ptr + offs - TI, to_bf16(gated_act(g, ACT) * u - a0), mask=dm)


def diff_rows(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    B = x.shape[0]
    out = torch.empty((B - 1,) + tuple(x.shape[1:]), dtype=torch.bfloat16, device=x.device)
    n, row = out.numel(), x[0].numel()
    if n:
        launch(_diff_rows_kernel, (triton.cdiv(n, BLOCK),), x, out, n, row, device=x.device, block=BLOCK, BLOCK=BLOCK)
    return out


def add_rows(y0: torch.Tensor, yd: torch.Tensor) -> torch.Tensor:
    y0, yd = y0.contiguous(), yd.contiguous()
    out = torch.empty((yd.shape[0] + 1,) + tuple(y0.shape[1:]), dtype=torch.float32, device=y0.device)
    n = out.numel()
    launch(_add_rows_kernel, (triton.cdiv(n, BLOCK),), y0, yd, out, n, y0.numel(), device=y0.device, block=BLOCK,
           BLOCK=BLOCK)
    return out


def gated_diff(y0: torch.Tensor, yd: torch.Tensor, act_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    y0, yd = y0.contiguous(), yd.contiguous()
    R, T, I2 = yd.shape
    I = I2 // 2
    a0 = torch.empty(1, T, I, dtype=torch.float32, device=y0.device)
    da = torch.empty(R, T, I, dtype=torch.bfloat16, device=y0.device)
    n = (R + 1) * T * I
    launch(_gated_diff_kernel, (triton.cdiv(n, BLOCK),), y0, yd, a0, da, n, T * I, I, device=y0.device, block=BLOCK,
           ACT=ACT_CODES[act_name], BLOCK=BLOCK)
    return a0, da
