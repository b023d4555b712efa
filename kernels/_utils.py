"""Shared launcher helpers: tensor checks with clear errors, interpreter detection, and the one way every launcher
launches (`launch`: the number of warps from the block size, the device guard). (The step's arguments are checked
once, by sicl_fast.step.spec.StepSpec; the proxy's by sicl_fast.step.proxy.ProxyPlan and
check_logprobs.)"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import triton

from sicl_fast.errors import SiclError
from sicl_fast.step.rng import step_seed

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The RNG / update kernels must evaluate exactly the op sequence of sicl_fast.step.rng: no FMA contraction.
EXACT = {"enable_fp_fusion": False}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor, op: str) -> torch.device:
    """All tensors on one device; CUDA, or the CPU under TRITON_INTERPRET=1."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise SiclError(f"{op}: tensors are on different devices ({dev} and {t.device})")
    if dev.type != "cuda" and not interpreting():
        raise SiclError(
            f"{op}: the Triton kernel needs CUDA tensors (got {dev}); on the CPU set TRITON_INTERPRET=1 before "
            "triton is imported, or use the torch / C++ path"
        )
    return dev


def check_shape(t: torch.Tensor, shape: tuple, name: str, op: str) -> None:
    """shape entries: ints, or None for 'any'."""
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise SiclError(f"{op}: {name} must have shape {want}, got {list(t.shape)}")


def check_dtype(t: torch.Tensor, dtypes, name: str, op: str) -> None:
    if not isinstance(dtypes, (tuple, list)):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise SiclError(f"{op}: {name} must be {names}, got {str(t.dtype).replace('torch.', '')}")


_DUMMY: dict = {}


def step_key(seed: int, step, device, op: str):
    """(seed64 argument, step pointer, STEP_PTR) for the noise kernels. An int step is folded into the 64-bit
    seed on the host; an int64 [1] device tensor is passed as a pointer and read in the kernel (a captured CUDA
    graph replays with the step its state holds)."""
    if isinstance(step, torch.Tensor):
        return step_seed(seed, 0), check_device_scalar(step, "a tensor step", device, op), True
    return step_seed(seed, step), _dummy(device), False


def _dummy(device) -> torch.Tensor:
    """An int64 [1] device tensor for a pointer argument the kernel does not read (made once per device)."""
    dummy = _DUMMY.get(str(device))
    if dummy is None:
        dummy = _DUMMY[str(device)] = torch.zeros(1, dtype=torch.int64, device=device)
    return dummy


def rows_end_arg(rows_end, device, op: str):
    """(pointer, END_PTR) for the noise kernels' padded block: a length bucket's rows_end, an int64 [1] device
    tensor the kernel reads (sicl_fast.step.zo), or a dummy pointer and False (the spec's b)."""
    if rows_end is None:
        return _dummy(device), False
    return check_device_scalar(rows_end, "rows_end", device, op), True


