"""Attention in one launch: of a perturbation batch over a shared prefix (no merge, no copy of the prefix), and of a
difference-form pass (the lead rows and the batch rows together, the output in difference form).

    prefix_attention(q [B, T, H, hd], k, v [B, T, Hk, hd], prefix (kp, vp [1, a, Hk, hd]) or None, pos0,
                     window, scale, softcap, precision='tf32x3') -> o [B, T, H, hd] in q's dtype

Query t of batch row b sits at position pos0 + t. It attends to the prefix keys 0 .. a-1 (a == pos0; one copy,
read by every batch row through a batch stride of 0) and to its own row's keys pos0 .. pos0 + t (causal); with a
window, only to keys at positions > its own - window (transformers' sliding window). Scores are q.k * scale,
then soft-capped (cap * tanh(s / cap)) when softcap is set. Softmax statistics and the output accumulator are
float32 (online softmax, as flash attention); in bf16 the probabilities are rounded to bf16 for the product with
v. GQA: head h reads K/V head h // (H / Hk). The last dimension of every input must be contiguous.
Reference: sicl_fast.models.attention (attend_math over the two key sets, merged by log-sum-exp).

    attention_rows(q [R, H, hd] f32, k, v [R, Hk, hd] f32, rows, prefix (kp, vp [1, a, Hk, hd] f32) or None, scale,
                   softcap, window, o_ref [V, H hd] f32 or None, precision='tf32x3') -> o [R, H hd] bf16

The rows of a difference-form pass (sicl_fast.models.rows.RowLayout: R = lead + B T). The lead rows (positions 0 ..
lead-1) attend causally among themselves; batch row j's query t (position pos0 + t) attends to the prefix (the lead
rows' keys when lead > 0, else the kept prefix `prefix`, keys at positions 0 .. a-1) and causally to its own row's keys;
window and soft-cap as above. Everything float32 (a difference row's output is its anchor's plus a change of about a
bf16 ulp, which one TF32 product's 2^-11 would drown: float32 products, below). Output: on value rows (lead rows, and
batch rows that are their own anchor) bf16(o - o_ref[v]), their change from the value rows' float32 reference (o_ref:
the o product's input reference; v: a value row's reference row, kernels/_rows.py), bf16(o) without o_ref; bf16(o_j -
o_anchor(j)) on difference rows; rounded to nearest even (kernels._math.to_bf16). Reference:
sicl_fast.models.attention.attention_rows_reference.

attention_rows' design (sm_90). The difference o_j - o_a needs the anchor row's output, which is as costly as o_j.
A program takes one (query tile, head) of a *group* of consecutive batch rows and walks them in order, keeping the
current anchor's output tile in registers: a value row computes its tile once, stores it and keeps it; a difference
row computes its own tile and stores the difference; an anchor outside the group is computed first (once per group).
So the anchors' work is repeated once per group, not once per difference row. Groups trade that repeat for
parallelism: one group of all B rows repeats nothing but gives only (T / BLOCK_M) x H programs (SmolLM2, T 256,
BLOCK_M 32, H 9: 72 programs for 132 SMs, each 9 tiles long); one row a group (every program recomputing its anchor)
doubles the work of the B - 1 difference rows. The launcher picks the fewest groups that give about two programs per
SM (SmolLM2 at B 9: 3 groups of 3 rows, 216 programs, 11 tiles of work for 9, against 72 programs or 17 tiles);
under the interpreter, which pays per program, one group. The lead rows' tiles are extra programs of the same grid
(value rows, no anchor). A value row's o_ref tile is read where its tile is stored, row-contiguous like o (a masked
load: a difference row reads nothing; it needs only its anchor's output, held in registers). The tiles (_TILES)
are the largest the sm_90 compile keeps in registers. Worth measuring on an H100 / H200: rows a group
(rows_per_program), the tiles, packing the G = H / Hk query heads of one K/V head into one program's M tile (the K/V
tiles read once for G heads: SmolLM2's G = 3), and tf32x3 against IEEE (bench/attention_estimate.py estimates both
from the sm_90 compile).

float32 products (precision; the run plan's attention_precision). 'tf32x3', the default: tl.dot's
input_precision 'tf32x3', 3 TF32 products on the tensor cores (Triton's F32DotTC pass: a = a_hi + a_lo, a_hi rounded
to tf32, a.b = a_lo b_hi + a_hi b_lo + a_hi b_hi), about 21 of float32's 24 bits, which keep the float32 gain
(bench/precision_fidelity.py, RESULTS 31); 'ieee' (asked for): IEEE float32 FMA on the CUDA cores. Triton's
interpreter multiplies float32 in numpy's float32 whatever input_precision says, so under it the 'tf32x3' products
are emulated explicitly (kernels/_utils: the operands' tf32 pieces as sicl_fast.models.tensor_cores makes them; the
tensor cores' accumulation, which truncates, is the one difference left, modelled in tensor_cores). bf16 / fp16
inputs take the tensor cores' own products whatever precision says.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._math import tanh, to_bf16
from ._rows import check_ref, check_rows, value_slots
from ._utils import check_device, check_dtype, interpreting, launch, launch_config, next_pow2, sm_count

# float32 products: 'tf32x3' on the tensor cores (the default: 3 TF32 products, about 21 of float32's 24 bits), 'ieee'
# (IEEE float32 FMA on the CUDA cores, when asked: the run plan's attention_precision)
PRECISIONS = ("tf32x3", "ieee")
DEFAULT_PRECISION = "tf32x3"


def check_precision(precision: str, op: str) -> str:
    if precision not in PRECISIONS:
        raise SiclError(f"{op}: precision {precision!r} is not one of {PRECISIONS}")
    return precision


@triton.jit
def _attend_block(acc, m_i, l_i, q, q_rows, q_ok, k_base, v_base, stride_kn, stride_vn, n0, n_keys, k_pos0, q_pos,
                  hd, scale, cap, window, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  CHUNK_D: tl.constexpr):
    """One block of keys n0 .. n0 + BLOCK_N (of n_keys, at positions k_pos0 + n) folded into the running
    (acc [BM, BD], m_i [BM], l_i [BM]) of the queries at positions q_pos [BM]; q: the query tile _query_tile
    holds. Every product tl.dot's at PRECISION (module docstring). Where CHUNK_D < BLOCK_D the scores are summed a
    CHUNK_D slice of the head at a time, each query slice read again from q_rows [BM, 1] (pointers to each query's
    head; q_ok [BM, 1] its rows' mask; q unused), so that no whole query tile is held as a tensor-core operand (a
    warp holds its rows' whole operand, and tf32x3 two pieces of it: 256 registers at head 256)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < n_keys) & (offs_d[None, :] < hd)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if CHUNK_D < BLOCK_D:
        s = tl.zeros([acc.shape[0], BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(0, BLOCK_D, CHUNK_D):
            offs_c = c + tl.arange(0, CHUNK_D)
            qc = tl.load(q_rows + offs_c[None, :], mask=q_ok & (offs_c[None, :] < hd), other=0.0)
            kc = tl.load(k_base + offs_n[:, None] * stride_kn + offs_c[None, :],
                         mask=(offs_n[:, None] < n_keys) & (offs_c[None, :] < hd), other=0.0)
            if UPCAST:
                qc, kc = qc.to(tl.float32), kc.to(tl.float32)
            s += tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
        s = s * scale
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        s = cap * tanh(s / cap)
    k_pos = k_pos0 + offs_n
    ok = offs_n[None, :] < n_keys
    if CAUSAL:
        ok = ok & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: keep it at zero
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _query_tile(q_rows, q_mask, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr):
    """The query tile [BM, BD] that _attend_block holds, read from q_rows [BM, 1] (the queries' heads; float32 under
    UPCAST); 0.0 where _attend_block reads the queries a slice at a time (CHUNK_D < BLOCK_D)."""
    if CHUNK_D < BLOCK_D:
        q = 0.0
    else:
        q = tl.load(q_rows + tl.arange(0, BLOCK_D)[None, :], mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
    return q


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, o_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, skp_t, skp_h, svp_t, svp_h, so_b, so_t, so_h,
    T, a, H, G, hd, pos0, scale, cap, window,
    HAS_PREFIX: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    kh = h // G
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < hd)
    q_rows = q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t
    q = _query_tile(q_rows, q_mask, UPCAST, BLOCK_D, CHUNK_D)
    q_pos = pos0 + offs_m
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_PREFIX:  # keys 0 .. a-1: all before every query; with a window, from pos0 + m0 - window + 1 on
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, pos0 + m0 - window + 1) // BLOCK_N * BLOCK_N
        for n0 in range(lo, a, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_rows, offs_m[:, None] < T, kp_ptr + kh * skp_h,
                                          vp_ptr + kh * svp_h, skp_t, svp_t, n0, a, 0, q_pos, hd, scale, cap, window,
                                          HAS_SOFTCAP, HAS_WINDOW, False, UPCAST, PRECISION, BLOCK_N, BLOCK_D,
                                          CHUNK_D)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, m0 - window + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(T, m0 + BLOCK_M)
    for n0 in range(lo, hi, BLOCK_N):  # the row's own keys, causal
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_rows, offs_m[:, None] < T, k_ptr + b * sk_b + kh * sk_h,
                                      v_ptr + b * sv_b + kh * sv_h, sk_t, sv_t, n0, T, pos0, q_pos, hd, scale, cap,
                                      window, HAS_SOFTCAP, HAS_WINDOW, True, UPCAST, PRECISION, BLOCK_N, BLOCK_D,
                                      CHUNK_D)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees its own key; padding rows stay 0
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=q_mask)


