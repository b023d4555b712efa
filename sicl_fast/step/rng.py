"""Counter-based Gaussian noise: Philox4x32-10 + Box-Muller, the reference of every noise path.

The perturbation directions U_i are a pure function of (seed, step, i, element), so every path (this torch
reference, the Triton kernels in `sicl_fast.kernels`, the C++ extension `sicl_fast.ops._C`) draws the same
directions and a kernel can regenerate them for the gradient instead of storing them.

Keying (shared by all paths):
    philox key     = (seed, step)   i.e. the 64-bit Triton seed  seed + step * 2**32
    philox counter = (i * rows * d + r * d + c, 0, 0, 0)   for direction i, perturbed row r, column c (int32)
    U[i, r, c]     = Box-Muller(first two 32-bit outputs), first (cosine) branch, in float32

Integers: the Philox words and the int -> uniform map are exactly those of Triton's `tl.randint4x` /
`uint_to_uniform_float` (the kernels call `tl.randint4x`). The normals themselves are not `tl.randn`'s: that one
uses the platform's log / cos, whose last bits differ between the interpreter (numpy), the GPU (libdevice),
torch and C++; the kernels never call `tl.randn`.

Floats: the Box-Muller transform does NOT use a libm log / cos (torch, numpy, CUDA's libdevice and glibc all
round those differently, so the outputs would differ by an ulp here and there). Every path instead evaluates
the same fixed sequence of correctly rounded float32 operations (+ - * / sqrt, int <-> float conversions and
bit casts), defined by `box_muller` below:

    u1 = max(int_to_uniform(i1), 1e-7)         u2 = int_to_uniform(i2)
    log(u1):  u1 = m * 2**e with m in [sqrt(1/2), sqrt(2)) (bit manipulation), s = (m - 1) / (m + 1),
              log(m) = 2 s (1 + s^2 (1/3 + s^2 (1/5 + s^2 (1/7 + s^2 (1/9 + s^2 / 11)))))   (atanh series),
              log(u1) = e * ln2_hi + (e * ln2_lo + log(m))                                 (max error ~3 ulp)
    cos(2 pi u2): fold u2 into v in [0, 1/8] with exact subtractions (1 - u, 1/2 - u, 1/4 - u), then a
              Taylor polynomial of cos or sin at x = 2 pi v, x in [0, pi/4]            (max error ~2e-7 abs)
    U = sqrt(-2 log u1) * cos(2 pi u2)

With no FMA contraction (Triton kernels are launched with enable_fp_fusion=False and use div_rn / sqrt_rn; the
C++ code is compiled with fp-contract off) every path yields the same bits. (torch's own float32 sqrt is not
correctly rounded on AVX-512 CPUs, so this reference takes the float64 sqrt and rounds it to float32, which is.)
The polynomials are more accurate than float32 libm on the rounded argument 2 pi u2; the normal-quality tests
check mean / variance / tails / Kolmogorov-Smirnov (tests/test_kernel_rng.py).
"""
from __future__ import annotations

import torch

from ..errors import SiclError

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
MAX_COUNTER = 2**31 - 1  # counters are int32 in the kernels

