"""Log-probabilities of the target tokens from hidden states, the LM head fused with an online log-sum-exp.

    span_logprobs(hidden [B, P, d], weight [V, d], targets [P] int, softcap=None) -> [B, P] float32
        out[b, p] = z[b, p, targets[p]] - logsumexp_v z[b, p, v],   z = hidden @ weight.T
        (Gemma-2 style soft-capping first when softcap is set: z <- softcap * tanh(z / softcap))

hidden and weight: float32, bfloat16 or float16 (the same dtype); products accumulate in float32 and the
log-sum-exp runs in float32. The [B, P, V] logits never exist: each program computes [BLOCK_M, BLOCK_V] tiles
of z for BLOCK_M rows of the flattened [B*P, d] hidden states over one contiguous share of the vocabulary
(a "split"), keeping a running max m, running sum s = sum exp(z - m) and the target's logit; a second small
kernel merges the splits' (m, s) and writes target - (m + log s). Splits give the GPU enough programs when
B*P is small; programs of one split run side by side so the weight tiles they stream are shared in L2.

Reference: sicl_fast.step.logprobs.vocab_chunked_logprobs (tested against it). Targets outside [0, V) are
rejected when targets are on the CPU; on the GPU they are not checked (no host sync) and give garbage.

    span_logprobs_rows(hidden [B, P, d] bf16, weight [V, d] bf16, targets [P], anchor [B], softcap=None,
                       z_ref [Vb, P, V] f32 or None, value_slot [B] or None) -> [B, P] float32
                                                              the span head of a difference-form pass

hidden in difference form over the batch (anchor [B] int64 on the device; sicl_fast.models.rows): row j a value
(anchor[j] == j) or the difference from row anchor[j]. The same bf16 product with a float32 accumulator gives
every row's logits. Without z_ref a value row's hidden states are values and its logits that float32 product; with
z_ref (the value rows' float32 reference logits, value batch row j's at z_ref[value_slot[j]]; its hidden states
then the change from the reference's) a value row's logits are z_ref's plus its change's product rounded to bf16
(no float32 product per step: the reference's is made every few steps, sicl_fast.backends.step_forward). A
difference row's product is rounded to bf16 (to nearest even, as a bf16 product returns it) and
z_j = z_anchor(j) + dz_j in float32; then soft-capped, the online log-sum-exp and the combine kernel as above (two
launches). Reference: sicl_fast.step.logprobs.rows_logprobs.
Design: a program's M tile holds whole span positions, the B rows of each (BLOCK_M // B positions: B 9 in 64 rows
holds 7), so a difference row's anchor sits in the same accumulator tile and its logits are taken with a register
gather along M (tl.gather; on sm_90 a shared-memory round trip of the [BLOCK_M, BLOCK_V] tile, small next to the
BLOCK_V x d weight tile it follows), not recomputed nor written out. The reference logits are read for the value
rows alone: a [BLOCK_MV, BLOCK_V] tile of the tile's positions x the Vb value slots (Vb 1 for one prompt: 7 rows of
the 63), row-contiguous, coalesced loads, then gathered to each row's anchor (a second gather, of that small tile);
a masked [BLOCK_M, BLOCK_V] load would take a full tile of registers (and its addresses) for the few value rows.
The hidden rows are gathered by pointer (row j, position p at j * P + p); the weight streams through block pointers
as in span_logprobs, split over the vocabulary for occupancy (B P / 7 tiles are few: SmolLM2, B 9, P 64: 10 tiles x
the splits). Tiles: _ROWS_ACC.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError
from sicl_fast.step.spec import f32

from ._math import tanh, to_bf16
from ._utils import (FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting, launch, launch_config,
                     next_pow2, sm_count)


@triton.jit
def _lse_partial_kernel(
    h_ptr, stride_hm,  # [M, d] hidden states (row stride stride_hm, unit column stride)
    w_ptr, stride_wv,  # [V, d] LM head weight
    tgt_ptr,  # [P] int target ids
    m_ptr, s_ptr, t_ptr,  # [SPLITS, M] float32 partials: running max, sum exp(z - max), target logit
    M, P, V, d, v_per_split,
    softcap,
    HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    tgt = tl.load(tgt_ptr + rows % P, mask=rmask, other=-1).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        vmask = vs < v_end
        # block pointers (TMA-friendly, few registers): hidden rows [BLOCK_M, BLOCK_K], weight rows [BLOCK_V, BLOCK_K]
        h_blk = tl.make_block_ptr(h_ptr, shape=(M, d), strides=(stride_hm, 1), offsets=(pid_m * BLOCK_M, 0),
                                  block_shape=(BLOCK_M, BLOCK_K), order=(1, 0))
        w_blk = tl.make_block_ptr(w_ptr, shape=(V, d), strides=(stride_wv, 1), offsets=(v0, 0),
                                  block_shape=(BLOCK_V, BLOCK_K), order=(1, 0))
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for _k0 in range(0, d, BLOCK_K):
            h = tl.load(h_blk, boundary_check=(0, 1), padding_option="zero")
            w = tl.load(w_blk, boundary_check=(0, 1), padding_option="zero")
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
            h_blk = tl.advance(h_blk, (0, BLOCK_K))
            w_blk = tl.advance(w_blk, (0, BLOCK_K))
        if HAS_SOFTCAP:
            acc = softcap * tanh(acc / softcap)
        z = tl.where(vmask[None, :], acc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_i = m_new
        t_i += tl.sum(tl.where(vs[None, :] == tgt[:, None], z, 0.0), axis=1)
    out = split.to(tl.int64) * M + rows
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(s_ptr + out, s_i, mask=rmask)
    tl.store(t_ptr + out, t_i, mask=rmask)


@triton.jit
def _lse_combine_kernel(m_ptr, s_ptr, t_ptr, out_ptr, M, SPLITS, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < M
    m_all = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for k in range(0, SPLITS):
        m_all = tl.maximum(m_all, tl.load(m_ptr + k * M + rows, mask=rmask, other=0.0))
    s = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, SPLITS):
        mk = tl.load(m_ptr + k * M + rows, mask=rmask, other=0.0)
        sk = tl.load(s_ptr + k * M + rows, mask=rmask, other=1.0)
        s += sk * tl.exp(mk - m_all)
        t += tl.load(t_ptr + k * M + rows, mask=rmask, other=0.0)
    tl.store(out_ptr + rows, t - (m_all + tl.log(s)), mask=rmask)


def span_logprobs_config(M: int, d: int, dtype: torch.dtype, interp: bool | None = None) -> dict:
    """BLOCK_M / BLOCK_V / BLOCK_K tiles, num_warps and num_stages of the span head's partial launch over M rows of
    d in dtype (_utils.launch_config); under the interpreter (numpy) few big tiles."""
    # the sm_90 compile (tests/test_sm90_configs.py; bench/gpu_kernels.py --compile-only), as specialised at real
    # shapes / at odd ones: float32 (IEEE products, no tensor cores unless allow_tf32) 64 x 64 x 32 on 4 warps keeps
    # 208 registers / spills 56 B, on 8 warps 128 / 204 without a spill; bf16 64 x 128 x 128 on 4 warps takes 255
    # registers / spills 8 B (and 147,456 B of shared memory), 64 x 64 x 128 194 / 180 without a spill (98,304 B).
    # Untimed on a GPU so far: tune with gpu_kernels.py.
    if dtype == torch.float32:
        tiles = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32, num_warps=8)
    else:
        tiles = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=128, num_warps=4)
    return launch_config("triton span_logprobs", interp, num_stages=3, **tiles, interpreter=dict(
        BLOCK_M=min(max(next_pow2(M), 16), 64), BLOCK_V=1024, BLOCK_K=min(max(next_pow2(d), 16), 256), num_stages=1))


def lse_combine_config(interp: bool | None = None) -> dict:
    """BLOCK (rows a program) and num_warps of the span heads' combine launch."""
    return launch_config("triton span_logprobs", interp, block=256, BLOCK=256, interpreter={"BLOCK": 1024})