def prefix_attention(q, k, v, prefix, pos0: int, window: int | None, scale: float,
                     softcap: float | None, block: int | None = None,
                     precision: str = DEFAULT_PRECISION) -> torch.Tensor:
    """o [B, T, H, hd] (module docstring). One launch. block: the query and key tile (default _TILES' by dtype,
    precision and head size; the tests use 16 to cover the multi-block paths); precision: a float32 q's products
    (PRECISIONS; bf16 / fp16 products are the tensor cores' own)."""
    precision = check_precision(precision, "triton prefix_attention") if q.dtype == torch.float32 else "ieee"
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if prefix is not None:
        prefix = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in prefix)
    B, T, H, hd = q.shape
    Hk = k.shape[2]
    o = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    kp, vp = prefix if prefix is not None else (k, v)
    a = kp.shape[1] if prefix is not None else 0
    cfg = prefix_attention_config(hd, q.dtype, block, precision=precision)
    launch(
        _prefix_attention_kernel, (triton.cdiv(T, cfg["BLOCK_M"]), B * H),
        q, k, v, kp, vp, o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kp.stride(1), kp.stride(2), vp.stride(1), vp.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, a, H, H // Hk, hd, pos0, float(scale), float(softcap or 1.0), int(window or 0),
        HAS_PREFIX=prefix is not None and a > 0, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        UPCAST=interpreting() and q.dtype != torch.float32, PRECISION=precision, device=q.device, **cfg,
    )
    return o


