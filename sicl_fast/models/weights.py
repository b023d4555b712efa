"""The fast decoder's weight layout: each layer's projections stacked per product, held once.

    qkv      [(H + 2 Hk) hd, d]   q, k, v stacked (one product where there were three)
    o        [d, H hd]
    gate_up  [2 I, d]             gate, up stacked (one product where there were two)
    down     [d, I]

The loaded transformers model keeps working on the same memory: its q / k / v and gate / up parameters become views
of the stacked tensors (`stack_params`), so the stacking costs no copy of the model dtype's weights. The difference
form's products (sicl_fast.models.rows) take the weights in the low dtype (bf16): for a bf16 model those are the
stacked tensors themselves, for a float32 model one bf16 copy made once (`LowWeights`; in oneDNN's packed layout
on CPUs that have its bf16 kernels), and the LM head's bf16 copy.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SiclError
from .rows import LOW_DTYPE

MADV_DONTNEED = 4  # Linux's


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files (Linux: /proc/self/maps; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return []
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                a, b = (int(x, 16) for x in fields[0].split("-"))
                out.append((a, b))
    return out


def release_file_pages(tensors: list[torch.Tensor]) -> int:
    """Give back the resident pages of tensors that no longer hold weights (stacked away by stack_params) where they
    are views of a file mapping: transformers maps a safetensors checkpoint and its parameters are views of that
    mapping, which the other parameters keep alive, so the stacked-away weights' pages would stay resident beside
    their stacked copy (RSS +267 MiB at SmolLM2 float32). Only whole pages inside each tensor, only in file mappings
    (never anonymous memory, which the allocator may reuse); the caller holds the last references. -> bytes given
    back (0 off Linux)."""
    maps = _file_mappings()
    if not maps:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page, done = mmap.PAGESIZE, 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if not any(a <= start and end <= b for a, b in maps):
            continue
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
            done += hi - lo
    return done


def _consecutive(ts: list[torch.Tensor]) -> bool:
    """Are the tensors [n_i, k] consecutive row blocks of one storage (already stacked)?"""
    t0 = ts[0]
    off = t0.storage_offset()
    for t in ts:
        if (t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or t.storage_offset() != off
                or not t.is_contiguous() or t.shape[1:] != t0.shape[1:]):
            return False
        off += t.numel()
    return True


def stack_params(modules: list, name: str) -> torch.Tensor | None:
    """The parameters `name` ('weight' or 'bias') of `modules` (nn.Linear) stacked along their first dimension, held
    once: each module's parameter is made a view of the stacked tensor (so the transformers model reads the same
    memory). Parameters already stacked this way (a second backend on the same model) are taken as they are. None when
    no module has the parameter; a module without it where others have one contributes zeros (a new tensor then)."""
    ps = [getattr(m, name, None) for m in modules]
    if all(p is None for p in ps):
        return None
    if any(p is None for p in ps):  # a bias on some products only: zeros for the others, not views
        like = next(p for p in ps if p is not None)
        return torch.cat([p.detach() if p is not None else like.new_zeros(m.out_features)
                          for p, m in zip(ps, modules)])
    ts = [p.detach() for p in ps]
    if _consecutive(ts):
        n = sum(t.shape[0] for t in ts)
        return ts[0].new_empty(0).set_(ts[0].untyped_storage(), ts[0].storage_offset(), (n, *ts[0].shape[1:]),
                                       ts[0].stride())
    stacked = torch.cat(ts)
    off = 0
    for p, t in zip(ps, ts):
        p.data = stacked[off:off + t.shape[0]]  # the module's parameter now views the stacked tensor
        off += t.shape[0]
    release_file_pages(ts)  # the weights held once: a mapped checkpoint's pages of the old ones given back
    return stacked


def _detached(module, name: str):
    p = getattr(module, name, None) if module is not None else None
    return None if p is None else p.detach()


@dataclass
class LayerWeights:
    """One layer's stacked projections (module docstring) in the model dtype, biases stacked alike (None: none)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_rows: int  # H hd: q's share of qkv's rows (k and v have Hk hd each)
    inter: int  # I: the MLP's inner size (gate_up has 2 I rows)

    @classmethod
    def of(cls, attn, mlp) -> LayerWeights:
        """From a transformers decoder layer's self_attn and mlp modules (their parameters become views)."""
        qkv_mods = [attn.q_proj, attn.k_proj, attn.v_proj]
        gu_mods = [mlp.gate_proj, mlp.up_proj]
        return cls(qkv=stack_params(qkv_mods, "weight"), qkv_bias=stack_params(qkv_mods, "bias"),
                   o=_detached(attn.o_proj, "weight"), o_bias=_detached(attn.o_proj, "bias"),
                   gate_up=stack_params(gu_mods, "weight"), gate_up_bias=stack_params(gu_mods, "bias"),
                   down=_detached(mlp.down_proj, "weight"), down_bias=_detached(mlp.down_proj, "bias"),
                   q_rows=attn.q_proj.weight.shape[0], inter=mlp.gate_proj.weight.shape[0])

    @property
    def kv_rows(self) -> int:
        return (self.qkv.shape[0] - self.q_rows) // 2


