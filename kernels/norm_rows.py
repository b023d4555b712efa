"""The difference form's residual + RMSNorm epilogue (DecoderOps.norm_rows), one launch.

    norm_rows(x [R, d] f32, y [R, d] bf16 or None, bias [d] or None, post_w [d] or None, w [d], eps, gemma, rows,
              y_ref [V, d] f32 or None, h_ref [V, d] f32 or None) -> (x' [R, d] f32, h [R, d] bf16)
    y' = the float32 rows of y plus the bias: a value row y_ref[v] + y (y without y_ref), a difference row its
         anchor's so rebuilt plus its own change
    x' = x + (rms_norm(y', post_w) if post_w is not None else y')        (x itself when y is None)
    h  = rms_norm(x', w) in difference form: bf16(n - h_ref[v]) on value rows (bf16(n) without h_ref),
         bf16(n_j - n_anchor(j)) on difference rows

rows: the pass's RowLayout (sicl_fast.models.rows; its anchors and value slots read on the device; v: a value row's
reference row, kernels/_rows.py). y_ref: the value rows' float32 reference of the product that made y (its output),
h_ref: of the product h goes into (its input). The weights and the bias in any float dtype (used as float32; Gemma's
1 + w is float32); every intermediate float32; bf16 rounded to nearest even (kernels._math.to_bf16, so the
interpreter's truncating cast does not decide a bit). Reference: sicl_fast.models.rows.norm_rows_reference.

GPU design. Memory-bound (a few FLOPs per byte): one pass over x and y, writing x' and h. A difference row's h
needs its anchor's normed row, which another program produces: rather than a second launch or a grid-wide
dependency, each program recomputes its rows' anchors (reads the anchor's x, y and y_ref row, adds and norms them
again: registers only, no store). The rows are walked position-major (kernels/_rows.py), so the B rows that read one
anchor row are neighbouring slots: the anchor's second read hits L1 / L2, HBM traffic stays one read of each row,
and of each reference row (y_ref's read by the B rows of its position, h_ref's by its value row alone: a masked
load, no traffic for the difference rows); the reference rows are row-contiguous loads like the others. A program
takes BLOCK_R rows x the whole row (BLOCK = next_pow2(d), the row statistics in registers): one row of a wide model
(d 4096: 8 warps) or several of a narrow one (d 576: 2 rows, about 2048 elements a program); many rows under the
interpreter, which pays per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._rows import check_low, check_ref, check_rows, layout_rows, rows_and_anchors, rows_block, to_form, value_slots
from ._utils import check_device, check_dtype, check_shape, launch, launch_config, next_pow2


@triton.jit
def _rms(x, w, mask, d, eps):
    """rms_norm of float32 rows x [BR, BLOCK] with the float32 weight w [1, BLOCK] (zero outside the row)."""
    x = tl.where(mask, x, 0.0)
    ms = tl.sum(x * x, axis=1) / d
    return x * tl.math.rsqrt(ms + eps)[:, None] * w


@triton.jit
def _norm_rows_kernel(x_ptr, y_ptr, bias_ptr, post_w_ptr, w_ptr, anchor_ptr, slot_ptr, y_ref_ptr, h_ref_ptr,
                      x_out_ptr, h_ptr, R, lead, B, T, d, s_yref, s_href, eps,
                      HAS_Y: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POST: tl.constexpr, Y_REF: tl.constexpr,
                      H_REF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    q = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row, arow, vrow, _, valid = layout_rows(q, R, lead, B, T, 0, anchor_ptr, slot_ptr, Y_REF or H_REF)
    diff = (row != arow)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    cm = cols < d
    mask = valid[:, None] & cm
    own = row[:, None] * d
    anc = arow[:, None] * d
    x = tl.load(x_ptr + own + cols, mask=mask, other=0.0)
    xa = tl.load(x_ptr + anc + cols, mask=mask & diff, other=0.0)  # the anchor's x (difference rows only)
    if HAS_Y:
        # the rows and their anchors' (a value row, rebuilt from its reference row where Y_REF)
        y, ya = rows_and_anchors(y_ptr, own, anc, diff, cols, mask, bias_ptr, y_ref_ptr, vrow[:, None] * s_yref,
                                 HAS_BIAS, Y_REF)
        if HAS_POST:
            pw = tl.load(post_w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            y = _rms(y, pw, mask, d, eps)
            ya = _rms(ya, pw, mask, d, eps)
        x = x + y
        xa = xa + ya
        tl.store(x_out_ptr + own + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    n = _rms(x, w, mask, d, eps)
    na = _rms(xa, w, mask, d, eps)
    h = to_form(n, na, diff, mask, h_ref_ptr, vrow[:, None] * s_href + cols, H_REF)
    tl.store(h_ptr + own + cols, h, mask=mask)


def norm_rows(x: torch.Tensor, y: torch.Tensor | None, bias, post_w, w: torch.Tensor, eps: float, gemma: bool,
              rows, y_ref: torch.Tensor | None = None, h_ref: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h) as the module docstring says (gemma: the weights are already Gemma's 1 + w; the float32 arithmetic is
    the same either way); y_ref / h_ref: the value rows' references of y and of h ([V, d] float32, or None; y_ref
    unread without y). One launch."""
    op = "triton norm_rows"
    del gemma  # float32 rows: (x * r) * w either way (the reference's two forms agree in float32)
    check_shape(x, (None, None), "x", op)
    check_dtype(x, torch.float32, "x", op)
    R, d = x.shape
    x = x.contiguous()
    dev = check_device(*(t for t in (x, y, bias, post_w, w) if t is not None), op=op)
    anchor = check_rows(rows, R, dev, op)
    if y is not None:
        y = check_low(y, d, "y", op).contiguous()
        check_shape(y, (R, d), "y", op)
    else:
        y_ref = None
    for name, t in (("w", w), ("post_w", post_w), ("bias", bias)):
        if t is not None and tuple(t.shape) != (d,):
            raise SiclError(f"{op}: {name} must have shape [{d}], got {list(t.shape)}")
    y_ref, s_yref = check_ref(y_ref, rows, d, dev, "y_ref", op)
    h_ref, s_href = check_ref(h_ref, rows, d, dev, "h_ref", op)
    h = torch.empty(R, d, dtype=torch.bfloat16, device=dev)
    x_out = torch.empty_like(x) if y is not None else x
    if R == 0:
        return x_out, h
    cfg = norm_rows_config(R, d)
    launch(_norm_rows_kernel, (triton.cdiv(R, cfg["BLOCK_R"]),), x, y if y is not None else x,
           bias if bias is not None else w, post_w if post_w is not None else w, w, anchor, value_slots(rows, dev, op),
           y_ref if y_ref is not None else x, h_ref if h_ref is not None else x, x_out, h, R, rows.lead,
           max(rows.B, 1), max(rows.T, 1), d, s_yref, s_href, float(eps), device=dev, HAS_Y=y is not None,
           HAS_BIAS=bias is not None, HAS_POST=post_w is not None, Y_REF=y_ref is not None, H_REF=h_ref is not None,
           **cfg)
    return x_out, h


def norm_rows_config(R: int, d: int, interp: bool | None = None) -> dict:
    """BLOCK (the whole row), BLOCK_R (rows a program: _rows.rows_block) and num_warps of a launch over R rows of d
    (_utils.launch_config)."""
    BLOCK = next_pow2(d)
    BR = rows_block(R, BLOCK, False)
    return launch_config("triton norm_rows", interp, block=BR * BLOCK,
                         interpreter={"BLOCK_R": rows_block(R, BLOCK, True)}, BLOCK_R=BR, BLOCK=BLOCK)
