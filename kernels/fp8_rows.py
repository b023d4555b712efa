"""FP8 e4m3 rows, a scale each (DecoderOps.fp8_rows), one launch: the difference rows of an FP8 product
(sicl_fast.models.projections), quantised for torch._scaled_mm.

    fp8_rows(x [M, k] bf16 / float32) -> (q [M, k] float8 e4m3fn, scale [M, 1] float32)
    scale = max_j |x_ij| / 448 (1 for a zero row);  q = e4m3(x / scale), both divisions correctly rounded
    (div_rn), the conversion rounded to nearest even by integer arithmetic (e4m3_bits): the bits of the reference,
    sicl_fast.models.weights.fp8_rows (torch's conversion, c10's fp8e4m3fn_from_fp32_value), on a GPU and in
    Triton's CPU interpreter alike (neither's own cast is promised to round that way).

GPU design. Memory-bound: one program a row, a first pass over the row in BLOCK columns for its largest magnitude,
a second that quantises (the row, a product's input of k <= 14336 columns: 28 KiB in bf16, comes from HBM once and
from L2 again); 2 bytes read and 1 written an element, where the separate torch ops (abs, amax, the scale, the
cast, the division, the conversion) made six passes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError

from ._utils import check_device, check_dtype, launch, launch_config, next_pow2

MAX_BLOCK = 2048  # columns a program holds at once (8 warps: 8 elements a thread)


@triton.jit
def e4m3_bits(x):
    """float32 x -> the uint8 bits of its float8 e4m3fn value, rounded to nearest even; |x| >= 480 and NaN -> NaN
    (0x7F, with x's sign), [448, 480) -> 448: torch's conversion (c10's fp8e4m3fn_from_fp32_value), step for step."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    a = bits & 0x7FFFFFFF
    # below 2^-6 (e4m3's subnormals): the float32 sum with 2^14 rounds the value to a multiple of 2^-9, to nearest
    # even, and its low bits are the result
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    # normal values: the exponent rebased (bias 127 -> 7) and the mantissa rounded to 3 bits, to nearest even
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    r = tl.where(a >= (1087 << 20), 0x7F, tl.where(a < (121 << 23), sub, normal))
    return ((r & 0x7F) | (sign << 7)).to(tl.uint8)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * k
    top = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < k, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    amax = tl.max(top, axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([], 448.0, tl.float32)), 1.0)
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < k
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + base + cols, e4m3_bits(tl.math.div_rn(x, tl.zeros_like(x) + scale)), mask=mask)


def fp8_rows_config(k: int, interp: bool | None = None) -> dict:
    """The launch configuration over rows of k columns (kernels._utils.launch_config), the GPU's and the
    interpreter's alike: BLOCK, the columns a program takes at once, and its warps."""
    block = min(next_pow2(k), MAX_BLOCK)
    return launch_config("fp8_rows", interp, block=block, BLOCK=block)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, k] float8 e4m3fn, scale [M, 1] float32) of x [M, k] bf16 / float32 (module docstring). One launch."""
    op = "triton fp8_rows"
    check_dtype(x, (torch.bfloat16, torch.float32), "x", op)
    if x.dim() != 2:
        raise SiclError(f"{op}: x must have shape [M, k], got {list(x.shape)}")
    dev = check_device(x, op=op)
    M, k = x.shape
    x = x.contiguous()
    q = torch.empty(M, k, dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty(M, 1, dtype=torch.float32, device=dev)
    if M and k:
        launch(_fp8_rows_kernel, (M,), x, q.view(torch.uint8), scale, k, device=dev, **fp8_rows_config(k))
    return q, scale


__all__ = ["fp8_rows", "fp8_rows_config", "e4m3_bits"]
