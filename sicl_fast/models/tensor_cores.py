"""How a GPU's tensor cores round a float32 product, emulated in torch: what the precision study runs on the CPU (and
the tests hold the Triton kernels to), where the kernels' own compile has no CPU form of its rounding.

A tensor core multiplies tf32 (10 explicit mantissa bits) or bf16 (7) operands; a float32 product taken there is a sum
of products of pieces (Triton's input_precision, kernels/attention.py):

    tf32x3    a = a_hi + a_lo, a_hi = cvt.rna.tf32(a) (nearest, ties away from zero), a_lo = a - a_hi exact in float32
              and read by the tensor core as tf32 (its low 13 bits dropped); a.b = a_lo.b_hi + a_hi.b_lo + a_hi.b_hi
              (a_lo.b_lo left out): about 21 of float32's 24 bits
    bf16xN    Triton's bf16x3 / bf16x6: 2 / 3 bf16 pieces (nearest even), 3 / 6 of their products (Triton's order)

    tf32_rna(x), tf32_trunc(x) -> float32 values             the two roundings of tf32x3
    pieces(x, precision) -> (hi, lo, ...)                     a float32 tensor's pieces, each a float32 tensor
    tc_matmul(a [.., M, K], b [.., K, N], precision) -> [.., M, N] float32
    tc_accumulate(a, b, group) -> float32                     the accumulation model of one tensor-core product

tc_matmul takes each product of pieces exactly (a product of two tf32 or bf16 values is a float32 value) and sums in
float32 as torch does (round to nearest): the operands' rounding, which is the precision's own, exactly as the GPU
does it; the tensor core's accumulation is not its bits. That accumulation (`tc_accumulate`) is modelled, not
documented by NVIDIA: each group of `group` products summed exactly and added to the float32 accumulator rounded
toward zero (truncation: about one float32 ulp of the running sum lost a group, always toward zero, where the
CUDA cores' round-to-nearest errs both ways). It is too slow for a whole model (a Python loop over K / group),
so the precision study runs tc_matmul, and bench/tensor_core_products.py measures what the accumulation adds at the
products' real inner sizes.

'ieee' is no emulation: plain torch.matmul in float32.
"""
from __future__ import annotations

import torch

from ..errors import SiclError

PRECISIONS = ("ieee", "tf32x3", "bf16x3", "bf16x6")
_TF32_MASK = -(1 << 13)  # int32 0xFFFFE000: sign, exponent and the 10 explicit mantissa bits of tf32
_TF32_HALF = 1 << 12  # half a tf32 ulp, in the float32 bits

# (i, j): the product of a's piece i and b's piece j, in the order Triton's F32DotTC pass accumulates them (the
# products after the first ones' NaN mask: PRODUCTS[p][MASK_AFTER[p]:])
PRODUCTS = {"tf32x3": ((1, 0), (0, 1), (0, 0)), "bf16x3": ((1, 0), (0, 1), (0, 0)),
            "bf16x6": ((1, 1), (2, 0), (0, 2), (1, 0), (0, 1), (0, 0))}
MASK_AFTER = {"tf32x3": 2, "bf16x3": 2, "bf16x6": 5}


def check_precision(precision: str, what: str = "tensor-core precision") -> str:
    if precision not in PRECISIONS:
        raise SiclError(f"{what}: {precision!r} is not one of {PRECISIONS}")
    return precision


def tf32_rna(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to tf32 (10 explicit mantissa bits), to nearest, ties away from zero: PTX's
    cvt.rna.tf32.f32, by integer arithmetic on the bits (a carry into the exponent rounds up a binade, or to inf;
    inf stays inf, NaN stays NaN)."""
    bits = x.contiguous().view(torch.int32)
    r = ((bits + _TF32_HALF) & _TF32_MASK).view(torch.float32)
    return torch.where(torch.isnan(x), x, r)


def tf32_trunc(x: torch.Tensor) -> torch.Tensor:
    """float32 x as a tensor core reads it as a tf32 operand: the low 13 mantissa bits dropped (toward zero)."""
    return (x.contiguous().view(torch.int32) & _TF32_MASK).view(torch.float32)


def pieces(x: torch.Tensor, precision: str) -> tuple:
    """The pieces (float32 tensors holding tf32 or bf16 values) whose sum is what the precision keeps of x: tf32x3
    (hi, lo), bf16x3 (hi, mid), bf16x6 (hi, mid, lo)."""
    x = x.float()
    if precision == "tf32x3":
        hi = tf32_rna(x)
        return hi, tf32_trunc(x - hi)
    n = {"bf16x3": 2, "bf16x6": 3}[check_precision(precision)]
    out, rest = [], x
    for _ in range(n):
        p = rest.to(torch.bfloat16).float()
        out.append(p)
        rest = rest - p
    return tuple(out)


def tc_matmul(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b (float32, torch.matmul's broadcasting) with the operands rounded as `precision` rounds them on the
    tensor cores (module docstring): the pieces' products in Triton's order, summed in float32, the first products'
    NaN (0 x inf of a piece that is 0) replaced by 0 as Triton does. 'ieee': torch.matmul."""
    if check_precision(precision) == "ieee":
        return torch.matmul(a.float(), b.float())
    return _chained(a, b, precision, lambda x, y, acc: torch.matmul(x, y) if acc is None else
                    acc.add_(torch.matmul(x, y)))


def _chained(a: torch.Tensor, b: torch.Tensor, precision: str, product) -> torch.Tensor:
    """The pieces' products in Triton's order through one accumulator, acc = product(a's piece, b's piece, acc) (acc
    None for the first), the first products' NaN (0 x inf of a piece that is 0) replaced by 0 as Triton does."""
    pa, pb = pieces(a, precision), pieces(b, precision)
    acc = None
    for n, (i, j) in enumerate(PRODUCTS[precision]):
        if n == MASK_AFTER[precision]:
            acc = torch.nan_to_num(acc, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        acc = product(pa[i], pb[j], acc)
    return acc


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float64 x -> float32, rounded toward zero (the nearest float32 of x, stepped toward 0 where it is larger)."""
    y = x.float()
    return torch.where(y.double().abs() > x.abs(), torch.nextafter(y, torch.zeros_like(y)), y)


def tc_accumulate(a: torch.Tensor, b: torch.Tensor, group: int, acc: torch.Tensor | None = None) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] as the accumulation model (module docstring) takes it on a tensor core: a and b hold
    tf32 or bf16 values (their products exact); each group of `group` products along K summed exactly (float64) and
    added to the float32 accumulator (`acc`, zeros by default) rounded toward zero. -> float32."""
    a, b = a.double(), b.double()
    K = a.shape[-1]
    out = torch.zeros(torch.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1])),
                      dtype=torch.float32, device=a.device) if acc is None else acc
    for k0 in range(0, K, group):
        out = round_toward_zero(out.double() + a[..., k0:k0 + group] @ b[..., k0:k0 + group, :])
    return out


def tc_matmul_model(a: torch.Tensor, b: torch.Tensor, precision: str, group: int) -> torch.Tensor:
    """tc_matmul with the accumulation model: the pieces' products chained through one accumulator in Triton's
    order, each by tc_accumulate (the NaN mask as tc_matmul's)."""
    return _chained(a, b, precision, lambda x, y, acc: tc_accumulate(x, y, group, acc))


__all__ = ["PRECISIONS", "PRODUCTS", "check_precision", "tf32_rna", "tf32_trunc", "pieces", "tc_matmul",
           "round_toward_zero", "tc_accumulate", "tc_matmul_model"]
