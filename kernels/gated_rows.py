"""The difference form's gated MLP activation (DecoderOps.gated_rows), one launch.

    gated_rows(y [R, 2I] bf16, bias [2I] or None, act_name, rows, y_ref [V, 2I] f32 or None, a_ref [V, I] f32 or
               None) -> [R, I] bf16
    y' = the float32 rows of y plus the bias: a value row y_ref[v] + y (y without y_ref), a difference row its
         anchor's so rebuilt plus its own change;  gate, up = y'[:, :I], y'[:, I:];  a = act(gate) * up (float32)
    out = a in difference form: bf16(a - a_ref[v]) on value rows (bf16(a) without a_ref), bf16(a_j - a_anchor(j))
          on difference rows

act_name: silu / swish, gelu_pytorch_tanh / gelu_tanh, gelu (kernels.gated.ACT_CODES). rows: the pass's RowLayout
(its anchors and value slots read on the device; v: a value row's reference row, kernels/_rows.py). y_ref: the value
rows' float32 reference of the gate / up product's output, a_ref: of the down product's input. float32 arithmetic,
bf16 rounded to nearest even (kernels._math.to_bf16). Reference: sicl_fast.models.rows.gated_rows_reference (torch's
activations: within a float32 ulp or two).

GPU design. Purely elementwise and memory-bound: a program takes BLOCK_R rows x BLOCK_C columns of the output (grid
over row tiles and column tiles, so a wide MLP (I 14336) still gives many programs with one row each). A difference
row's output needs its anchor's activation, which the program recomputes from the anchor's gate / up values and
their reference rows (loads that hit L1 / L2: the rows are walked position-major, kernels/_rows.py, so the B rows of
one position, which share one anchor row and one reference row, are neighbouring programs). HBM traffic: y and
y_ref read once, a_ref read by the value rows alone (a masked load), the output written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._math import gated_act
from ._rows import check_low, check_ref, check_rows, layout_rows, rows_and_anchors, rows_block, to_form, value_slots
from ._utils import EXACT, check_device, launch, launch_config, next_pow2
from .gated import ACT_CODES


@triton.jit
def _gated_rows_kernel(y_ptr, bias_ptr, anchor_ptr, slot_ptr, y_ref_ptr, a_ref_ptr, out_ptr, R, lead, B, T, I,
                       s_yref, s_aref, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, Y_REF: tl.constexpr,
                       A_REF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    q = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row, arow, vrow, _, valid = layout_rows(q, R, lead, B, T, 0, anchor_ptr, slot_ptr, Y_REF or A_REF)
    diff = (row != arow)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = valid[:, None] & (cols < I)
    own = row[:, None] * (2 * I)
    anc = arow[:, None] * (2 * I)
    yr = vrow[:, None] * s_yref
    g, ga = rows_and_anchors(y_ptr, own, anc, diff, cols, mask, bias_ptr, y_ref_ptr, yr, HAS_BIAS, Y_REF)
    u, ua = rows_and_anchors(y_ptr, own, anc, diff, cols + I, mask, bias_ptr, y_ref_ptr, yr, HAS_BIAS, Y_REF)
    a = gated_act(g, ACT) * u
    aa = gated_act(ga, ACT) * ua  # the anchor's (difference rows: its value row, rebuilt the same way)
    out = to_form(a, aa, diff, mask, a_ref_ptr, vrow[:, None] * s_aref + cols, A_REF)
    tl.store(out_ptr + row[:, None] * I + cols, out, mask=mask)


def gated_rows(y: torch.Tensor, bias, act_name: str, rows, y_ref: torch.Tensor | None = None,
               a_ref: torch.Tensor | None = None) -> torch.Tensor:
    """The difference form of act(gate) * up (module docstring); y_ref [V, 2I] / a_ref [V, I]: the value rows'
    float32 references of y and of the output (or None). One launch."""
    op = "triton gated_rows"
    y = check_low(y, None, "y", op)
    R, I2 = y.shape
    if I2 % 2:
        raise SiclError(f"{op}: y must hold gate | up (an even number of columns), got {I2}")
    if act_name not in ACT_CODES:
        raise SiclError(f"{op}: activation {act_name!r}; one of {sorted(ACT_CODES)}")
    I = I2 // 2
    dev = check_device(*(t for t in (y, bias) if t is not None), op=op)
    anchor = check_rows(rows, R, dev, op)
    if bias is not None and tuple(bias.shape) != (I2,):
        raise SiclError(f"{op}: bias must have shape [{I2}], got {list(bias.shape)}")
    y_ref, s_yref = check_ref(y_ref, rows, I2, dev, "y_ref", op)
    a_ref, s_aref = check_ref(a_ref, rows, I, dev, "a_ref", op)
    y = y.contiguous()
    out = torch.empty(R, I, dtype=torch.bfloat16, device=dev)
    if R == 0 or I == 0:
        return out
    cfg = gated_rows_config(R, I)
    launch(_gated_rows_kernel, (triton.cdiv(R, cfg["BLOCK_R"]), triton.cdiv(I, cfg["BLOCK_C"])), y,
           bias if bias is not None else y, anchor, value_slots(rows, dev, op), y_ref if y_ref is not None else y,
           a_ref if a_ref is not None else y, out, R, rows.lead, max(rows.B, 1), max(rows.T, 1), I, s_yref, s_aref,
           device=dev, ACT=ACT_CODES[act_name], HAS_BIAS=bias is not None, Y_REF=y_ref is not None,
           A_REF=a_ref is not None, **cfg)
    return out


def gated_rows_config(R: int, I: int, interp: bool | None = None) -> dict:
    """BLOCK_C (the column tile), BLOCK_R (rows a program: _rows.rows_block), num_warps and the exact float32
    options of a launch over R rows of I outputs (_utils.launch_config). On a GPU the widest column tile that wastes
    the fewest masked lanes (I 1536: 3 x 512, not 2 x 1024); under the interpreter up to 16384 columns."""
    BC = min(next_pow2(I), min((1024, 512, 256), key=lambda c: triton.cdiv(I, c) * c - I))
    BCi = min(next_pow2(I), 1 << 14)
    BR = rows_block(R, BC, False)
    return launch_config("triton gated_rows", interp, block=BR * BC, BLOCK_R=BR, BLOCK_C=BC, **EXACT,
                         interpreter={"BLOCK_C": BCi, "BLOCK_R": rows_block(R, BCi, True)})
