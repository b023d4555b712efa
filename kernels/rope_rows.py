"""The difference form's q / k / v epilogue (DecoderOps.rope_rows): per-head norms and rotary, one launch.

    rope_rows(qkv [R, (H + 2 Hk) hd] bf16, bias [(H + 2 Hk) hd] or None, rows, cos, sin [n, hd] f32, q_norm [hd] or
              None, k_norm, eps, gemma, H, Hk, k_out, v_out [R, Hk, hd] f32, qkv_ref [V, (H + 2 Hk) hd] f32 or None)
        -> q [R, H, hd] f32
    f = the float32 rows of qkv plus the bias: a value row qkv_ref[v] + qkv (qkv without qkv_ref), a difference row
        its anchor's so rebuilt plus its own change
    q, k, v = f split by heads; q, k per-head RMS-normed (Qwen3, Gemma 3: q_norm / k_norm given); then rotated at each
    row's position (lead rows 0 .., batch rows pos0 + t): x cos + rotate_half(x) sin with the tables' row there;
    k, v written into k_out / v_out (contiguous), q returned (a fresh contiguous tensor)

qkv_ref: the value rows' float32 reference of the qkv product's output (v: a value row's reference row,
kernels/_rows.py). Every output is a float32 row (no difference form out), so a difference row needs only its
anchor's *input* row (and its anchor's reference row), read from memory. float32 arithmetic throughout. Reference:
sicl_fast.models.rows.rope_rows_reference.

GPU design. Memory-bound: one read of qkv and of qkv_ref (plus the anchor rows and their reference rows, L1 / L2 hits:
rows walked position-major, kernels/_rows.py), one write of q, k, v in float32. A program takes BLOCK_R rows and
every q and k head of each as [BLOCK_R, heads, hd] tiles (the per-head norm is a reduction over the tile's last axis,
in registers); rotate_half's partner element is a second, shifted load of the same (cached) rows instead of a
register shuffle. One row a program on a GPU when the row is wide (SmolLM2: (9 + 6) x 64 = 960 elements, 4 warps),
many under the interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._rows import check_low, check_ref, check_rows, layout_rows, row_values, rows_block, value_slots
from ._utils import check_device, check_dtype, launch, launch_config, next_pow2


@triton.jit
def _rope_part(qkv_ptr, bias_ptr, ref_ptr, own, anc, ref_off, diff, rmask, pos, col0, n_heads, w_ptr, cos_ptr,
               sin_ptr, out_ptr, out_row, hd, eps, HAS_BIAS: tl.constexpr, HAS_REF: tl.constexpr,
               HAS_NORM: tl.constexpr, ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The n_heads heads at column col0 of the rows (own / anc / ref_off: [BR, 1, 1] element offsets of each row
    and its anchor's row in qkv, and of its anchor's reference row in qkv_ref) -> float32, normed (HAS_NORM) and
    rotated (ROTATE) at positions pos [BR, 1, 1], stored at out_ptr + out_row [BR, 1, 1] + head * hd + i."""
    h = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_D)[None, None, :]
    m = rmask & (h < n_heads) & (i < hd)
    c = col0 + h * hd + i
    x = row_values(qkv_ptr, own, anc, diff, c, m, bias_ptr, ref_ptr, ref_off, HAS_BIAS, HAS_REF)
    if ROTATE:
        half = hd // 2
        j = tl.where(i < half, i + half, i - half)  # rotate_half's source of element i
        cj = col0 + h * hd + j
        xr = row_values(qkv_ptr, own, anc, diff, cj, m, bias_ptr, ref_ptr, ref_off, HAS_BIAS, HAS_REF)
        if HAS_NORM:
            r = tl.math.rsqrt(tl.sum(x * x, axis=2) / hd + eps)[:, :, None]  # one statistic per head, both loads
            x = x * r * tl.load(w_ptr + i, mask=i < hd, other=0.0).to(tl.float32)
            xr = xr * r * tl.load(w_ptr + j, mask=i < hd, other=0.0).to(tl.float32)
        xr = tl.where(i < half, -xr, xr)
        cm = rmask & (i < hd)
        cs = pos.to(tl.int64) * hd + i
        cosv = tl.load(cos_ptr + cs, mask=cm, other=0.0)
        sinv = tl.load(sin_ptr + cs, mask=cm, other=0.0)
        x = x * cosv + xr * sinv
    tl.store(out_ptr + out_row + h * hd + i, x, mask=m)


