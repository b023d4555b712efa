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
def gated_act(g, ACT: tl.constexpr):
    """The MLP activation of float32 g: ACT 0 SiLU, 1 GELU-tanh, 2 GELU-erf (codes: kernels.gated.ACT_CODES)."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        a = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    return a
