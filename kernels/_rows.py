"""Device and host helpers of the difference form's row layout (sicl_fast.models.rows.RowLayout), shared by the row
kernels (norm_rows.py, rope_rows.py, gated_rows.py, attention.py's attention_rows, span_logprobs.py's rows head).

A pass has R = lead + B * T rows: lead rows 0 .. lead-1 (values, at positions 0 ..), then B batch rows of T tokens
(batch row j, token t at row lead + j * T + t, position pos0 + t), batch row j a difference from batch row
anchor[j] (int64 [B] on the device; anchor[j] == j: a value row).

The elementwise row kernels walk the rows in *position-major* order: program slot q < lead is lead row q; slot
lead + t * B + j is batch row j's token t. The B rows of one position, which read one anchor row, then sit in one
program's tile or in neighbouring programs, so the anchor row is read from L1 / L2 while it is hot instead of once
per batch row from HBM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._utils import check_device, check_dtype, check_shape


@triton.jit
def layout_rows(q, R, lead, B, T, pos0, anchor_ptr):
    """The rows of slots q (int tensor, position-major order; slots >= R masked): (row, its anchor's row, its
    position, valid). A lead row and a value row are their own anchor (row == anchor row)."""
    valid = q < R
    qb = tl.maximum(q - lead, 0)
    t = qb // B
    j = qb % B
    aj = tl.load(anchor_ptr + j, mask=valid & (q >= lead), other=0).to(tl.int32)
    is_lead = q < lead
    row = tl.where(is_lead, q, lead + j * T + t)
    arow = tl.where(is_lead, q, lead + aj * T + t)
    pos = tl.where(is_lead, q, pos0 + t)
    row = tl.where(valid, row, 0)
    arow = tl.where(valid, arow, 0)
    return row.to(tl.int64), arow.to(tl.int64), pos, valid


@triton.jit
def value_of(ptr, off, offs, mask, bias_ptr, boffs, HAS_BIAS: tl.constexpr):
    """A value row of a difference-form tensor as float32, plus the bias: y + b."""
    y = tl.load(ptr + off + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + boffs, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def row_values(ptr, own, anc, diff, offs, mask, bias_ptr, boffs, HAS_BIAS: tl.constexpr):
    """The float32 rows of a difference-form tensor: at ptr + own + offs (low dtype), plus the anchor's row
    (ptr + anc + offs) where diff, plus the bias (bias_ptr + boffs) where HAS_BIAS: (y_j + y_a) + b, the reference's
    order (sicl_fast.models.rows.from_rows, then the bias)."""
    y = tl.load(ptr + own + offs, mask=mask, other=0.0).to(tl.float32)
    ya = tl.load(ptr + anc + offs, mask=mask & diff, other=0.0).to(tl.float32)
    y = tl.where(diff, y + ya, y)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + boffs, mask=mask, other=0.0).to(tl.float32)
    return y


_ONE: dict = {}


def check_rows(rows, R: int, device: torch.device, op: str) -> torch.Tensor:
    """The layout's anchor tensor (int64 [B] on the device; no host read of it), checked against a pass of R rows
    on `device`; a cached one-element tensor when the pass has no batch rows (an empty tensor has no address)."""
    if rows.R != R:
        raise SiclError(f"{op}: the row layout has {rows.R} rows (lead {rows.lead} + {rows.B} x {rows.T}), the "
                        f"tensors {R}")
    if rows.B == 0:
        one = _ONE.get(str(device))
        if one is None:
            one = _ONE[str(device)] = torch.zeros(1, dtype=torch.int64, device=device)
        return one
    anchor = rows.anchor
    if anchor.device != device:
        raise SiclError(f"{op}: the layout's anchors are on {anchor.device}, the tensors on {device}")
    return anchor


def check_low(t: torch.Tensor, k: int | None, name: str, op: str) -> torch.Tensor:
    """A [R, k] bf16 difference-form tensor with unit column stride (a contiguous copy otherwise)."""
    check_shape(t, (None, k), name, op)
    check_dtype(t, torch.bfloat16, name, op)
    return t if t.stride(1) == 1 else t.contiguous()


def rows_block(R: int, block: int, interp: bool) -> int:
    """Rows a program of an elementwise row kernel takes: about 2048 elements on a GPU (one row of a wide model,
    several of a narrow one), far more under the interpreter, which pays per program."""
    budget = 1 << 16 if interp else 2048
    return max(1, min(triton.next_power_of_2(max(1, R)), budget // block, 64 if interp else 16))


__all__ = ["layout_rows", "value_of", "row_values", "check_rows", "check_low", "rows_block", "check_device"]
