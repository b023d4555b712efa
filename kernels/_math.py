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
