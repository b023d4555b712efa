"""One zeroth-order ascent step with the noise regenerated in the kernel (step.zo.update's function).

    zo_update(X [L, d], X0 [L, d], f [B], step, spec: StepSpec) -> (X_new [L, d] float32, fired: int32 [1])

    w_i = (f_{1+i} - f_0) / mu                   forward  (batch layout of sicl_fast.step.zo)
    w_i = (f_{1+2i} - f_{2+2i}) / (2 mu)         central
    g   = (sum_i w_i U_i) / N                    on rows [a, b), U_i regenerated from (seed, step) as in perturb
    g_r <- g_r * min(1, clip / (|g_r| + 1e-8))   per token row ("clip"), or g_r / (|g_r| + 1e-8) ("normalize")
    X_new = X;  X_new[a:b] += eta * g
    if kappa > 0 and cos(X_new, X0) < kappa (over the whole matrix, or rows [a, b) for scope "demos"):
        X_new <- |X_new| (kappa x0_hat + sqrt(1 - kappa^2) perp_hat),  perp = X_new - (X_new . x0_hat) x0_hat

Two kernels, no [N, R, d] tensor: `_step_kernel` (one program per row of X: gradient + clip + step for rows in
[a, b), a copy elsewhere, and float64 per-row partial sums X_new.X0, |X_new|^2, |X0|^2), then, when kappa > 0,
`_project_kernel` (sums the partials in row order, decides on the device, rewrites the rows when it fires).
Nothing is synchronised with the host; `fired` stays a device tensor. A length bucket's padded block (rows_end, an
int64 [1] device tensor: sicl_fast.step.zo) is read in both kernels: b = rows_end, and for scope "demos"
the projection's rows end there too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError
from sicl_fast.step.spec import StepSpec, f32

from ._utils import EXACT, check_device, check_dtype, launch, launch_config, next_pow2, rows_end_arg, step_key
from .randn import randn_f32


@triton.jit(do_not_specialize=["seed64", "N", "a", "b", "lo", "hi"])
def _step_kernel(
    x_ptr, x0_ptr, f_ptr, out_ptr,  # X, X0 [L, d]; f [B]; out [L, d]   (float32, contiguous)
    pdot_ptr, pxx_ptr, px0_ptr,  # [L] float64 per-row partial sums for the projection
    seed64, step_ptr,  # as in perturb: seed + step * 2**32, or (STEP_PTR) the seed and the step on the device
    end_ptr,  # int64 [1]: the block's end b (read when END_PTR; then hi too with HI_END)
    N, L, d, a, b, lo, hi,  # lo, hi: rows the projection covers
    mu, eta, clip_norm,  # float32
    CENTRAL: tl.constexpr, NORMALIZE: tl.constexpr, PROJECT: tl.constexpr, STEP_PTR: tl.constexpr,
    END_PTR: tl.constexpr, HI_END: tl.constexpr, BLOCK_D: tl.constexpr,
):
    if STEP_PTR:
        seed64 = seed64 + (tl.load(step_ptr).to(tl.int64) << 32)
    if END_PTR:
        b = tl.load(end_ptr).to(tl.int32)
        if HI_END:
            hi = b
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    rbase = row.to(tl.int64) * d
    if (row >= a) & (row < b):
        r = row - a
        R = b - a
        f0 = tl.load(f_ptr)
        nf = N.to(tl.float32)
        sumsq = tl.zeros([BLOCK_D], dtype=tl.float32)
        # pass 1: g = (sum_i w_i U_i) / N, written to out[row] for now
        for c0 in range(0, d, BLOCK_D):
            cc = c0 + cols
            cm = cc < d
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i in range(0, N):
                if CENTRAL:
                    fp = tl.load(f_ptr + 1 + 2 * i)
                    fm = tl.load(f_ptr + 2 + 2 * i)
                    w = tl.math.div_rn(fp - fm, 2.0 * mu)
                else:
                    w = tl.math.div_rn(tl.load(f_ptr + 1 + i) - f0, mu)
                counter = i * R * d + r * d + cc
                u = randn_f32(seed64, tl.where(cm, counter, 0))
                acc = acc + w * u
            g = tl.math.div_rn(acc, tl.zeros_like(acc) + nf)
            g = tl.where(cm, g, 0.0)
            sumsq += g * g
            tl.store(out_ptr + rbase + cc, g, mask=cm)
        norm = tl.sqrt_rn(tl.sum(sumsq, axis=0))
        if NORMALIZE:
            den = norm + 1e-8
        else:
            scale = tl.minimum(tl.math.div_rn(clip_norm, norm + 1e-8), 1.0)
        tl.debug_barrier()
        # pass 2: X_new = X + eta * g'
        sd = tl.zeros([BLOCK_D], dtype=tl.float64)
        sx = tl.zeros([BLOCK_D], dtype=tl.float64)
        s0 = tl.zeros([BLOCK_D], dtype=tl.float64)
        for c0 in range(0, d, BLOCK_D):
            cc = c0 + cols
            cm = cc < d
            g = tl.load(out_ptr + rbase + cc, mask=cm, other=0.0)
            if NORMALIZE:
                gs = tl.math.div_rn(g, tl.zeros_like(g) + den)
            else:
                gs = g * scale
            x = tl.load(x_ptr + rbase + cc, mask=cm, other=0.0)
            y = x + eta * gs
            tl.store(out_ptr + rbase + cc, y, mask=cm)
            if PROJECT:
                x0 = tl.load(x0_ptr + rbase + cc, mask=cm, other=0.0).to(tl.float64)
                y64 = tl.where(cm, y, 0.0).to(tl.float64)
                sd += y64 * x0
                sx += y64 * y64
                s0 += x0 * x0
        if PROJECT:
            tl.store(pdot_ptr + row, tl.sum(sd, axis=0))
            tl.store(pxx_ptr + row, tl.sum(sx, axis=0))
            tl.store(px0_ptr + row, tl.sum(s0, axis=0))
    else:
        sd = tl.zeros([BLOCK_D], dtype=tl.float64)
        sx = tl.zeros([BLOCK_D], dtype=tl.float64)
        s0 = tl.zeros([BLOCK_D], dtype=tl.float64)
        for c0 in range(0, d, BLOCK_D):
            cc = c0 + cols
            cm = cc < d
            x = tl.load(x_ptr + rbase + cc, mask=cm, other=0.0)
            tl.store(out_ptr + rbase + cc, x, mask=cm)
            if PROJECT:
                x0 = tl.load(x0_ptr + rbase + cc, mask=cm, other=0.0).to(tl.float64)
                x64 = x.to(tl.float64)
                sd += x64 * x0
                sx += x64 * x64
                s0 += x0 * x0
        if PROJECT:
            inside = (row >= lo) & (row < hi)
            tl.store(pdot_ptr + row, tl.where(inside, tl.sum(sd, axis=0), 0.0))
            tl.store(pxx_ptr + row, tl.where(inside, tl.sum(sx, axis=0), 0.0))
            tl.store(px0_ptr + row, tl.where(inside, tl.sum(s0, axis=0), 0.0))


@triton.jit
def _project_kernel(
    out_ptr, x0_ptr,  # [L, d] float32
    pdot_ptr, pxx_ptr, px0_ptr,  # [L] float64 partials (zero outside [lo, hi))
    fired_ptr,  # [1] int32
    consts_ptr,  # [2] float64: kappa, sqrt(1 - kappa^2) (a float argument would be rounded to float32)
    end_ptr,  # int64 [1]: with END_PTR, the rows from there on are not rewritten (a padded block's "demos" scope)
    L, d, lo,
    END_PTR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = lo + tl.program_id(0)
    kappa = tl.load(consts_ptr)
    sk = tl.load(consts_ptr + 1)
    # every program sums the partials in the same order: the same decision everywhere
    vd = tl.zeros([BLOCK_L], dtype=tl.float64)
    vx = tl.zeros([BLOCK_L], dtype=tl.float64)
    v0 = tl.zeros([BLOCK_L], dtype=tl.float64)
    for s in range(0, L, BLOCK_L):
        k = s + tl.arange(0, BLOCK_L)
        km = k < L
        vd += tl.load(pdot_ptr + k, mask=km, other=0.0)
        vx += tl.load(pxx_ptr + k, mask=km, other=0.0)
        v0 += tl.load(px0_ptr + k, mask=km, other=0.0)
    dot = tl.sum(vd, axis=0)
    xx = tl.sum(vx, axis=0)
    x0x0 = tl.sum(v0, axis=0)
    nx = tl.sqrt(xx)
    n0 = tl.sqrt(x0x0)
    cosv = dot / (nx * n0)
    fire = cosv < kappa
    if tl.program_id(0) == 0:
        tl.store(fired_ptr, fire.to(tl.int32))
    live = fire
    if END_PTR:
        live = live & (row < tl.load(end_ptr))
    if live:
        p = dot / n0
        pn = tl.sqrt(tl.maximum(xx - p * p, 0.0))
        axis = pn <= 1e-12
        pn_safe = tl.where(axis, 1.0, pn)
        cols = tl.arange(0, BLOCK_D)
        rbase = row.to(tl.int64) * d
        for c0 in range(0, d, BLOCK_D):
            cc = c0 + cols
            cm = cc < d
            y = tl.load(out_ptr + rbase + cc, mask=cm, other=0.0).to(tl.float64)
            h = tl.load(x0_ptr + rbase + cc, mask=cm, other=0.0).to(tl.float64) / n0
            perp = y - p * h
            v = tl.where(axis, nx * h, nx * (kappa * h + sk * perp / pn_safe))
            tl.store(out_ptr + rbase + cc, v.to(tl.float32), mask=cm)


_CONSTS: dict = {}


def _consts(kappa: float, device) -> torch.Tensor:
    """[kappa, sqrt(1 - kappa^2)] float64 on the device, cached (no host copy per step once made)."""
    key = (kappa, str(device))
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) > 64:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.tensor([kappa, (1.0 - kappa * kappa) ** 0.5], dtype=torch.float64, device=device)
    return t


def cached_tensors() -> list:
    """The device constants _consts has made: a captured CUDA graph reads them by address, so it keeps them."""
    return list(_CONSTS.values())


def zo_update(X: torch.Tensor, X0: torch.Tensor, f: torch.Tensor, step, spec: StepSpec,
              out: torch.Tensor | None = None, block_d: int | None = None, rows_end: torch.Tensor | None = None):
    """One ascent step (module docstring). X, X0: [L, d] float32; f: [B] float (B = N+1 or 2N+1), all on one
    device (CUDA, or the CPU under TRITON_INTERPRET=1). step: an int or an int64 [1] device tensor (as in
    perturb). X is not modified.

    out: optional preallocated [L, d] float32 buffer (not X). block_d: columns per loop step (a power of two;
    default min(next_pow2(d), 1024), 4096 in the interpreter). rows_end: a length bucket's block end (module
    docstring), or None.
    Returns (X_new [L, d] float32, fired int32 [1] device tensor: 1 when the cosine projection fired).
    """
    op = "triton zo_update"
    check_device(X, X0, f, op=op)
    check_dtype(X, torch.float32, "X", op)
    check_dtype(X0, torch.float32, "X0", op)
    spec.check_X(X, "X", op)
    spec.check_X(X0, "X0", op)
    spec.check_f(f, op)
    L, d = spec.L, spec.d
    f = f.reshape(-1).to(torch.float32).contiguous()
    X, X0 = X.contiguous(), X0.contiguous()
    if out is None:
        out = torch.empty_like(X)
    elif (tuple(out.shape) != (L, d) or out.dtype != torch.float32 or not out.is_contiguous()
          or out.data_ptr() == X.data_ptr()):
        raise SiclError(f"{op}: out must be a contiguous float32 [{L}, {d}] tensor that does not alias X")
    lo, hi = spec.project_rows
    fired = torch.zeros(1, dtype=torch.int32, device=X.device)
    parts = torch.zeros(3, L, dtype=torch.float64, device=X.device) if spec.project else fired
    pdot, pxx, px0 = (parts[0], parts[1], parts[2]) if spec.project else (fired, fired, fired)
    cfg = zo_step_config(d, block_d)
    seed64, step_ptr, from_ptr = step_key(spec.seed, step, X.device, op)
    end_ptr, end_from_ptr = rows_end_arg(rows_end, X.device, op)
    hi_end = end_from_ptr and spec.scope == "demos"
    launch(
        _step_kernel, (L,),
        X, X0, f, out, pdot, pxx, px0, seed64, step_ptr, end_ptr, spec.N, L, d, spec.a, spec.b, lo, hi,
        f32(spec.mu), f32(spec.eta), f32(spec.clip_norm), device=X.device, CENTRAL=spec.central,
        NORMALIZE=spec.grad_mode == "normalize", PROJECT=spec.project, STEP_PTR=from_ptr, END_PTR=end_from_ptr,
        HI_END=hi_end, **cfg,
    )
    if spec.project:
        consts = _consts(float(spec.kappa), X.device)
        launch(
            _project_kernel, (hi - lo,),
            out, X0, pdot, pxx, px0, fired, consts, end_ptr, L, d, lo, device=X.device, END_PTR=hi_end,
            **zo_project_config(L, cfg["BLOCK_D"]),
        )
    return out, fired


def zo_step_config(d: int, block_d: int | None = None, interp: bool | None = None) -> dict:
    """BLOCK_D (columns a loop step: block_d, else min(next_pow2(d), 1024), 4096 under the interpreter), num_warps
    and the exact float32 options (the noise bit for bit) of the update's launch (_utils.launch_config). maxnreg
    128: left to itself ptxas keeps 96 registers and spills 8 B (sm_90, the central estimator's code)."""
    bd = block_d or min(next_pow2(d), 1024)
    return launch_config("triton zo_update", interp, block=bd, BLOCK_D=bd, maxnreg=128, **EXACT,
                         interpreter=None if block_d else {"BLOCK_D": min(next_pow2(d), 4096)})


def zo_project_config(L: int, block_d: int, interp: bool | None = None) -> dict:
    """BLOCK_L (the rows' sums, at most 1024), BLOCK_D (the update's) and num_warps of the projection's launch."""
    bl = min(next_pow2(L), 1024)
    return launch_config("triton zo_update", interp, block=max(bl, block_d), BLOCK_L=bl, BLOCK_D=block_d, **EXACT)