# The attention kernels' tiles by kernel ('prefix': prefix_attention, 'rows': attention_rows), precision and head
# size (BLOCK_D): (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg, CHUNK_D), the largest that the sm_90 compile as
# the JIT specialises real shapes (tests/test_sm90_configs.py; bench/gpu_kernels.py --compile-only) keeps without a
# register spill and within an A100's 166,912 B of shared memory (an H100's 232,448):
# - float32 at tf32x3 (the default; tensor cores): a tensor-core operand is held whole by each warp that reads it,
#   so the query tile (both tf32 pieces) costs BLOCK_M x head / 32 registers a piece: held at head 64 (CHUNK_D 64:
#   64 x 32 tiles on one warp group, wgmma, 197 / 249 registers), read again a slice of the head at a time from 128
#   on (CHUNK_D 32 / 16 / 64). prefix_attention keeps 64 x 16 on 4 warps (wgmma, 244 registers) at 128 and 16 x 16
#   on 8 warps (mma.sync, 180) at 256 (32 x 16 kept 255 with every flag on and spilled 8 B for Gemma 3's flags);
#   attention_rows, which also holds its anchor's output tile, 16 x 32 on 8 warps at both (mma.sync; 183 and 255
#   registers, every family's flag sets). Measured 2026-11-28 (RESULTS 31), num_stages 1.
# - float32 at ieee (asked for: IEEE products on the CUDA cores, both kernels): the operand layouts take many
#   registers; 64 x 64 tiles on 4 warps spill 6 KB at head 64, and Triton's default 3 stages need 344,320 B of shared
#   memory at head 256 (what prefix_attention launched before); 32 x 32 tiles spill at head 128 (16 / 48 B). Left to
#   itself ptxas also spills 8 - 32 B at 80 - 128 registers for some flag sets (attention_rows at head 64 without
#   soft-cap or window; prefix_attention at 128 and 256), so maxnreg lets it keep more: 128 (2 blocks of 8 warps an
#   SM), 168 at 256.
# - bf16 / fp16 (tensor cores, prefix_attention): 64 x 64 on 4 warps keeps 167 registers at head 64 and spills at 128
#   (40 B unspecialised) and 256 (1,480 B); 8 warps from head 128, and 64 x 32 with 3 stages at 256 (131,072 B).
# Untimed on a GPU: bench/gpu_kernels.py times them. CHUNK_D None: the whole head.
_IEEE = {64: (32, 64, 8, 1, 128, None), 128: (32, 16, 8, 1, 128, None), 256: (32, 16, 8, 1, 168, None)}
_TILES = {
    ("prefix", "tf32x3"): {64: (64, 32, 4, 1, None, 64), 128: (64, 16, 4, 1, None, 32),
                           256: (16, 16, 8, 1, None, 64)},
    ("rows", "tf32x3"): {64: (64, 32, 4, 1, None, 64), 128: (16, 32, 8, 1, None, 32), 256: (16, 32, 8, 1, None, 16)},
    ("prefix", "ieee"): _IEEE,
    ("rows", "ieee"): _IEEE,
    ("prefix", "low"): {64: (64, 64, 4, 3, None, None), 128: (64, 64, 8, 3, None, None),
                        256: (64, 32, 8, 3, None, None)},
}