def check_device_scalar(t: torch.Tensor, name: str, device, op: str) -> torch.Tensor:
    """t, an int64 [1] tensor on `device` that a kernel reads by pointer (the step, a block's end), or SiclError."""
    if t.device != torch.device(device) or t.dtype != torch.int64 or t.numel() != 1:
        raise SiclError(f"{op}: {name} must be an int64 [1] tensor on {device}, got {t.dtype} {list(t.shape)} on "
                        f"{t.device}")
    return t


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (what a launcher sizes its grid for; torch caches the
    properties, no device call per launch)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_warps_for(block: int) -> int:
    """Warps for a program that handles `block` elements at once (a power of two), as Liger-Kernel's
    calculate_settings chooses them: 4 up to 1024 elements, 8 from 2048, 16 from 8192, 32 from 32768, so a wide
    row keeps a bounded number of elements per thread."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def launch_config(op: str, interp: bool | None = None, num_warps: int | None = None, block: int = 1,
                  interpreter: dict | None = None, **meta) -> dict:
    """A kernel's launch configuration, as its configuration function (beside its launcher) returns it: meta (the
    BLOCK_* constexprs, and compile options such as num_stages or enable_fp_fusion) with num_warps (given, or
    num_warps_for(block)) as the GPU runs it; under the interpreter (interp None: interpreting(); False: the GPU's,
    what the sm_90 compile check kernels/_configs.py compiles) with `interpreter`'s entries instead, which may only
    make fewer, larger programs (the interpreter pays per program). Every BLOCK_* of both must be a power of two
    (tl.arange takes no other range: the GPU compile refuses what the interpreter runs), else SiclError naming the
    op: the GPU's configuration is made and checked on every launch, so the CPU tests meet each GPU constraint a
    configuration can break without a compile (shared memory and registers: tests/test_sm90_configs.py)."""
    cfg = {**meta, "num_warps": num_warps or num_warps_for(block)}
    if interpreter and (interpreting() if interp is None else interp):
        cfg.update(interpreter)
    for got in (meta, cfg):
        bad = {k: v for k, v in got.items() if k.startswith("BLOCK") and not (v >= 1 and v & (v - 1) == 0)}
        if bad:
            raise SiclError(f"{op}: launch configuration {bad} is not a power of two")
    return cfg


def launch(kernel, grid, *args, device: torch.device, block: int = 1, num_warps: int | None = None, **meta) -> None:
    """kernel[grid](*args, **meta), the one launch of every launcher: with num_warps (given by a tiled kernel's
    configuration, else num_warps_for(block), block = the elements one program handles at once), on `device`:
    inside torch.cuda.device(device) on CUDA, so tensors on cuda:1 launch there whatever the current device."""
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, num_warps=num_warps or num_warps_for(block), **meta)


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a python int with int(ndarray of shape (1,)), which
    NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"); `range(0, d, BLOCK)` over a kernel
    argument then fails. Wrap its tensor patcher so __index__ takes the single element. No-op when not needed."""
    try:
        int(np.ones(1, dtype=np.int32))
        return  # this NumPy still converts size-1 arrays
    except TypeError:
        pass
    from triton.runtime import interpreter as _interp

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_sicl_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._sicl_patched = True
    _interp._patch_lang_tensor = patched


def _tf32_pieces(x: np.ndarray) -> tuple:
    """float32 x -> (hi, lo): hi x rounded to tf32 to nearest, ties away (cvt.rna.tf32.f32), lo = x - hi with its low
    13 bits dropped (a tensor core's read of a tf32 operand); NaN kept in hi. sicl_fast.models.tensor_cores.pieces'
    numpy form."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    hi = ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    nan = np.isnan(x)
    if nan.any():
        hi = np.where(nan, x, hi)
    lo = ((x - hi).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return hi, lo


def tf32x3_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b (float32) as tl.dot's 'tf32x3' rounds it on a GPU, up to the tensor cores' accumulation: Triton's
    decomposition (a_lo b_hi + a_hi b_lo, NaN replaced by 0, + a_hi b_hi) of the operands' tf32 pieces. The numpy form
    of sicl_fast.models.tensor_cores.tc_matmul (tested equal to it to float32's summation order), for the
    interpreter, where it is 2x faster than the torch form on a tile."""
    ah, al = _tf32_pieces(a)
    bh, bl = _tf32_pieces(b)
    small = np.matmul(al, bh) + np.matmul(ah, bl)
    nan = np.isnan(small)
    if nan.any():
        small = np.where(nan, np.float32(0), small)
    return small + np.matmul(ah, bh)


def _patch_interpreter_dot() -> None:
    """Triton's interpreter multiplies float32 operands in numpy's float32 whatever tl.dot's input_precision says;
    the GPU's 'tf32x3' rounds them (3 TF32 products on the tensor cores). Emulate it explicitly (tf32x3_matmul), so
    that a kernel run here rounds as on the GPU up to the tensor cores' accumulation. The other precisions as the
    interpreter has them."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as _interp

    orig = _interp.InterpreterBuilder.create_dot
    if getattr(orig, "_sicl_patched", False):
        return
    tf32x3 = ir.INPUT_PRECISION.TF32x3

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == tf32x3 and a.data.dtype == np.float32 and b.data.dtype == np.float32:
            y = tf32x3_matmul(a.data, b.data)
            return _interp.TensorHandle(y.astype(d.data.dtype) + d.data, d.dtype.scalar)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._sicl_patched = True
    _interp.InterpreterBuilder.create_dot = create_dot


if interpreting():
    _patch_interpreter_index()
    _patch_interpreter_dot()
