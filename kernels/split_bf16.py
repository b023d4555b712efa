"""Float32 rows as a sum of bf16 pieces (DecoderOps.split_bf16), one launch: what a bf16 weight's float32 product
takes in the difference form's reference pass (sicl_fast.models.reference: the pieces through one bf16 product with
float32 accumulation, then summed).

    split_bf16(x [n, k] f32, pieces) -> [pieces, n, k] bf16
    piece 0 = bf16(x), piece j = bf16(x - piece 0 - ... - piece j-1), each rounded to nearest even
    (kernels._math.to_bf16), the remainders in float32 (exact: a rounding's remainder is a float32 value)

Reference: sicl_fast.models.reference.split_bf16_reference (bit for bit). Memory-bound: one read of x, pieces
writes of half its size; a program takes BLOCK contiguous elements (split_config).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._math import to_bf16
from ._utils import check_device, check_dtype, check_shape, interpreting, launch


@triton.jit
def _split_bf16_kernel(x_ptr, out_ptr, N, PIECES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    rest = tl.load(x_ptr + offs, mask=mask, other=0.0)
    out = out_ptr + offs  # piece j at j * N: the pointers step by N (64-bit addresses, no 32-bit j * N)
    for _ in tl.static_range(PIECES):
        piece = to_bf16(rest)
        tl.store(out, piece, mask=mask)
        rest = rest - piece.to(tl.float32)
        out += N


def split_config(n: int, interp: bool) -> int:
    """BLOCK, the elements of x a program takes: 1024 on a GPU (4 warps, 8 elements a thread), 2^16 under the
    interpreter, which pays per program; never more than the next power of two of n."""
    return min(triton.next_power_of_2(max(1, n)), 1 << 16 if interp else 1024)


def split_bf16(x: torch.Tensor, pieces: int = 3) -> torch.Tensor:
    """The bf16 pieces [pieces, n, k] of float32 rows x [n, k] (module docstring). One launch."""
    op = "triton split_bf16"
    check_shape(x, (None, None), "x", op)
    check_dtype(x, torch.float32, "x", op)
    dev = check_device(x, op=op)
    x = x.contiguous()
    out = torch.empty(pieces, *x.shape, dtype=torch.bfloat16, device=dev)
    N = x.numel()
    if N == 0:
        return out
    BLOCK = split_config(N, interpreting())
    launch(_split_bf16_kernel, (triton.cdiv(N, BLOCK),), x, out, N, device=dev, block=BLOCK, PIECES=pieces,
           BLOCK=BLOCK)
    return out
