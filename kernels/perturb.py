"""The perturbation batch of one ascent step, noise drawn in the kernel (step.zo.perturb's function).

    perturb(X [L, d] float32, step, spec: StepSpec) -> out [B, b, d] float32

Batch layout (sicl_fast.step.zo):
    forward:  out[0] = X[:b],  out[1 + i] = X[:b] + mu U_i on rows [a, b)                       (B = N + 1)
    central:  out[0] = X[:b],  out[1 + 2i] = X[:b] + mu U_i,  out[2 + 2i] = X[:b] - mu U_i        (B = 2N + 1)
U_i[r, c] = randn(seed + step * 2**32, counter = i * R * d + r * d + c), R = b - a: the same bits as
sicl_fast.step.rng.directions and the C++ extension. U is never stored. A length bucket's padded block
(rows_end, read on the device: sicl_fast.step.zo) takes b = rows_end for the noise; out keeps spec.b rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sicl_fast.errors import SiclError
from sicl_fast.step.spec import StepSpec, f32

from ._utils import EXACT, check_device, check_dtype, launch, launch_config, rows_end_arg, step_key
from .randn import randn_f32


@triton.jit(do_not_specialize=["seed64"])
def _perturb_kernel(
    x_ptr,  # [L, d] float32, contiguous
    out_ptr,  # [B, n, d] float32, contiguous
    seed64,  # seed + step * 2**32; with STEP_PTR: the seed alone, the step read from step_ptr
    step_ptr,  # int64 [1] on the device (read when STEP_PTR)
    end_ptr,  # int64 [1] on the device: the block's end b (read when END_PTR)
    n,  # rows per batch entry (spec.b)
    d,
    a,
    b,
    mu,  # float32
    CENTRAL: tl.constexpr,
    STEP_PTR: tl.constexpr,
    END_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if STEP_PTR:
        seed64 = seed64 + (tl.load(step_ptr).to(tl.int64) << 32)
    if END_PTR:
        b = tl.load(end_ptr).to(tl.int32)
    j = tl.program_id(0)  # batch row
    pid = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat index into [n, d]
    total = n * d
    mask = offs < total
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dst = out_ptr + j.to(tl.int64) * total + offs
    lo = a * d
    hi = b * d
    block_lo = pid * BLOCK
    touches = (j > 0) & (block_lo < hi) & (block_lo + BLOCK > lo)
    if touches:
        if CENTRAL:
            i = (j - 1) // 2
            sign = 1.0 - 2.0 * ((j - 1) % 2).to(tl.float32)
        else:
            i = j - 1
            sign = 1.0
        R = b - a
        counter = i * R * d + (offs - lo)
        inside = (offs >= lo) & (offs < hi)
        u = randn_f32(seed64, tl.where(inside, counter, 0))
        step_ = mu * u
        y = tl.where(sign > 0, x + step_, x - step_)
        tl.store(dst, tl.where(inside, y, x), mask=mask)
    else:
        tl.store(dst, x, mask=mask)


def perturb(X: torch.Tensor, step, spec: StepSpec, out: torch.Tensor | None = None,
            block: int | None = None, rows_end: torch.Tensor | None = None) -> torch.Tensor:
    """The perturbation batch [B, b, d] float32 (module docstring). X: [L, d] float32 on CUDA (or the CPU
    under TRITON_INTERPRET=1). step: an int, or an int64 [1] tensor on X's device (read in the kernel: no host
    value changes between steps, so the launch can be captured in a CUDA graph). out: optional preallocated
    [B, b, d] float32 contiguous buffer. block: elements per program (a power of two; default 1024, 4096 in the
    interpreter). rows_end: a length bucket's block end (module docstring), or None."""
    op = "triton perturb"
    check_device(X, op=op)
    check_dtype(X, torch.float32, "X", op)
    spec.check_X(X, "X", op)
    B, b, d = spec.B, spec.b, spec.d
    X = X.contiguous()
    if out is None:
        out = torch.empty(B, b, d, dtype=torch.float32, device=X.device)
    elif tuple(out.shape) != (B, b, d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise SiclError(f"{op}: out must be a contiguous float32 [{B}, {b}, {d}] tensor, got "
                        f"{out.dtype} {list(out.shape)}")
    cfg = perturb_config(block)
    grid = (B, triton.cdiv(b * d, cfg["BLOCK"]))
    seed64, step_ptr, from_ptr = step_key(spec.seed, step, X.device, op)
    end_ptr, end_from_ptr = rows_end_arg(rows_end, X.device, op)
    launch(_perturb_kernel, grid, X, out, seed64, step_ptr, end_ptr, b, d, spec.a, b, f32(spec.mu), device=X.device,
           CENTRAL=spec.central, STEP_PTR=from_ptr, END_PTR=end_from_ptr, **cfg)
    return out


def perturb_config(block: int | None = None, interp: bool | None = None) -> dict:
    """BLOCK (elements a program: `block`, else 1024, 4096 under the interpreter), num_warps and the exact float32
    options (the noise bit for bit: step.rng) of a launch (_utils.launch_config)."""
    return launch_config("triton perturb", interp, block=block or 1024, BLOCK=block or 1024, **EXACT,
                         interpreter=None if block else {"BLOCK": 4096})