def mkldnn_packed(w: torch.Tensor):
    """w [o, k] bf16 reordered once into oneDNN's blocked layout for its bf16 inner-product kernel (CPU, where torch
    has oneDNN and the CPU multiplies bf16: AVX512-BF16 / AMX), or None where that is not available. The product
    through it (`packed_linear`) is the same oneDNN kernel F.linear dispatches to, without the per-call reorder of
    the weight: the same bits, a few per cent faster (bench/matmul_rates.py measures both side by side)."""
    try:
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except (AttributeError, RuntimeError):  # a torch build without oneDNN or these ops
        return None


def packed_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., k] bf16 @ w.T for w packed by mkldnn_packed -> [..., o] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_CAPABILITY = (8, 9)  # the first CUDA capability with FP8 tensor cores (Ada; Hopper is 9.0)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] -> (q [..., k] float8 e4m3, scale [..., 1] float32) with x ~ q * scale, one scale per row (its
    largest magnitude maps to 448): 3 mantissa bits, so each element within 2^-4 relative of x's. The reference of
    DecoderOps.fp8_rows (kernels/fp8_rows.py gives the same bits in one launch)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(FP8), scale


def fp8_refusal(device) -> str | None:
    """Why the difference form's FP8 products cannot run on `device`, or None where they can: on CUDA they need
    FP8 tensor cores (sm_89+, torch._scaled_mm); below, the only form left would be the CPU's emulation, a float32
    copy of every weight on the GPU and float32 products, slower than the bf16 products it would replace. Off CUDA
    they are emulated (the precision study's path: bench/precision_fidelity.py 'fp32-fp8'), to measure their
    accuracy, not their speed."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(dev)
    if tuple(cap) >= FP8_CAPABILITY:
        return None
    return (f"diff_matmul 'fp8' needs FP8 tensor cores (CUDA sm_89+: Ada, Hopper); {dev} is sm_{cap[0]}{cap[1]}, "
            "where FP8 products could only be emulated in float32 (a float32 copy of every weight on the GPU, "
            "slower than bf16): use diff_matmul 'bf16' (the default)")


class LowWeight:
    """One stacked weight [o, k] in the low dtype, for the difference form's product: y = x [M, k] low @ w.T ->
    [M, o] low. Held once: a bf16 model's own stacked tensor is used as it is; a float32 model's one bf16 copy is
    made here, and on CPUs with oneDNN's bf16 kernels kept only in their packed layout (mkldnn_packed: the same
    kernel and bits as F.linear without its per-call reorder, 0.99-1.23x its rate at SmolLM2's shapes, RESULTS 18); then
    `w` is None. pack=False: the plain bf16 copy (the LM head's, which the span heads read a chunk at a time).

    fp8: the weight in FP8 e4m3 too, a scale per output row (`fp8`: (q [o, k], scale [o, 1])), for the difference
    rows' product (linear_fp8); the value rows keep the bf16 product (sicl_fast.models.projections). On CUDA
    (sm_89+ only: fp8_refusal) torch._scaled_mm multiplies the FP8 rows on the tensor cores, at twice the bf16 rate;
    elsewhere the product is emulated, the quantised values dequantised and multiplied exactly in float32 (a
    float32 copy of the dequantised weight, made on first use, off CUDA only), to measure what FP8 does to the
    ascent."""

    def __init__(self, w: torch.Tensor, fp8: bool = False, pack: bool = True) -> None:
        low = w if w.dtype == LOW_DTYPE else w.to(LOW_DTYPE)
        self.packed = mkldnn_packed(low) if pack and low is not w else None
        self.w = low if self.packed is None else None
        self.out_features = int(w.shape[0])
        self.fp8 = None
        if fp8:
            why = fp8_refusal(w.device)
            if why:
                raise SiclError(why)
            self.fp8 = fp8_rows(w)  # (q [o, k], scale [o, 1])
            self.scaled_mm = w.is_cuda  # else emulated
            self._deq = None

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] bf16 -> [..., o] bf16 (every row in bf16); out: a contiguous [M, o] bf16 buffer to write (x
        then [M, k])."""
        if self.packed is not None:  # packed only for CPU weights, which take CPU rows
            y = packed_linear(x, self.packed)
            return y if out is None else out.copy_(y)
        if out is None:
            return F.linear(x, self.w)
        return torch.mm(x, self.w.t(), out=out)

    def linear_fp8(self, qx: torch.Tensor, sx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows in FP8, qx [M, k] float8 e4m3 with their scales sx [M, 1] float32 (fp8_rows' pair) -> [M, o] bf16,
        the one product of those rows; out: as linear's."""
        qw, sw = self.fp8
        if self.scaled_mm:
            return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=LOW_DTYPE, out=out)
        if self._deq is None:
            self._deq = qw.float() * sw
        y = F.linear(qx.float() * sx, self._deq).to(LOW_DTYPE)
        return y if out is None else out.copy_(y)


@dataclass
class LowWeights:
    """One layer's stacked projections as LowWeight (the difference form's products) and the stacked biases."""

    qkv: LowWeight
    o: LowWeight
    gate_up: LowWeight
    down: LowWeight

    @classmethod
    def of(cls, w: LayerWeights, fp8: bool = False) -> LowWeights:
        return cls(qkv=LowWeight(w.qkv, fp8), o=LowWeight(w.o, fp8), gate_up=LowWeight(w.gate_up, fp8),
                   down=LowWeight(w.down, fp8))


__all__ = ["LayerWeights", "LowWeight", "LowWeights", "stack_params", "release_file_pages", "mkldnn_packed",
           "packed_linear", "fp8_rows", "fp8_refusal", "FP8", "FP8_MAX", "FP8_CAPABILITY"]
