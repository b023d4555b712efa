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

Reference: sicl_fast.logprobs.gather_logprobs_chunked (tested against it). Targets outside [0, V) are
rejected when targets are on the CPU; on the GPU they are not checked (no host sync) and give garbage.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError
from sicl_fast.spec import f32

from ._math import tanh
from ._utils import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting, launch, next_pow2


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


def _config(M: int, V: int, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes and number of vocabulary splits for a problem."""
    if interpreting():
        # numpy: few big tiles
        return dict(BLOCK_M=min(max(next_pow2(M), 16), 64), BLOCK_V=1024, BLOCK_K=min(max(next_pow2(d), 16), 256),
                    num_warps=4, num_stages=1)
    if dtype == torch.float32:  # IEEE float32 products (no tensor cores unless allow_tf32)
        cfg = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32, num_warps=4, num_stages=3)
    else:
        # sm_90 compile check (bench/gpu_kernels.py --compile-only): 64 x 128 x 128 tiles, 4 warps spill ~16 bytes;
        # 128 x 128 x 64 with 8 warps spills ~170 bytes. Untimed on a GPU so far: tune with gpu_kernels.py.
        cfg = dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=3)
    return cfg


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
    once (a prompt's tokens: sicl_fast.checks.check_tokens). Device targets are never read back.
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
    cfg = dict(_config(M, V, d, hidden.dtype, dev))
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
    BLOCK = 1024 if interpreting() else 256
    launch(_lse_combine_kernel, (triton.cdiv(M, BLOCK),), parts[0], parts[1], parts[2], out, M, n_splits, device=dev,
           block=BLOCK, BLOCK=BLOCK)
    return out