def _num_splits(M: int, V: int, block_m: int, block_v: int, device: torch.device) -> int:
    chunks = triton.cdiv(V, block_v)
    if interpreting():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    m_blocks = triton.cdiv(M, block_m)
    return max(1, min(chunks, triton.cdiv(2 * sms, m_blocks)))


def span_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
                  splits: int | None = None, allow_tf32: bool = False, config: dict | None = None,
                  check_targets: bool = True) -> torch.Tensor:
    """[B, P] float32 log p(targets[p] | hidden[b, p]) (module docstring).

    hidden [B, P, d] and weight [V, d]: float32 / bfloat16 / float16, same dtype, same device (CUDA, or the CPU
    under TRITON_INTERPRET=1). targets [P] integer ids in [0, V). softcap: Gemma-2's final_logit_softcapping.
    splits: vocabulary splits (default: enough programs for the GPU). allow_tf32: float32 products on tensor
    cores (about 1e-3 relative error) instead of IEEE float32. config: override the tile sizes (tests, tuning).
    check_targets: check the range of host (CPU) targets here, a host read; False where the caller checked them
    once (a prompt's tokens: sicl_fast.run.checks.check_tokens). Device targets are never read back.
    """
    op = "triton span_logprobs"
    if targets.device.type == "cpu":  # checked here, then copied to the device
        check_device(hidden, weight, op=op)
    else:
        check_device(hidden, weight, targets, op=op)
    check_shape(hidden, (None, None, None), "hidden", op)
    B, P, d = hidden.shape
    check_shape(weight, (None, d), "weight", op)
    V = weight.shape[0]
    check_shape(targets, (P,), "targets", op)
    check_dtype(hidden, FLOAT_DTYPES, "hidden", op)
    if weight.dtype != hidden.dtype:
        raise SiclError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise SiclError(f"{op}: targets must be integer token ids, got {targets.dtype}")
    if softcap is not None and not softcap > 0:
        raise SiclError(f"{op}: softcap must be > 0 (or None), got {softcap}")
    if V < 1 or d < 1:
        raise SiclError(f"{op}: empty weight {list(weight.shape)}")
    if check_targets and targets.device.type == "cpu" and P and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise SiclError(f"{op}: targets must be in [0, V={V}), got {int(targets.min())}..{int(targets.max())}")
    dev = hidden.device
    targets = targets.to(dev).contiguous()
    M = B * P
    out = torch.empty(B, P, dtype=torch.float32, device=dev)
    if M == 0:
        return out
    h = hidden.reshape(M, d)
    if h.stride(1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = span_logprobs_config(M, d, hidden.dtype)
    if config:
        cfg.update(config)
    bm, bv, bk, warps = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_V"), cfg.pop("BLOCK_K"), cfg.pop("num_warps")
    chunks = triton.cdiv(V, bv)
    n_splits = splits if splits is not None else _num_splits(M, V, bm, bv, dev)
    n_splits = max(1, min(int(n_splits), chunks))
    v_per_split = triton.cdiv(chunks, n_splits) * bv
    n_splits = triton.cdiv(V, v_per_split)  # every split non-empty
    parts = torch.empty(3, n_splits, M, dtype=torch.float32, device=dev)
    precision = "ieee" if hidden.dtype != torch.float32 or not allow_tf32 else "tf32"
    upcast = interpreting() and hidden.dtype != torch.float32  # the interpreter's dot has no bf16
    grid = (triton.cdiv(M, bm), n_splits)
    launch(
        _lse_partial_kernel, grid,
        h, h.stride(0), w, w.stride(0), targets, parts[0], parts[1], parts[2], M, P, V, d, v_per_split,
        f32(softcap) if softcap is not None else 1.0, device=dev, num_warps=warps, HAS_SOFTCAP=softcap is not None,
        UPCAST=upcast, PRECISION=precision, BLOCK_M=bm, BLOCK_V=bv, BLOCK_K=bk, **cfg,
    )
    cfg = lse_combine_config()
    launch(_lse_combine_kernel, (triton.cdiv(M, cfg["BLOCK"]),), parts[0], parts[1], parts[2], out, M, n_splits,
           device=dev, **cfg)
    return out


@triton.jit
def _lse_rows_partial_kernel(
    h_ptr, stride_hb, stride_hp,  # [B, P, d] hidden states in difference form (unit column stride)
    w_ptr, stride_wv,  # [V, d] LM head weight
    tgt_ptr, anchor_ptr,  # [P] target ids; [B] each row's anchor
    z_ref_ptr, stride_zb, stride_zp, slot_ptr,  # [Vb, P, V] value rows' reference logits (unit V stride); [B] slots
    m_ptr, s_ptr, t_ptr,  # [SPLITS, B * P] float32 partials (row b * P + p), as _lse_partial_kernel's
    B, P, V, d, per_tile, v_per_split, Vb,
    softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_REF: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_MV: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    pl = r // B  # the tile's span position of local row r, and its batch row
    j = r % B
    p = pid_m * per_tile + pl
    rmask = (pl < per_tile) & (p < P)
    aj = tl.load(anchor_ptr + j, mask=rmask, other=0).to(tl.int32)
    aj = tl.where(rmask, aj, j)
    diff = aj != j
    a_local = pl * B + aj  # the anchor's row in this tile (same position); itself for value and padding rows
    a_idx = tl.broadcast_to(a_local[:, None], (BLOCK_M, BLOCK_V))
    h_rows = h_ptr + j.to(tl.int64) * stride_hb + p.to(tl.int64) * stride_hp
    if HAS_REF:
        # the value rows' reference logits, a [BLOCK_MV, BLOCK_V] tile of the tile's positions x the Vb value slots
        # (local row i: slot i % Vb at the tile's position i // Vb), and each row's anchor's row in it
        iv = tl.arange(0, BLOCK_MV)
        pv = pid_m * per_tile + iv // Vb
        zr_mask = (iv // Vb < per_tile) & (pv < P)
        zr_rows = z_ref_ptr + (iv % Vb).to(tl.int64) * stride_zb + pv.to(tl.int64) * stride_zp
        slot_a = tl.load(slot_ptr + aj, mask=rmask, other=0).to(tl.int32)
        r_idx = tl.broadcast_to(tl.where(rmask, pl * Vb + slot_a, 0)[:, None], (BLOCK_M, BLOCK_V))
    tgt = tl.load(tgt_ptr + p, mask=rmask, other=-1).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(V, v_start + v_per_split)
    for v0 in range(v_start, v_end, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        vmask = vs < v_end
        w_blk = tl.make_block_ptr(w_ptr, shape=(V, d), strides=(stride_wv, 1), offsets=(v0, 0),
                                  block_shape=(BLOCK_V, BLOCK_K), order=(1, 0))
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_rows[:, None] + kk[None, :], mask=rmask[:, None] & (kk[None, :] < d), other=0.0)
            w = tl.load(w_blk, boundary_check=(0, 1), padding_option="zero")
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
            w_blk = tl.advance(w_blk, (0, BLOCK_K))
        if HAS_REF:  # every row's change rounded to bf16; a value row's logits its reference's plus its change
            zr = tl.load(zr_rows[:, None] + vs[None, :], mask=zr_mask[:, None] & vmask[None, :], other=0.0)
            zr = tl.gather(zr, r_idx, axis=0)  # each row's anchor's reference logits
            zc = to_bf16(acc).to(tl.float32)
            z = zc + tl.where(diff[:, None], tl.gather(zc, a_idx, axis=0) + zr, zr)  # z_a = zr_a + dz_a
        else:  # a value row's logits the float32 product itself
            za = tl.gather(acc, a_idx, axis=0)
            z = tl.where(diff[:, None], za + to_bf16(acc).to(tl.float32), acc)
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        z = tl.where(vmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_i = m_new
        t_i += tl.sum(tl.where(vs[None, :] == tgt[:, None], z, 0.0), axis=1)
    out = split.to(tl.int64) * (B * P) + j * P + p
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(s_ptr + out, s_i, mask=rmask)
    tl.store(t_ptr + out, t_i, mask=rmask)


# The rows head's accumulator tile (BLOCK_M x BLOCK_V elements) on 8 warps, BLOCK_K 64, 3 stages, by whether the value
# rows' reference logits are read (their [BLOCK_MV, BLOCK_V] tile and its gather: about 80 more registers at 64 x 128).
# The sm_90 compile (ptxas -v; bench/gpu_kernels.py --compile-only), unspecialised / as specialised at real shapes
# (pointers, V, d and strides multiples of 16): without the reference, 64 x 128: 247 / 172 registers, 128 x 64: 251 /
# 223, where 128 x 128 (B 17's M tile: N 16) spills 512 / 136 bytes; with it, 64 x 64: 240 / 173 and 128 x 32: 254 /
# 194, no spill at any BLOCK_MV (8 to 64), where 64 x 128 takes 255 and spills 244 bytes at BLOCK_MV 64 (a batch of
# one, unspecialised) and 128 x 64 68 to 228 bytes. Untimed: bench/gpu_kernels.py times 64 x 128 against these.
_ROWS_ACC = {False: 64 * 128, True: 64 * 64}


def span_logprobs_rows_config(B: int, P: int, d: int, Vb: int, has_ref: bool, config: dict | None = None,
                              interp: bool | None = None) -> dict:
    """The rows head's partial launch (_utils.launch_config) for B rows of P positions of d, Vb value slots, with or
    without the reference logits: BLOCK_M, its M tile, whole positions of B rows each, the fewest padding rows among
    64 and 128 (a power of two at least B beyond); BLOCK_V, the accumulator tile that compiles for sm_90 without a
    spill (_ROWS_ACC), BLOCK_K 64, 8 warps, 3 stages; BLOCK_MV, the value rows' tile of the reference logits (the M
    tile's positions x Vb). The interpreter: about 64 rows, BLOCK_V 1024. config: overrides of the tiles, warps and
    stages (tests, tuning)."""
    op = "triton span_logprobs_rows"
    if B > 128:
        bm = next_pow2(B)
    else:
        bm = max([m for m in (64, 128) if m >= B], key=lambda m: ((m // B) * B / m, -m))
    bmi = max(next_pow2(B), min(64, next_pow2(B * P)))
    cfg = launch_config(op, interp, num_warps=8, num_stages=3, BLOCK_M=bm, BLOCK_V=max(16, _ROWS_ACC[has_ref] // bm),
                        BLOCK_K=64, interpreter=dict(BLOCK_M=bmi, BLOCK_V=1024, BLOCK_K=min(max(next_pow2(d), 16), 256),
                                                     num_warps=4, num_stages=1))
    cfg.update(config or {})
    if cfg["BLOCK_M"] < B:
        raise SiclError(f"{op}: BLOCK_M {cfg['BLOCK_M']} holds no position of {B} rows")
    return launch_config(op, False, **cfg, BLOCK_MV=max(8, next_pow2(cfg["BLOCK_M"] // B * Vb)))


def span_logprobs_rows(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, anchor: torch.Tensor,
                       softcap: float | None = None, z_ref: torch.Tensor | None = None,
                       value_slot: torch.Tensor | None = None, splits: int | None = None, config: dict | None = None,
                       check_targets: bool = True) -> torch.Tensor:
    """[B, P] float32 log p(targets[p]) of a difference-form pass (module docstring). hidden [B, P, d] and weight
    [V, d] bf16 on one device (CUDA, or the CPU under TRITON_INTERPRET=1); anchor [B] int64 on it (never read
    back); targets [P]; z_ref [Vb, P, V] float32 with value_slot [B] int64 (both on the device, never read back):
    the value rows' reference logits, or None; softcap, splits, check_targets as span_logprobs'; config: BLOCK_M
    (at least B), BLOCK_V, BLOCK_K, num_warps, num_stages overrides. Two launches."""
    op = "triton span_logprobs_rows"
    if targets.device.type == "cpu":
        check_device(hidden, weight, anchor, op=op)
    else:
        check_device(hidden, weight, targets, anchor, op=op)
    check_shape(hidden, (None, None, None), "hidden", op)
    B, P, d = hidden.shape
    check_shape(weight, (None, d), "weight", op)
    V = weight.shape[0]
    check_shape(targets, (P,), "targets", op)
    check_shape(anchor, (B,), "anchor", op)
    check_dtype(hidden, torch.bfloat16, "hidden", op)
    check_dtype(weight, torch.bfloat16, "weight", op)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise SiclError(f"{op}: targets must be integer token ids, got {targets.dtype}")
    if softcap is not None and not softcap > 0:
        raise SiclError(f"{op}: softcap must be > 0 (or None), got {softcap}")
    if V < 1 or d < 1:
        raise SiclError(f"{op}: empty weight {list(weight.shape)}")
    if check_targets and targets.device.type == "cpu" and P and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise SiclError(f"{op}: targets must be in [0, V={V}), got {int(targets.min())}..{int(targets.max())}")
    dev = hidden.device
    if z_ref is not None:
        if value_slot is None:
            raise SiclError(f"{op}: z_ref comes with value_slot (each value row's place in it)")
        check_device(hidden, z_ref, value_slot, op=op)
        check_shape(z_ref, (None, P, V), "z_ref", op)
        check_dtype(z_ref, torch.float32, "z_ref", op)
        if not 1 <= z_ref.shape[0] <= B:
            raise SiclError(f"{op}: z_ref holds {z_ref.shape[0]} value rows' logits; a batch of {B} has 1 to {B}")
        check_shape(value_slot, (B,), "value_slot", op)
        if value_slot.dtype.is_floating_point or value_slot.dtype == torch.bool:
            raise SiclError(f"{op}: value_slot must be integer slots, got {value_slot.dtype}")
        z_ref = z_ref if z_ref.stride(2) == 1 else z_ref.contiguous()
    targets = targets.to(dev).contiguous()
    out = torch.empty(B, P, dtype=torch.float32, device=dev)
    if B * P == 0:
        return out
    h = hidden if hidden.stride(2) == 1 else hidden.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    Vb = z_ref.shape[0] if z_ref is not None else 1
    cfg = span_logprobs_rows_config(B, P, d, Vb, z_ref is not None, config)
    per_tile = cfg["BLOCK_M"] // B
    m_tiles = triton.cdiv(P, per_tile)
    chunks = triton.cdiv(V, cfg["BLOCK_V"])
    if splits is None:
        splits = 1 if interpreting() else triton.cdiv(2 * sm_count(dev), m_tiles)
    n_splits = max(1, min(int(splits), chunks))
    v_per_split = triton.cdiv(chunks, n_splits) * cfg["BLOCK_V"]
    n_splits = triton.cdiv(V, v_per_split)
    parts = torch.empty(3, n_splits, B * P, dtype=torch.float32, device=dev)
    launch(
        _lse_rows_partial_kernel, (m_tiles, n_splits),
        h, h.stride(0), h.stride(1), w, w.stride(0), targets, anchor,
        z_ref if z_ref is not None else out, z_ref.stride(0) if z_ref is not None else 0,
        z_ref.stride(1) if z_ref is not None else 0, value_slot if z_ref is not None else anchor,
        parts[0], parts[1], parts[2], B, P, V, d, per_tile, v_per_split, Vb,
        f32(softcap) if softcap is not None else 1.0, device=dev, HAS_SOFTCAP=softcap is not None,
        HAS_REF=z_ref is not None, UPCAST=interpreting(), **cfg,
    )
    cfg = lse_combine_config()
    launch(_lse_combine_kernel, (triton.cdiv(B * P, cfg["BLOCK"]),), parts[0], parts[1], parts[2], out, B * P,
           n_splits, device=dev, **cfg)
    return out
