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
from ._utils import check_device, check_dtype, check_shape, launch, launch_config


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


def split_config(n: int, interp: bool | None = None) -> dict:
    """The launch configuration over n elements (kernels._utils.launch_config): BLOCK, the elements of x a program
    takes, 1024 on a GPU (4 warps, 8 elements a thread), 2^16 under the interpreter, which pays per program; never
    more than the next power of two of n."""
    top = triton.next_power_of_2(max(1, n))
    return launch_config("split_bf16", interp, block=min(top, 1024), BLOCK=min(top, 1024),
                         interpreter={"BLOCK": min(top, 1 << 16)})


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
    cfg = split_config(N)
    launch(_split_bf16_kernel, (triton.cdiv(N, cfg["BLOCK"]),), x, out, N, device=dev, PIECES=pieces, **cfg)
    return out