# float32 constants of the transform, as exact float32 values (hex) so every path parses the same bits.
F32 = {
    "UNIFORM_SCALE": float.fromhex("0x1.fffffep-32"),  # 4.6566127342e-10: Triton's; INT32_MAX * scale < 1
    "U1_MIN": float.fromhex("0x1.ad7f2ap-24"),  # 1e-7 in float32: Triton's clamp of u1
    "LN2_HI": float.fromhex("0x1.62ep-1"),  # ln 2 with its low 12 mantissa bits zero: e * LN2_HI is exact
    "LN2_LO": float.fromhex("0x1.0bfbe8p-15"),  # float32(ln 2 - LN2_HI)
    "L3": float.fromhex("0x1.555556p-2"),  # 1/3
    "L5": float.fromhex("0x1.99999ap-3"),  # 1/5
    "L7": float.fromhex("0x1.24924ap-3"),  # 1/7
    "L9": float.fromhex("0x1.c71c72p-4"),  # 1/9
    "L11": float.fromhex("0x1.745d18p-4"),  # 1/11
    "TWO_PI": float.fromhex("0x1.921fb6p+2"),  # float32(2 pi)
    "C2": float.fromhex("-0x1p-1"),  # -1/2!
    "C4": float.fromhex("0x1.555556p-5"),  # 1/4!
    "C6": float.fromhex("-0x1.6c16c2p-10"),  # -1/6!
    "C8": float.fromhex("0x1.a01a02p-16"),  # 1/8!
    "C10": float.fromhex("-0x1.27e4fcp-22"),  # -1/10!
    "S3": float.fromhex("-0x1.555556p-3"),  # -1/3!
    "S5": float.fromhex("0x1.111112p-7"),  # 1/5!
    "S7": float.fromhex("-0x1.a01a02p-13"),  # -1/7!
    "S9": float.fromhex("0x1.71de3ap-19"),  # 1/9!
}
# integer constants of the log range reduction: bits(sqrt(1/2)) and the shift that puts m in [sqrt(1/2), sqrt(2))
LOG_M_LOW_BITS = 0x3F3504F3
LOG_SHIFT = 0x3F800000 - 0x3F3504F3


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, for a python uint32 and an int64 tensor of uint32s.

    Split b into 16-bit halves so every partial product fits in int64.
    """
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    p_lo = a * b_lo  # < 2**48
    p_hi = a * b_hi  # < 2**48
    mid = p_hi + (p_lo >> 16)  # < 2**49
    hi = mid >> 16
    lo = ((mid & 0xFFFF) << 16) | (p_lo & 0xFFFF)
    return hi & _MASK32, lo & _MASK32


def philox4x32(counter: torch.Tensor, key_lo, key_hi, rounds: int = 10):
    """Philox4x32 on counters (c0 = counter, c1 = c2 = c3 = 0). counter: int64 tensor of values in [0, 2**32).
    key_lo, key_hi: python ints, or int64 0-d tensors on counter's device (a key read from device state).

    Returns the four output words as int64 tensors holding uint32 values.
    """
    c0 = counter.to(torch.int64) & _MASK32
    zero = torch.zeros_like(c0)
    c1, c2, c3 = zero, zero.clone(), zero.clone()
    k0, k1 = key_lo & _MASK32, key_hi & _MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _uint_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """uint32 (in int64) -> float32 uniform in [0, 1), exactly as Triton's uint_to_uniform_float."""
    x = torch.where(x >= 2**31, x - 2**32, x)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.int32).to(torch.float32) * F32["UNIFORM_SCALE"]


