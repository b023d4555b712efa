"""Device functions shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # tanh from exp, stable for any |x|: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def to_bf16(x):
    """float32 -> bfloat16, rounded to nearest even by integer arithmetic: the same bits on a GPU and in Triton's
    CPU interpreter (whose own cast truncates). NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), r)


@triton.jit
def erfc_pos(x):
    """erfc(x) for float32 x >= 0, to about 1.2e-7 relative everywhere (Numerical Recipes' erfcc: exp(-x^2) times
    a Chebyshev-fitted factor), so erfc's small values keep their relative precision where 1 - erf(x) would cancel."""
    t = 1.0 / (1.0 + 0.5 * x)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    return t * tl.exp(-x * x - 1.26551223 + t * p)


@triton.jit
def tanh_torch(y):
    """tanh of float32 y as the tanh inside torch's CPU GELU rounds it (Sleef's: within about half an ulp), for
    GELU-tanh's 1 + tanh, whose cancellation a difference row must share with the reference: 1 - 2 / (exp(2|y|) + 1),
    whose small term s = 2 / (e + 1) carries a few ulps of its own, of s, not of 1 - s: 1 - s rounds as the true
    value does but where it falls that close to a rounding boundary, rarely where s is small (the tail that cancels);
    exactly +-1 past |y| 8.664339742 as that tanh (csrc/rows.cpp's tanh_torch, the C++ form's). Measured against
    F.gelu(approximate='tanh') on 2e6 gates in [-6, 4]: 333 of the 6e5 below -3 differ (by one step of 1 + tanh),
    8 % of the others by an ulp."""
    a = tl.abs(y)
    t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(a, 10.0)) + 1.0)
    t = tl.where(a > 8.664339742, 1.0, t)
    return tl.where(y < 0, -t, t)


@triton.jit
def gated_act(g, ACT: tl.constexpr):
    """The MLP activation of float32 g: ACT 0 SiLU, 1 GELU-tanh, 2 GELU-erf (codes: kernels.gated.ACT_CODES).
    SiLU and GELU-tanh as torch computes them, operation for operation (launch without FMA contraction to keep its
    roundings): g / (1 + exp(-g)); (0.5 g) (1 + tanh(beta (g + kappa g^3))) with tanh_torch: below g ~ -3 its
    1 + tanh cancels and keeps few bits, and the same float32 tanh gives the reference's bits (a difference row's
    change is that small). GELU-erf without cancellation, 0.5 g erfc(-g / sqrt 2) for g < 0 (a tail value keeps its
    relative precision: torch's CPU erf is an approximation whose 1 + erf the difference form could not share)."""
    if ACT == 0:  # the exponent capped (g / (1 + e^88) is 0 to float32's eye): no overflow warning in numpy
        a = g / (1.0 + tl.exp(tl.minimum(-g, 88.0)))
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        a = (0.5 * g) * (1.0 + tanh_torch(inner))
    else:
        x = g * 0.7071067811865476
        a = tl.where(g < 0, 0.5 * g * erfc_pos(tl.abs(x)), 0.5 * g * (1.0 + tl.math.erf(x)))
    return a
