"""Device and host helpers of the difference form's row layout (sicl_fast.models.rows.RowLayout), shared by the row
kernels (norm_rows.py, rope_rows.py, gated_rows.py, attention.py's attention_rows, span_logprobs.py's rows head).

A pass has R = lead + B * T rows: lead rows 0 .. lead-1 (values, at positions 0 ..), then B batch rows of T tokens
(batch row j, token t at row lead + j * T + t, position pos0 + t), batch row j a difference from batch row
anchor[j] (int64 [B] on the device; anchor[j] == j: a value row).

The value rows' float32 reference (optional, per tensor): a [V, k] float32 tensor of the value rows alone, V = lead +
(value batch rows) * T: lead row r at reference row r, value batch row j's token t at lead + value_slot[j] * T + t
(value_slot: int64 [B] on the device). A value row's form is then its change from its reference row, and its float32
row that reference row plus the form; a difference row's is unchanged (its anchor's float32 row, so rebuilt, plus its
own change). A reference is read by row (unit column stride, a row stride argument), each value row's once: a
difference row reads its anchor's, the same row its neighbours read (below).

The elementwise row kernels walk the rows in *position-major* order: program slot q < lead is lead row q; slot
lead + t * B + j is batch row j's token t. The B rows of one position, which read one anchor row (and one reference
row), then sit in one program's tile or in neighbouring programs, so the anchor row is read from L1 / L2 while it is
hot instead of once per batch row from HBM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._math import to_bf16
from ._utils import check_device, check_dtype, check_shape


@triton.jit
def layout_rows(q, R, lead, B, T, pos0, anchor_ptr, slot_ptr, HAS_REF: tl.constexpr):
    """The rows of slots q (int tensor, position-major order; slots >= R masked): (row, its anchor's row, its
    anchor's reference row (HAS_REF; else 0), its position, valid). A lead row and a value row are their own anchor
    (row == anchor row), and so read their own reference row."""
    valid = q < R
    qb = tl.maximum(q - lead, 0)
    t = qb // B
    j = qb % B
    batch = valid & (q >= lead)
    aj = tl.load(anchor_ptr + j, mask=batch, other=0).to(tl.int32)
    is_lead = q < lead
    row = tl.where(is_lead, q, lead + j * T + t)
    arow = tl.where(is_lead, q, lead + aj * T + t)
    pos = tl.where(is_lead, q, pos0 + t)
    row = tl.where(valid, row, 0)
    arow = tl.where(valid, arow, 0)
    vrow = row * 0
    if HAS_REF:
        slot = tl.load(slot_ptr + aj, mask=batch, other=0).to(tl.int32)
        vrow = tl.where(is_lead, q, lead + slot * T + t)
        vrow = tl.where(valid, vrow, 0)
    return row.to(tl.int64), arow.to(tl.int64), vrow.to(tl.int64), pos, valid


@triton.jit
def rows_and_anchors(ptr, own, anc, diff, offs, mask, bias_ptr, ref_ptr, ref_off,
                     HAS_BIAS: tl.constexpr, HAS_REF: tl.constexpr):
    """(y, ya): the float32 rows of a difference-form tensor (own / anc: each row's and its anchor's element offset;
    offs: the columns, also the bias's and the reference's) and their anchors' float32 rows (meaningful on difference
    rows). The anchor's value row is its form plus its reference row (ref_ptr + ref_off + offs; HAS_REF) or its form;
    a difference row adds its own change to it; then the bias: (y_j + (y_a + r_a)) + b, the reference's order
    (sicl_fast.models.rows.from_rows, then the bias). A value row (ya's load masked off) is y + r (+ b)."""
    y = tl.load(ptr + own + offs, mask=mask, other=0.0).to(tl.float32)
    ya = tl.load(ptr + anc + offs, mask=mask & diff, other=0.0).to(tl.float32)
    if HAS_REF:
        ya = ya + tl.load(ref_ptr + ref_off + offs, mask=mask, other=0.0)
        y = y + ya
    else:
        y = tl.where(diff, y + ya, y)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y + b
        ya = ya + b
    return y, ya


@triton.jit
def row_values(ptr, own, anc, diff, offs, mask, bias_ptr, ref_ptr, ref_off,
               HAS_BIAS: tl.constexpr, HAS_REF: tl.constexpr):
    """The float32 rows alone (rows_and_anchors' first)."""
    y, _ = rows_and_anchors(ptr, own, anc, diff, offs, mask, bias_ptr, ref_ptr, ref_off, HAS_BIAS, HAS_REF)
    return y


@triton.jit
def to_form(x, xa, diff, mask, ref_ptr, ref_off, HAS_REF: tl.constexpr):
    """The bf16 difference form of float32 rows x (xa: their anchors' rows): x - xa on difference rows; on value rows
    x - r with r the reference row at ref_ptr + ref_off (read on value rows only; HAS_REF), else x. Rounded to
    nearest even (to_bf16)."""
    if HAS_REF:
        r = tl.load(ref_ptr + ref_off, mask=mask & (diff == 0), other=0.0)
        return to_bf16(tl.where(diff, x - xa, x - r))
    else:
        return to_bf16(tl.where(diff, x - xa, x))


_ONE: dict = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONE.get(str(device))
    if one is None:
        one = _ONE[str(device)] = torch.zeros(1, dtype=torch.int64, device=device)
    return one


def check_rows(rows, R: int, device: torch.device, op: str) -> torch.Tensor:
    """The layout's anchor tensor (int64 [B] on the device; no host read of it), checked against a pass of R rows
    on `device`; a cached one-element tensor when the pass has no batch rows (an empty tensor has no address)."""
    if rows.R != R:
        raise SiclError(f"{op}: the row layout has {rows.R} rows (lead {rows.lead} + {rows.B} x {rows.T}), the "
                        f"tensors {R}")
    return _layout_tensor(rows, "anchor", "anchors", device, op)


def value_slots(rows, device: torch.device, op: str) -> torch.Tensor:
    """The layout's value_slot tensor (int64 [B] on the device, never read back), or the cached one-element one."""
    return _layout_tensor(rows, "value_slot", "value slots", device, op)


def _layout_tensor(rows, attr: str, what: str, device: torch.device, op: str) -> torch.Tensor:
    """The layout's per-batch-row tensor `attr` checked to be on `device`; the cached one-element tensor when the
    pass has no batch rows."""
    if rows.B == 0:
        return _one(device)
    t = getattr(rows, attr)
    if t.device != device:
        raise SiclError(f"{op}: the layout's {what} are on {t.device}, the tensors on {device}")
    return t


def check_ref(ref: torch.Tensor | None, rows, k: int, device: torch.device, name: str, op: str):
    """A value-row reference: None, or a float32 [V, k] tensor (V = rows.values, a host count) on `device`, made of
    unit column stride (a contiguous copy otherwise); returned with its row stride: (tensor or None, stride)."""
    if ref is None:
        return None, 0
    check_dtype(ref, torch.float32, name, op)
    check_shape(ref, (rows.values, k), name, op)
    if ref.device != device:
        raise SiclError(f"{op}: {name} is on {ref.device}, the tensors on {device}")
    if ref.stride(1) != 1:
        ref = ref.contiguous()
    return ref, ref.stride(0)


def check_low(t: torch.Tensor, k: int | None, name: str, op: str) -> torch.Tensor:
    """A [R, k] bf16 difference-form tensor with unit column stride (a contiguous copy otherwise)."""
    check_shape(t, (None, k), name, op)
    check_dtype(t, torch.bfloat16, name, op)
    return t if t.stride(1) == 1 else t.contiguous()


def rows_block(R: int, block: int, interp: bool, budget: int = 2048) -> int:
    """Rows a program of an elementwise row kernel takes (a power of two): about `budget` elements on a GPU (one row
    of a wide model, several of a narrow one), far more under the interpreter, which pays per program."""
    budget = 1 << 16 if interp else budget
    return min(triton.next_power_of_2(max(1, R)), _floor_pow2(budget // block), 64 if interp else 16)


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << (max(1, n).bit_length() - 1)


__all__ = ["layout_rows", "rows_and_anchors", "row_values", "to_form", "check_rows", "value_slots", "check_ref",
           "check_low", "rows_block", "check_device"]