def log_f32(u: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values by the fixed op sequence of the module docstring."""
    k = F32
    ix = u.view(torch.int32) + LOG_SHIFT
    e = ((ix >> 23) - 127).to(torch.float32)
    m = ((ix & 0x7FFFFF) + LOG_M_LOW_BITS).view(torch.float32)  # in [sqrt(1/2), sqrt(2))
    fm = m - 1.0  # exact
    s = fm / (fm + 2.0)
    z = s * s
    q = z * k["L11"] + k["L9"]
    q = q * z + k["L7"]
    q = q * z + k["L5"]
    q = q * z + k["L3"]
    t = s * 2.0
    log_m = t + t * (z * q)
    return e * k["LN2_HI"] + (e * k["LN2_LO"] + log_m)


def cos_2pi_f32(u: torch.Tensor) -> torch.Tensor:
    """cos(2 pi u) for float32 u in [0, 1) by the fixed op sequence of the module docstring."""
    k = F32
    t = torch.where(u >= 0.5, 1.0 - u, u)  # [0, 1/2], exact
    neg = t > 0.25
    t = torch.where(neg, 0.5 - t, t)  # [0, 1/4], cos changes sign
    use_sin = t > 0.125
    v = torch.where(use_sin, 0.25 - t, t)  # [0, 1/8]: cos(2 pi t) = sin(2 pi v)
    x = v * k["TWO_PI"]
    x2 = x * x
    c = x2 * k["C10"] + k["C8"]
    c = c * x2 + k["C6"]
    c = c * x2 + k["C4"]
    c = c * x2 + k["C2"]
    c = c * x2 + 1.0
    s = x2 * k["S9"] + k["S7"]
    s = s * x2 + k["S5"]
    s = s * x2 + k["S3"]
    s = x + x * (x2 * s)
    r = torch.where(use_sin, s, c)
    return torch.where(neg, -r, r)


def box_muller(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """float32 N(0, 1) from two float32 uniforms in [0, 1) (first Box-Muller branch, fixed op sequence)."""
    u1 = torch.where(u1 < F32["U1_MIN"], torch.full_like(u1, F32["U1_MIN"]), u1)
    # torch's float32 sqrt is not correctly rounded on the CPU (SLEEF); the float64 sqrt rounded to float32 is
    r = torch.sqrt((log_f32(u1) * -2.0).double()).float()
    return r * cos_2pi_f32(u2)


def randn_counters(counter: torch.Tensor, seed64: int) -> torch.Tensor:
    """float32 N(0, 1) for each int64 counter (< 2**31), bit-identical to the kernels' randn for the same key.

    The integers are Triton's tl.randint4x(seed64, counter) words 0 and 1; the transform is `box_muller`.
    """
    return randn_keyed(counter, seed64 & _MASK32, (seed64 >> 32) & _MASK32)


def randn_keyed(counter: torch.Tensor, key_lo, key_hi) -> torch.Tensor:
    """randn_counters with the Philox key given as its two words (ints, or 0-d int64 tensors on the device)."""
    i1, i2, _, _ = philox4x32(counter, key_lo, key_hi)
    return box_muller(_uint_to_uniform(i1), _uint_to_uniform(i2))


def step_seed(seed: int, step: int) -> int:
    """The 64-bit Philox seed of one ascent step: key = (seed, step)."""
    if not 0 <= seed < 2**32:
        raise SiclError(f"seed must be in [0, 2**32), got {seed}")
    if not 0 <= step < 2**32:
        raise SiclError(f"step must be in [0, 2**32), got {step}")
    return seed + (step << 32)


def check_counter_range(num: int, rows: int, d: int) -> None:
    """The kernels use int32 counters: num * rows * d must stay below 2**31."""
    if num * rows * d > MAX_COUNTER + 1:
        raise SiclError(
            f"too many noise elements for int32 Philox counters: {num} directions x {rows} rows x {d} dims "
            f"= {num * rows * d} > 2**31; use fewer directions or a shorter demonstration block"
        )


def directions(seed: int, step, num: int, rows: int, d: int, device=None, live=None) -> torch.Tensor:
    """U [num, rows, d] float32: the Gaussian directions of one ascent step (see module docstring).

    step: an int, or an int64 tensor of one element on `device` (the step counter of a loop that keeps its state
    on the device: read there, never on the host). live: None, or an int64 [1] tensor on `device` holding the rows
    that are drawn, R <= rows (a length bucket's padded block, sicl_fast.run.buckets): rows [0, R) are the
    directions of an R-row block, the counters laid out for R, and rows [R, rows) are zero."""
    check_counter_range(num, rows, d)
    if live is None:
        counter = torch.arange(num * rows * d, dtype=torch.int64, device=device)
    else:  # the counters of an R-row block, read on the device: i * R * d + r * d + c
        i = torch.arange(num, dtype=torch.int64, device=device).view(num, 1, 1)
        r = torch.arange(rows, dtype=torch.int64, device=device).view(1, rows, 1)
        c = torch.arange(d, dtype=torch.int64, device=device).view(1, 1, d)
        R = live.reshape(()).to(torch.int64)
        inside = r < R
        counter = torch.where(inside, i * R * d + r * d + c, 0).flatten()
    if isinstance(step, torch.Tensor):
        step_seed(seed, 0)  # checks the seed
        U = randn_keyed(counter, seed, step.reshape(()).to(torch.int64))
    else:
        U = randn_counters(counter, step_seed(seed, step))
    U = U.view(num, rows, d)
    return U if live is None else torch.where(inside, U, 0.0)