@triton.jit
def _rope_rows_kernel(qkv_ptr, bias_ptr, anchor_ptr, slot_ptr, ref_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr,
                      k_ptr, v_ptr, R, lead, B, T, pos0, H, Hk, hd, s_ref, eps,
                      HAS_BIAS: tl.constexpr, HAS_REF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    q = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row, arow, vrow, pos, valid = layout_rows(q, R, lead, B, T, pos0, anchor_ptr, slot_ptr, HAS_REF)
    width = (H + 2 * Hk) * hd
    own = (row * width)[:, None, None]
    anc = (arow * width)[:, None, None]
    ref_off = (vrow * s_ref)[:, None, None]
    diff = (row != arow)[:, None, None]
    rmask = valid[:, None, None]
    pos = pos[:, None, None]
    r3 = row[:, None, None]
    _rope_part(qkv_ptr, bias_ptr, ref_ptr, own, anc, ref_off, diff, rmask, pos, 0, H, qn_ptr, cos_ptr, sin_ptr,
               q_ptr, r3 * (H * hd), hd, eps, HAS_BIAS, HAS_REF, HAS_NORM, True, BLOCK_H, BLOCK_D)
    _rope_part(qkv_ptr, bias_ptr, ref_ptr, own, anc, ref_off, diff, rmask, pos, H * hd, Hk, kn_ptr, cos_ptr, sin_ptr,
               k_ptr, r3 * (Hk * hd), hd, eps, HAS_BIAS, HAS_REF, HAS_NORM, True, BLOCK_HK, BLOCK_D)
    _rope_part(qkv_ptr, bias_ptr, ref_ptr, own, anc, ref_off, diff, rmask, pos, (H + Hk) * hd, Hk, kn_ptr, cos_ptr,
               sin_ptr, v_ptr, r3 * (Hk * hd), hd, eps, HAS_BIAS, HAS_REF, False, False, BLOCK_HK, BLOCK_D)


def rope_rows(qkv: torch.Tensor, bias, rows, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, eps: float,
              gemma: bool, H: int, Hk: int, k_out: torch.Tensor, v_out: torch.Tensor,
              qkv_ref: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, H, hd] float32; k_out / v_out written (module docstring). One launch. gemma: the norms' weights are
    already Gemma's 1 + w (the float32 arithmetic is the same either way); qkv_ref: the value rows' float32
    reference of qkv ([V, (H + 2 Hk) hd], or None)."""
    op = "triton rope_rows"
    del gemma
    qkv = check_low(qkv, None, "qkv", op)
    R, width = qkv.shape
    if width % (H + 2 * Hk):
        raise SiclError(f"{op}: qkv has {width} columns, not a multiple of H + 2 Hk = {H + 2 * Hk}")
    hd = width // (H + 2 * Hk)
    dev = check_device(*(t for t in (qkv, bias, cos, sin, q_norm, k_norm, k_out, v_out) if t is not None), op=op)
    anchor = check_rows(rows, R, dev, op)
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        check_dtype(t, torch.float32, name, op)
        if tuple(t.shape) != (R, Hk, hd) or not t.is_contiguous():
            raise SiclError(f"{op}: {name} must be a contiguous [{R}, {Hk}, {hd}] tensor, got {list(t.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise SiclError(f"{op}: q_norm and k_norm come together")
    if bias is not None and tuple(bias.shape) != (width,):
        raise SiclError(f"{op}: bias must have shape [{width}], got {list(bias.shape)}")
    n = max(rows.lead, rows.pos0 + rows.T)
    if cos.shape[0] < n or sin.shape[0] < n:
        raise SiclError(f"{op}: the rotary tables have {cos.shape[0]} positions, the rows reach {n}")
    qkv_ref, s_ref = check_ref(qkv_ref, rows, width, dev, "qkv_ref", op)
    cos = cos.reshape(cos.shape[0], hd).float().contiguous()
    sin = sin.reshape(sin.shape[0], hd).float().contiguous()
    qkv = qkv.contiguous()
    q = torch.empty(R, H, hd, dtype=torch.float32, device=dev)
    if R == 0:
        return q
    cfg = rope_rows_config(R, H, Hk, hd)
    launch(_rope_rows_kernel, (triton.cdiv(R, cfg["BLOCK_R"]),), qkv, bias if bias is not None else cos, anchor,
           value_slots(rows, dev, op), qkv_ref if qkv_ref is not None else cos, cos, sin,
           q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos, q, k_out, v_out, R,
           rows.lead, max(rows.B, 1), max(rows.T, 1), rows.pos0, H, Hk, hd, s_ref, float(eps), device=dev,
           HAS_BIAS=bias is not None, HAS_REF=qkv_ref is not None, HAS_NORM=q_norm is not None, **cfg)
    return q


def rope_rows_config(R: int, H: int, Hk: int, hd: int, interp: bool | None = None) -> dict:
    """BLOCK_R (rows a program), BLOCK_H / BLOCK_HK / BLOCK_D (the heads' tiles) and num_warps of a launch over R
    rows of H + 2 Hk heads of hd (_utils.launch_config): about 1024 elements of a row's q and k heads a program on a
    GPU (one row of every model we run), many rows under the interpreter."""
    BH, BHK, BD = next_pow2(H), next_pow2(Hk), next_pow2(hd)
    per_row = (BH + 2 * BHK) * BD
    BR = rows_block(R, per_row, False, budget=1024)
    return launch_config("triton rope_rows", interp, block=BR * BH * BD, interpreter={"BLOCK_R": min(next_pow2(R), 64)},
                         BLOCK_R=BR, BLOCK_H=BH, BLOCK_HK=BHK, BLOCK_D=BD)