def attention_tiles(hd: int, dtype, op: str, interp: bool | None = None, block: int | None = None,
                    precision: str = DEFAULT_PRECISION) -> dict:
    """BLOCK_M / BLOCK_N / BLOCK_D / CHUNK_D, num_warps and num_stages of an attention kernel over heads of hd in
    dtype, a float32 one's products at `precision` (_TILES; _utils.launch_config); block: the query and key tile
    instead, and the head's slice of the scores (the tests use 16 for the multi-block and multi-slice paths). Heads
    above 256 have no compiled tiles: SiclError (the attention check then takes the math path). Under the
    interpreter, 64 x 64 tiles and the whole head at once (fewer programs and operations)."""
    BD = max(16, next_pow2(hd))
    if BD > 256:
        raise SiclError(f"{op}: no tile configuration for heads of {hd} (at most 256); use attention 'math'")
    kernel = "rows" if op.endswith("attention_rows") else "prefix"
    BM, BN, warps, stages, maxnreg, chunk = _TILES[kernel, check_precision(precision, op) if dtype == torch.float32
                                                   else "low"][max(BD, 64)]
    interpreter = {"BLOCK_M": 64, "BLOCK_N": 64, "CHUNK_D": BD}
    if block:
        BM = BN = chunk = block
        interpreter = None
    return launch_config(op, interp, num_warps=warps, num_stages=stages, interpreter=interpreter, BLOCK_M=BM,
                         BLOCK_N=BN, BLOCK_D=BD, CHUNK_D=min(chunk or BD, BD),
                         **({"maxnreg": maxnreg} if maxnreg else {}))


def prefix_attention_config(hd: int, dtype, block: int | None = None, interp: bool | None = None,
                            precision: str = DEFAULT_PRECISION) -> dict:
    """prefix_attention's launch configuration for heads of hd in q's dtype (a float32 q's products at `precision`:
    attention_tiles)."""
    return attention_tiles(hd, dtype, "triton prefix_attention", interp, block, precision)


