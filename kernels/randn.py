"""Counter-based N(0, 1) noise inside Triton kernels, bit-identical to `sicl_fast.step.rng.randn_counters`.

`randn_f32(seed64, counter)` is a @triton.jit helper for other kernels: Philox4x32-10 integers from
`tl.randint4x` (Triton's own generator) and the fixed float32 Box-Muller op sequence of `sicl_fast.step.rng`
(its own log / cos polynomials, div_rn / sqrt_rn). Kernels using it must be launched with
enable_fp_fusion=False so the GPU does not contract multiply-adds into FMAs.

`randn(seed, step, num, rows, d)` is the standalone op: U [num, rows, d] float32, as
`sicl_fast.step.rng.directions`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.step.rng import F32, LOG_M_LOW_BITS, LOG_SHIFT, check_counter_range, step_seed

from ._utils import EXACT, launch, launch_config

UNIFORM_SCALE: tl.constexpr = tl.constexpr(F32["UNIFORM_SCALE"])
U1_MIN: tl.constexpr = tl.constexpr(F32["U1_MIN"])
LN2_HI: tl.constexpr = tl.constexpr(F32["LN2_HI"])
LN2_LO: tl.constexpr = tl.constexpr(F32["LN2_LO"])
L3: tl.constexpr = tl.constexpr(F32["L3"])
L5: tl.constexpr = tl.constexpr(F32["L5"])
L7: tl.constexpr = tl.constexpr(F32["L7"])
L9: tl.constexpr = tl.constexpr(F32["L9"])
L11: tl.constexpr = tl.constexpr(F32["L11"])
TWO_PI: tl.constexpr = tl.constexpr(F32["TWO_PI"])
C2: tl.constexpr = tl.constexpr(F32["C2"])
C4: tl.constexpr = tl.constexpr(F32["C4"])
C6: tl.constexpr = tl.constexpr(F32["C6"])
C8: tl.constexpr = tl.constexpr(F32["C8"])
C10: tl.constexpr = tl.constexpr(F32["C10"])
S3: tl.constexpr = tl.constexpr(F32["S3"])
S5: tl.constexpr = tl.constexpr(F32["S5"])
S7: tl.constexpr = tl.constexpr(F32["S7"])
S9: tl.constexpr = tl.constexpr(F32["S9"])
LOG_SHIFT_C: tl.constexpr = tl.constexpr(LOG_SHIFT)
LOG_M_LOW_BITS_C: tl.constexpr = tl.constexpr(LOG_M_LOW_BITS)


@triton.jit
def uniform_f32(x):
    """uint32 Philox word -> float32 in [0, 1), as Triton's uint_to_uniform_float."""
    x = x.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * UNIFORM_SCALE


@triton.jit
def log_f32(u):
    """log(u) for positive normal float32 u: sicl_fast.step.rng.log_f32's op sequence."""
    ix = u.to(tl.int32, bitcast=True) + LOG_SHIFT_C
    e = ((ix >> 23) - 127).to(tl.float32)
    m = ((ix & 0x7FFFFF) + LOG_M_LOW_BITS_C).to(tl.float32, bitcast=True)
    fm = m - 1.0
    s = tl.math.div_rn(fm, fm + 2.0)
    z = s * s
    q = z * L11 + L9
    q = q * z + L7
    q = q * z + L5
    q = q * z + L3
    t = s * 2.0
    log_m = t + t * (z * q)
    return e * LN2_HI + (e * LN2_LO + log_m)


@triton.jit
def cos_2pi_f32(u):
    """cos(2 pi u) for float32 u in [0, 1): sicl_fast.step.rng.cos_2pi_f32's op sequence."""
    t = tl.where(u >= 0.5, 1.0 - u, u)
    neg = t > 0.25
    t = tl.where(neg, 0.5 - t, t)
    use_sin = t > 0.125
    v = tl.where(use_sin, 0.25 - t, t)
    x = v * TWO_PI
    x2 = x * x
    c = x2 * C10 + C8
    c = c * x2 + C6
    c = c * x2 + C4
    c = c * x2 + C2
    c = c * x2 + 1.0
    s = x2 * S9 + S7
    s = s * x2 + S5
    s = s * x2 + S3
    s = x + x * (x2 * s)
    r = tl.where(use_sin, s, c)
    return tl.where(neg, -r, r)


@triton.jit
def randn_f32(seed64, counter):
    """float32 N(0, 1) for int32 counters under the 64-bit key seed64 (= seed + step * 2**32)."""
    i1, i2, _, _ = tl.randint4x(seed64, counter)
    u1 = uniform_f32(i1)
    u2 = uniform_f32(i2)
    u1 = tl.where(u1 < U1_MIN, U1_MIN, u1)
    r = tl.sqrt_rn(log_f32(u1) * -2.0)
    return r * cos_2pi_f32(u2)


@triton.jit(do_not_specialize=["seed64"])
def _randn_kernel(out_ptr, seed64, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, randn_f32(seed64, offs), mask=mask)


def randn(seed: int, step: int, num: int, rows: int, d: int, device="cuda") -> torch.Tensor:
    """U [num, rows, d] float32, bit-identical to sicl_fast.step.rng.directions(seed, step, num, rows, d).

    device: "cuda", or "cpu" under TRITON_INTERPRET=1.
    """
    check_counter_range(num, rows, d)
    n = num * rows * d
    out = torch.empty(num, rows, d, dtype=torch.float32, device=device)
    if n == 0:
        return out
    cfg = randn_config()
    launch(_randn_kernel, (triton.cdiv(n, cfg["BLOCK"]),), out, step_seed(seed, step), n, device=out.device, **cfg)
    return out


def randn_config(interp: bool | None = None) -> dict:
    """BLOCK (1024 elements a program; 65536 under the interpreter), num_warps and the exact float32 options (the
    noise bit for bit: step.rng) of a launch (_utils.launch_config)."""
    return launch_config("triton randn", interp, block=1024, BLOCK=1024, **EXACT, interpreter={"BLOCK": 1 << 16})