@triton.jit
def _attend_tile(q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, q_row0, k_row0, n_rows, a, pos_q, m0, h, kh,
                 sq_r, sk_r, sv_r, skp_t, svp_t, hd, scale, cap, window,
                 PREFIX_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CHUNK_D: tl.constexpr):
    """The normalised float32 output [BLOCK_M, BLOCK_D] of head h for the queries at rows q_row0 + m0 + i (i <
    BLOCK_M, m0 + i < n_rows; positions pos_q + m0 + i) over the prefix keys 0 .. a-1 (kp / vp rows, positions
    0 ..) and causally over the row's own keys at rows k_row0 + n (n < n_rows, positions pos_q + n)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < n_rows) & (offs_d[None, :] < hd)
    q_rows = q_ptr + (q_row0 + offs_m)[:, None].to(tl.int64) * sq_r + h * hd
    q = _query_tile(q_rows, q_mask, False, BLOCK_D, CHUNK_D)
    q_pos = pos_q + offs_m
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, pos_q + m0 - window + 1) // BLOCK_N * BLOCK_N
    for n0 in range(lo, a, BLOCK_N):  # the prefix (a == 0 for the lead rows' tiles)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_rows, offs_m[:, None] < n_rows, kp_ptr + kh * hd,
                                      vp_ptr + kh * hd, skp_t, svp_t, n0, a, 0, q_pos, hd, scale, cap, window,
                                      HAS_SOFTCAP, HAS_WINDOW, PREFIX_CAUSAL, False, PRECISION, BLOCK_N, BLOCK_D,
                                      CHUNK_D)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, m0 - window + 1) // BLOCK_N * BLOCK_N
    k_base = k_ptr + k_row0.to(tl.int64) * sk_r + kh * hd
    v_base = v_ptr + k_row0.to(tl.int64) * sv_r + kh * hd
    for n0 in range(lo, tl.minimum(n_rows, m0 + BLOCK_M), BLOCK_N):  # the row's own keys, causal
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_rows, offs_m[:, None] < n_rows, k_base, v_base, sk_r,
                                      sv_r, n0, n_rows, pos_q, q_pos, hd, scale, cap, window, HAS_SOFTCAP,
                                      HAS_WINDOW, True, False, PRECISION, BLOCK_N, BLOCK_D, CHUNK_D)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees its own key; padding rows stay 0


@triton.jit
def _attention_rows_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, anchor_ptr, slot_ptr, o_ref_ptr, o_ptr,
    sq_r, sk_r, sv_r, skp_t, svp_t, s_oref,
    lead, B, T, pos0, a, H, G, hd, n_lead_tiles, n_groups, rows_per_group, scale, cap, window,
    PREFIX_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_REF: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    is_lead = pid < n_lead_tiles
    task = tl.maximum(pid - n_lead_tiles, 0)
    m0 = tl.where(is_lead, pid, task // n_groups) * BLOCK_M
    j = tl.where(is_lead, 0, task % n_groups * rows_per_group)
    j_end = tl.where(is_lead, 1, tl.minimum(B, j + rows_per_group))
    n_rows = tl.where(is_lead, lead, T)
    pos_q = tl.where(is_lead, 0, pos0)
    a_eff = tl.where(is_lead, 0, a)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_mask = (offs_m[:, None] < n_rows) & (offs_d[None, :] < hd)
    o_anchor = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cur = j * 0 - 1  # the batch row whose output o_anchor holds (none yet)
    while j < j_end:  # one row's tile an iteration: the anchor first when it is not the one held
        aj = tl.load(anchor_ptr + j, mask=is_lead == 0, other=0).to(tl.int32)
        r = tl.where(aj != cur, aj, j)
        row0 = tl.where(is_lead, 0, lead + r * T)
        o = _attend_tile(q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, row0, row0, n_rows, a_eff, pos_q, m0, h, kh, sq_r, sk_r,
                         sv_r, skp_t, svp_t, hd, scale, cap, window, PREFIX_CAUSAL, HAS_SOFTCAP, HAS_WINDOW,
                         PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, CHUNK_D)
        if r == aj:
            o_anchor = o
            cur = aj
        if r == j:  # this row's output: a value, or its difference from the anchor's held tile
            if HAS_REF:  # a value row's change from its reference rows (read by value rows only: a masked load)
                slot = tl.load(slot_ptr + j, mask=is_lead == 0, other=0).to(tl.int32)
                v_out = (tl.where(is_lead, 0, lead + slot * T) + offs_m)[:, None].to(tl.int64)
                o_ref = tl.load(o_ref_ptr + v_out * s_oref + h * hd + offs_d[None, :], mask=o_mask & (aj == j),
                                other=0.0)
                out = o - tl.where(aj == j, o_ref, o_anchor)
            else:
                out = tl.where(aj == j, o, o - o_anchor)
            rows_out = tl.where(is_lead, 0, lead + j * T) + offs_m
            tl.store(o_ptr + rows_out[:, None].to(tl.int64) * (H * hd) + h * hd + offs_d[None, :], to_bf16(out),
                     mask=o_mask)
            j += 1


def attention_rows(q, k, v, rows, prefix, scale: float, softcap: float | None, window: int | None,
                   o_ref: torch.Tensor | None = None, block: int | None = None, rows_per_program: int | None = None,
                   precision: str = DEFAULT_PRECISION) -> torch.Tensor:
    """o [R, H hd] bf16 in difference form (module docstring; o_ref [V, H hd] float32: the value rows' reference,
    or None). One launch. block: the query and key tile (default _TILES' by head size; the tests use 16 for the
    multi-block paths); rows_per_program: batch rows a program walks (default: as the module docstring says);
    precision: the products' (PRECISIONS)."""
    op = "triton attention_rows"
    precision = check_precision(precision, op)
    dev = check_device(q, k, v, *(prefix or ()), op=op)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(t, torch.float32, name, op)
    R, H, hd = q.shape
    Hk = k.shape[1]
    anchor = check_rows(rows, R, dev, op)
    if tuple(k.shape) != (R, Hk, hd) or tuple(v.shape) != (R, Hk, hd) or H % Hk:
        raise SiclError(f"{op}: k and v must be [{R}, Hk, {hd}] with Hk dividing {H}, got {list(k.shape)} and "
                        f"{list(v.shape)}")
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == hd else t.contiguous() for t in (q, k, v))
    lead, B, T, pos0 = rows.lead, rows.B, rows.T, rows.pos0
    if lead and prefix is not None:
        raise SiclError(f"{op}: the prefix comes as lead rows or as kept K/V, not both")
    if lead:
        kp, vp, a = k, v, lead
    elif prefix is not None:
        kp, vp = (t[0] if t.stride(-1) == 1 and t.stride(-2) == hd else t[0].contiguous() for t in prefix)
        check_dtype(kp, torch.float32, "prefix k", op)
        check_dtype(vp, torch.float32, "prefix v", op)
        a = kp.shape[0]
        if tuple(kp.shape) != (a, Hk, hd) or tuple(vp.shape) != (a, Hk, hd):
            raise SiclError(f"{op}: the prefix K/V must be [1, a, {Hk}, {hd}], got {list(prefix[0].shape)}")
    else:
        kp, vp, a = k, v, 0
    o_ref, s_oref = check_ref(o_ref, rows, H * hd, dev, "o_ref", op)
    o = torch.empty(R, H * hd, dtype=torch.bfloat16, device=dev)
    if R == 0:
        return o
    cfg = attention_rows_config(hd, block, precision=precision)
    n_lead_tiles = triton.cdiv(lead, cfg["BLOCK_M"])
    n_tiles = triton.cdiv(T, cfg["BLOCK_M"]) if B else 0
    if rows_per_program is None:
        if interpreting() or n_tiles == 0:
            rows_per_program = max(B, 1)
        else:  # the fewest groups that give about two programs an SM
            groups = min(B, max(1, triton.cdiv(2 * sm_count(dev), n_tiles * H)))
            rows_per_program = triton.cdiv(B, groups)
    rpg = max(1, min(int(rows_per_program), max(B, 1)))
    n_groups = triton.cdiv(B, rpg) if B else 0
    grid = (n_lead_tiles + n_tiles * n_groups, H)
    launch(
        _attention_rows_kernel, grid, q, k, v, kp, vp, anchor, value_slots(rows, dev, op),
        o_ref if o_ref is not None else q, o, q.stride(0), k.stride(0), v.stride(0), kp.stride(0), vp.stride(0), s_oref,
        lead, B, T, pos0, a, H, H // Hk, hd, n_lead_tiles, max(n_groups, 1), rpg, float(scale), float(softcap or 1.0),
        int(window or 0), PREFIX_CAUSAL=a - 1 > pos0, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        HAS_REF=o_ref is not None, PRECISION=precision, device=dev, **cfg,
    )
    return o


def attention_rows_config(hd: int, block: int | None = None, interp: bool | None = None,
                          precision: str = DEFAULT_PRECISION) -> dict:
    """attention_rows' launch configuration for heads of hd (float32 products at `precision`: attention_tiles)."""
    return attention_tiles(hd, torch.float32, "triton attention_rows", interp, block, precision)
