"""The C++ CPU implementation (extension `sicl_fast.ops._C`, csrc/): CppStepOps (perturb, update, proxy, the static
step's bookkeeping `bookkeep`, the span heads) and CppDecoderOps (the difference form's row epilogues norm_rows,
rope_rows, gated_rows; the plain forward's residual norms and rotary), on float32 activations and the difference
form's bf16 rows, CPU tensors. The span heads' products are torch's, a vocabulary chunk at a time, their
log-sum-exp the extension's; best tracking is the reference's (TorchStepOps); the rest of the decoder's elementwise
work is the reference's (TorchDecoderOps), and so is any op on other dtypes or devices, or under autograd.

Same functions as the torch reference (sicl_fast.step.zo, sicl_fast.step.proxy,
sicl_fast.step.step_state, sicl_fast.models.rows, sicl_fast.step.logprobs) and the same noise
as sicl_fast.step.rng bit for bit, so a seeded run perturbs identically on the CPU and, through the Triton
kernels, on a GPU. The directions U are regenerated inside the ops, never stored. Multithreaded with OpenMP; results do
not depend on the thread count. Argument checks live in StepSpec and ProxyPlan / check_logprobs; the extension itself
only guards its raw buffers.

Build: `pip install -e .` or `python setup.py build_ext --inplace`. Without the extension this module still
imports; `available()` is False and CppStepOps() raises a SiclError saying how to build it.

    available() -> bool                        the extension is importable
    randn(seed, step, num, rows, d) -> U [num, rows, d] float32   (= sicl_fast.step.rng.directions)
    attention(q, k, v, prefix, pos0, k0, scale, softcap, window) -> o   the fast decoder's attention 'cpp'
    attention_rows(q, k, v, rows, prefix, scale, softcap, window, o_ref) -> o   the same on a difference-form pass
    span_head(hidden, weight, targets, softcap, bias) -> [B, P]   CppStepOps's span head
    span_head_rows(hidden, weight, targets, anchor, softcap, z_ref, value_slot) -> [B, P]
                                               ... of a difference-form pass (z_ref: the value rows' reference logits)
    CppStepOps, CppDecoderOps                  the ops protocols (sicl_fast.ops.base)
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..step import step_state
from ..errors import SiclError
from ..step.logprobs import rows_logprobs, vocab_chunked_logprobs
from ..models.rows import LOW_DTYPE
from ..step.proxy import ProxyOut, ProxyPlan
from ..step.rng import check_counter_range, step_seed
from ..step.spec import StepSpec, f32
from .base import fired_tensor
from .torch_ops import TorchDecoderOps, TorchStepOps

try:  # the extension is optional
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built
    _C = None
    _IMPORT_ERROR = exc

BUILD_HINT = "build it with `pip install -e .` or `python setup.py build_ext --inplace` (needs a C++17 compiler)"
# vocabulary rows per span-head product: [B*P, 512] float32 logits stay in the core's cache for the log-sum-exp
# that follows (at SmolLM2's head, B*P 297 and 648, the product ran at 185 / 193 GFLOP/s in chunks of 512, 149 / 170
# in chunks of 8192 on this project's 2-core CPU, 2026-11-26)
HEAD_CHUNK = 512
# activation codes of csrc/rows.cpp's gated_rows; other activations take the reference
CPP_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}
# the stop reasons as step.step_state stores them, in the order csrc/step_state.cpp's bookkeep reads them
STOP_CODES = np.array([step_state.RUNNING, step_state.GATE, step_state.PATIENCE, step_state.SNR, step_state.MAX_STEPS,
                       step_state.NONFINITE], dtype=np.int64)


def available() -> bool:
    return _C is not None


def _ext():
    """The extension module; a SiclError saying how to build it when it is not built."""
    if _C is None:
        raise SiclError(f"the C++ extension sicl_fast.ops._C is not built ({_IMPORT_ERROR}); {BUILD_HINT}")
    return _C


require = _ext


def num_threads() -> int:
    return int(_ext().num_threads())


def set_num_threads(n: int) -> None:
    _ext().set_num_threads(int(n))


def _cpu(t: torch.Tensor, name: str, op: str, dtype=torch.float32) -> torch.Tensor:
    """t as a contiguous CPU tensor of `dtype` (what the extension's buffers must be)."""
    if not isinstance(t, torch.Tensor):
        raise SiclError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise SiclError(f"{op}: the C++ path runs on the CPU; {name} is on {t.device}")
    if t.dtype != dtype:
        raise SiclError(f"{op}: {name} must be {str(dtype).replace('torch.', '')}, "
                        f"got {str(t.dtype).replace('torch.', '')}")
    return t.detach().contiguous()


def _bits(t: torch.Tensor):
    """A bf16 tensor's bits as an int16 numpy view (no copy)."""
    return t.view(torch.int16).numpy()


_F32_COPIES = WeakIdKeyDictionary()  # tensor -> (its version, its float32 copy): see _arr


def _arr(t: torch.Tensor | None, name: str, op: str, dtype=torch.float32):
    """An input as the extension takes it: a contiguous CPU tensor's numpy view (bf16 as its bits), None as None (an
    absent bias or norm). A float32 input of another float dtype (a bf16 model's norm weight or bias) as its float32
    copy, made once per tensor and version: a model's constant weights cost no conversion per call."""
    if t is None:
        return None
    if dtype == torch.float32 and t.dtype != dtype and t.is_floating_point():
        got = _F32_COPIES.get(t)
        if got is None or got[0] != t._version:
            got = _F32_COPIES[t] = (t._version, t.detach().float())
        t = got[1]
    t = _cpu(t, name, op, dtype)
    return _bits(t) if dtype == LOW_DTYPE else t.numpy()


def _anchors(rows) -> np.ndarray:
    """A RowLayout's anchors [B] as the extension reads them (int64, on the host)."""
    return np.asarray(rows.anchors, dtype=np.int64)


def _on_cpu_rows(*ts) -> bool:
    """Do the C++ row ops take these (float32 or bf16 CPU tensors, no autograd recording through them; None: an
    absent reference, taken)?"""
    ts = [t for t in ts if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return not grad and all(t.device.type == "cpu" and t.dtype in (torch.float32, LOW_DTYPE) for t in ts)


def _scalar_buffer(t: torch.Tensor, name: str, op: str) -> np.ndarray:
    """An int64 [1] CPU tensor's own buffer as the extension reads it (the loop's device-resident state: no host
    read of a tensor, so the static step's no-host-read guard holds on the CPU too)."""
    return _cpu(t, name, op, torch.int64).reshape(1).numpy()


def _step(step, op: str):
    """The step as the int64 [1] array the extension reads: a CPU tensor's own buffer (no host read of the
    value here), or a new array for an int."""
    if isinstance(step, torch.Tensor):
        return _scalar_buffer(step, "step", op)
    step_seed(0, step)  # checks the range
    return np.array([step], dtype=np.int64)


def _block_end(rows_end, spec: StepSpec, op: str) -> int:
    """The perturbed block's end the extension takes as b: spec.b, or a length bucket's rows_end (an int64 [1] CPU
    tensor, read from its buffer as the extension reads the step: sicl_fast.step.zo). The extension
    leaves rows [rows_end, spec.b) of the batch as X's and out of the update, which is the padded step."""
    if rows_end is None:
        return spec.b
    return int(_scalar_buffer(rows_end, "rows_end", op)[0])


def randn(seed: int, step: int, num: int, rows: int, d: int) -> torch.Tensor:
    """U [num, rows, d] float32, bit-identical to step.rng.directions(seed, step, num, rows, d)."""
    check_counter_range(num, rows, d)
    out = torch.empty(num, rows, d, dtype=torch.float32)
    if out.numel():
        _ext().randn(out.view(-1).numpy(), step_seed(seed, step))
    return out


def span_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap=None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [B, P, d], weight [V, d], targets [P], bias [V] or None -> [B, P] float32 log-probabilities of the
    targets, on float32 CPU tensors (other dtypes and devices, and autograd, take the reference,
    vocab_chunked_logprobs). The products run a vocabulary chunk (HEAD_CHUNK rows) at a time into one reused buffer
    (the bias added there); csrc/span_head.cpp's lse_chunk folds each into the rows' running max and sum while it is
    still in cache."""
    if (hidden.dtype != torch.float32 or weight.dtype != torch.float32 or hidden.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"))
            or (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))):
        return vocab_chunked_logprobs(hidden, weight, targets, softcap, bias=bias)
    B, P, d = hidden.shape
    V, M = weight.shape[0], B * P
    h = hidden.reshape(M, d)
    tgt = targets.to(torch.int64).repeat(B)
    m = torch.full((M,), -math.inf)
    s, picked = torch.zeros(M), torch.zeros(M)
    buf = torch.empty(M * min(V, HEAD_CHUNK))
    for v0 in range(0, V, HEAD_CHUNK):
        v1 = min(V, v0 + HEAD_CHUNK)
        z = buf[: M * (v1 - v0)].view(M, v1 - v0)
        torch.mm(h, weight[v0:v1].t(), out=z)
        if bias is not None:
            z.add_(bias[v0:v1])
        _ext().lse_chunk(z.numpy(), v0, tgt.numpy(), float(softcap or 0.0), m.numpy(), s.numpy(), picked.numpy())
    return (picked - (m + torch.log(s))).view(B, P)


def _leading_values(anchors: np.ndarray) -> int:
    """The batch rows before the first difference row when every row after it is a difference (one prompt: 1, the
    rows a product of the differences alone skips), else 0 (packed prompts: the product takes every row)."""
    value = anchors == np.arange(anchors.size)
    k = int(np.argmin(value)) if not value.all() else anchors.size
    return 0 if value[k:].any() else k


def span_head_rows(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, anchor: torch.Tensor,
                   softcap=None, z_ref: torch.Tensor | None = None, value_slot: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """hidden [B, P, d] in difference form over the batch (anchor [B]: sicl_fast.models.rows), weight [V, d], both
    bf16, targets [P] -> [B, P] float32 log-probabilities of the targets, as step.logprobs.rows_logprobs (its
    reference; other dtypes and devices, and autograd, take it). z_ref [Vb, P, V] float32: the value rows' reference
    logits (value batch row j's at z_ref[value_slot[j]]; value_slot None: the value rows in order), the value rows of
    hidden their changes from the reference's hidden states; None: the value rows are values. Per vocabulary chunk
    (HEAD_CHUNK rows) two calls: torch's bf16 product into one reused buffer (of every row with z_ref, of the
    difference rows without), then csrc/span_head.cpp's lse_chunk_rows, which makes the value rows' logits (z_ref's
    chunk, read in place, plus their change from the product; without z_ref in float32, their bf16 rows times the
    chunk accumulated in float32), every difference row's as its anchor's plus its bf16 difference, and folds them
    into the rows' running max and sum (the first chunk starts them, the last writes the result)."""
    if not _on_cpu_rows(hidden, weight, z_ref) or hidden.dtype != LOW_DTYPE or weight.dtype != LOW_DTYPE or \
            (z_ref is not None and z_ref.dtype != torch.float32):
        return rows_logprobs(hidden, weight, targets, anchor, softcap, z_ref, value_slot)
    op = "cpp span_head_rows"
    B, P, d = hidden.shape
    V, M = weight.shape[0], B * P
    h = _cpu(hidden, "hidden", op, LOW_DTYPE).view(M, d)
    weight = _cpu(weight, "weight", op, LOW_DTYPE)
    anchors = _cpu(anchor.to(torch.int64), "anchor", op, torch.int64).numpy()
    tgt = _cpu(targets.to(torch.int64), "targets", op, torch.int64).numpy()
    zr = None if z_ref is None else _cpu(z_ref, "z_ref", op).numpy()
    slots = None if z_ref is None or value_slot is None else \
        _cpu(value_slot.to(torch.int64), "value_slot", op, torch.int64).numpy()
    r0 = 0 if z_ref is not None else P * _leading_values(anchors)  # the product's rows start here
    c = min(V, HEAD_CHUNK)
    zd, zf = torch.empty((M - r0) * c, dtype=LOW_DTYPE), torch.empty(M * c)
    m, s, picked, out = (torch.empty(M) for _ in range(4))
    for v0 in range(0, V, HEAD_CHUNK):
        v1 = min(V, v0 + HEAD_CHUNK)
        w, z = weight[v0:v1], zd[: (M - r0) * (v1 - v0)].view(M - r0, v1 - v0)
        if M > r0:
            torch.mm(h[r0:], w.t(), out=z)
        _ext().lse_chunk_rows(_bits(z), r0, _bits(h), _bits(w), zf[: M * (v1 - v0)].view(M, v1 - v0).numpy(), v0,
                              V, tgt, anchors, float(softcap or 0.0), m.numpy(), s.numpy(), picked.numpy(),
                              out.numpy(), zr, slots)
    return out.view(B, P)


class CppStepOps(TorchStepOps):
    """The step ops on the C++ extension (module docstring)."""

    name = "cpp"

    def __init__(self) -> None:
        _ext()

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out=None, rows_end=None) -> torch.Tensor:
        op = "cpp perturb"
        X = _cpu(X, "X", op)
        spec.check_X(X, "X", op)
        out = torch.empty(spec.B, spec.b, spec.d, dtype=torch.float32) if out is None else out
        _ext().perturb(X.numpy(), out.numpy(), spec.seed, _step(step, op), spec.N, spec.a,
                       _block_end(rows_end, spec, op), f32(spec.mu), spec.central)
        return out

    span_head = staticmethod(span_head)
    span_head_rows = staticmethod(span_head_rows)

    def update(self, X, X0, f, step, spec: StepSpec, out=None, rows_end=None) -> tuple[torch.Tensor, torch.Tensor]:
        op = "cpp update"
        X, X0 = _cpu(X, "X", op), _cpu(X0, "X0", op)
        spec.check_X(X, "X", op)
        spec.check_X(X0, "X0", op)
        spec.check_f(f, op)
        f = _cpu(f.reshape(-1).float(), "f", op)
        out = torch.empty_like(X) if out is None else out
        fired = _ext().update(
            X.numpy(), X0.numpy(), f.numpy(), out.numpy(), spec.seed, _step(step, op), spec.N, spec.a,
            _block_end(rows_end, spec, op), f32(spec.mu), f32(spec.eta), float(spec.kappa), spec.central,
            spec.grad_mode == "normalize", f32(spec.clip_norm), spec.scope == "demos",
        )
        return out, fired_tensor(bool(fired), X.device)

    def proxy_planned(self, logprobs, plan: ProxyPlan) -> ProxyOut:
        op = "cpp proxy"
        count = int(_scalar_buffer(plan.count, "count", op)[0])
        lp = _cpu(logprobs[:, :count].float(), "logprobs", op)
        B = lp.shape[0]
        f, C, R, G = (torch.empty(B, dtype=torch.float32) for _ in range(4))
        c = torch.empty(B, plan.T, dtype=torch.float32)
        _ext().proxy(lp.numpy(), plan.offsets.numpy(), float(plan.alpha), float(plan.beta), float(plan.gamma),
                     float(plan.q), f.numpy(), C.numpy(), R.numpy(), G.numpy(), c.numpy())
        return ProxyOut(f=f, C=C, R=R, G=G, c=c)

    def bookkeep(self, st, f: torch.Tensor, fired: torch.Tensor, cfg) -> None:
        """The static step's bookkeeping (step.step_state.bookkeep_reference) on the StepState st in place, in
        one call of csrc/step_state.cpp's bookkeep, bit for bit the reference's; f [B] float32, fired int32 [1]."""
        op = "cpp bookkeep"
        best = st.best
        _ext().bookkeep(_cpu(f.reshape(-1), "f", op).numpy(), _cpu(fired, "fired", op, torch.int32).numpy(),
                       st.X.numpy(), st.X_next.numpy(), best.best_X.numpy(), best.best_f.numpy(),
                       best.counters.numpy(), st.step_t.numpy(), st.steps_run.numpy(), st.reason.numpy(),
                       st.low_snr.numpy(), st.projections.numpy(), st.history.numpy(), st.anchor.numpy(), STOP_CODES,
                       float(cfg.tau), float(cfg.snr_threshold), float(cfg.min_delta), float(cfg.min_delta_rel),
                       int(cfg.patience), int(cfg.max_steps), float(cfg.mu_eff), cfg.estimator == "central")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] (CPU) as [rows, n]: a view when its rows are evenly strided with contiguous elements (e.g. a
    view of a fused product's columns), else a contiguous copy."""
    try:
        r = t.detach().view(-1, n)
    except RuntimeError:  # rows not evenly strided
        r = t.detach().reshape(-1, n)
    return r if r.stride(-1) == 1 else r.contiguous()


def _out_rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """An output buffer t [..., n] as rows [rows, n] of its own storage (evenly strided rows of contiguous
    elements: the extension writes there), or None (e.g. a batch of a longer cache's rows: write elsewhere, copy)."""
    try:
        r = t.detach().view(-1, n)
    except RuntimeError:
        return None
    return r if r.stride(-1) == 1 or n == 1 else None


def attention(q, k, v, prefix, pos0: int, k0: int, scale: float, softcap, window) -> torch.Tensor:
    """Causal attention in one call (csrc/attention.cpp; the reference is sicl_fast.models.attention.attend_math):
    q [B, T, H, hd] float32 at positions pos0 ..; k, v [Bk, N, Hk, hd] (Bk == B, or 1: keys every batch row shares)
    at positions k0 ..; prefix: (k, v) [1, a, Hk, hd] at positions 0 .. a-1 that every row also sees (a <= k0), or
    None; window: keys > position - window only (None: all); softcap: cap tanh(s / cap) on the scores (None: off).
    -> o [B, T, H, hd] float32. q, k, v may be views of a fused product's columns (no copy then)."""
    B, T, H, hd = q.shape
    Bk, _, Hk, _ = k.shape
    if prefix is None:
        pk = pv = torch.empty(0, Hk * hd)
    else:
        pk, pv = _rows(prefix[0], Hk * hd), _rows(prefix[1], Hk * hd)
    out = torch.empty(B, T, H, hd)
    if out.numel() == 0:  # no query rows
        return out
    _ext().attention(_rows(q, H * hd).numpy(), _rows(k, Hk * hd).numpy(), _rows(v, Hk * hd).numpy(), pk.numpy(),
                     pv.numpy(), out.view(B * T, H * hd).numpy(), B, T, H, Hk, Bk, int(pos0), int(k0), float(scale),
                     float(softcap or 0.0), int(window or 0))
    return out


def attention_rows(q, k, v, rows, prefix, scale: float, softcap, window, o_ref=None) -> torch.Tensor:
    """The attention of a difference-form pass in one call (csrc/attention.cpp's attention_rows; the reference is
    sicl_fast.models.attention.attention_rows_reference): q [R, H, hd], k, v [R, Hk, hd] float32, the pass's rows
    (rows: its RowLayout); prefix: the kept prefix's (k, v) [1, a, Hk, hd] float32 when the lead rows do not hold
    it, else None -> o [R, H hd] bf16 in difference form, its value rows against o_ref [V, H hd] float32 (None:
    none). The lead rows attend causally among themselves; each batch row to the prefix and causally to its own
    keys."""
    R, H, hd = q.shape
    Hk = k.shape[1]
    op = "cpp attention_rows"
    if prefix is None:
        pk = pv = torch.empty(0, Hk * hd)
    else:
        pk, pv = _rows(prefix[0], Hk * hd), _rows(prefix[1], Hk * hd)
    out = torch.empty(R, H * hd, dtype=LOW_DTYPE)
    _ext().attention_rows(_cpu(q, "q", op).view(R, H * hd).numpy(), _rows(k, Hk * hd).numpy(),
                          _rows(v, Hk * hd).numpy(), pk.numpy(), pv.numpy(), _anchors(rows), rows.lead, rows.T,
                          rows.pos0, H, Hk, float(scale), float(softcap or 0.0), int(window or 0), _bits(out),
                          _arr(o_ref, "o_ref", op))
    return out


class CppDecoderOps(TorchDecoderOps):
    """The difference form's row epilogues, the plain forward's residual norms and rotary on the C++ extension
    (module docstring): the row ops on float32 rows and bf16 products, the plain ones on float32 models (other
    dtypes, and the plain rotary's Qwen3 / Gemma 3 per-head q / k norms, take the reference); the rest is the
    reference's. Never differentiated (the plan gives autograd runs impl 'torch')."""

    name = "cpp"
    kv_in_place = True  # qk_rope writes K / V into the decoder's buffers as it rotates

    def __init__(self) -> None:
        _ext()

    def residual_norm(self, x, y, post_w, w, eps: float, gemma: bool, y_scale=None):
        """(x', h) as sicl_fast.models.elementwise.residual_norm (y None: (x, rms_norm(x, w)); w None: h is x'
        itself); float32 and gemma are the same formula there ((z r) w in float32)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return super().residual_norm(x, y, post_w, w, eps, gemma, y_scale)
        if w is None and y is None:
            return x, x
        op = "cpp residual_norm"
        x = _cpu(x, "x", op)
        d = x.shape[-1]
        h = torch.empty_like(x) if w is not None else None
        x2 = x.view(-1, d).numpy()
        w1 = _cpu(w, "w", op).numpy() if w is not None else x2[0]  # without w: an unused stand-in
        if y is None:  # no residual: the unused y / post_w / x_out arguments are x's rows and w
            _ext().residual_norm(x2, x2, w1, w1, float(eps), False, False, x2, h.view(-1, d).numpy())
            return x, h
        y = _cpu(y, "y", op)
        x_out = torch.empty_like(x)
        pw = _cpu(post_w, "post_w", op).numpy() if post_w is not None else w1
        _ext().residual_norm(x2, y.view(-1, d).numpy(), pw, w1, float(eps), True,
                             post_w is not None, x_out.view(-1, d).numpy(),
                             h.view(-1, d).numpy() if h is not None else x2, 1.0 if y_scale is None else float(y_scale),
                             w is not None)
        return x_out, (h if h is not None else x_out)

    def qk_rope(self, q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None, v_out=None):
        """q rotated in place (it may be a view of the fused q / k / v product), k rotated into k_out, v copied into
        v_out (fresh tensors when None); see sicl_fast.models.elementwise.qk_rope. cos, sin [T, 1, rot]: the rows'
        positions, the same for every batch row (other forms take the reference); rot <= hd: each head's first rot
        elements rotated."""
        B, T, H, hd = q.shape
        rot = cos.shape[-1]
        if (q_norm is not None or q.dtype != torch.float32 or q.device.type != "cpu"
                or tuple(cos.shape) != (T, 1, rot)):  # per-row positions (batched decoding): the reference
            return super().qk_rope(q, k, v, cos, sin, q_norm, k_norm, eps, gemma, k_out, v_out)
        Hk = k.shape[2]
        k_out = torch.empty(B, T, Hk, hd, dtype=k.dtype) if k_out is None else k_out
        v_out = torch.empty(B, T, Hk, hd, dtype=v.dtype) if v_out is None else v_out
        qr = _rows(q, H * hd)
        if qr.data_ptr() != q.data_ptr():  # q had no row layout: rotate its copy, and return that
            q = qr.view(B, T, H, hd)
        ko, vo = _out_rows(k_out, Hk * hd), _out_rows(v_out, Hk * hd)
        kw = ko if ko is not None else torch.empty(B * T, Hk * hd)
        vw = vo if vo is not None else torch.empty(B * T, Hk * hd)
        op = "cpp qk_rope"
        _ext().rope_qkv(qr.numpy(), _rows(k, Hk * hd).numpy(), _rows(v, Hk * hd).numpy(),
                        _cpu(cos, "cos", op).view(T, rot).numpy(), _cpu(sin, "sin", op).view(T, rot).numpy(), H, Hk,
                        kw.numpy(), vw.numpy())
        if ko is None:
            k_out.copy_(kw.view(B, T, Hk, hd))
        if vo is None:
            v_out.copy_(vw.view(B, T, Hk, hd))
        return q, k_out, v_out

    def norm_rows(self, x, y, bias, post_w, w, eps: float, gemma: bool, rows, y_ref=None, h_ref=None, y_scale=None):
        """(x' [R, d] float32, h [R, d] bf16) as sicl_fast.models.rows.norm_rows_reference, one call (csrc/rows.cpp);
        y None: x' is x; w None: h is the form of x' itself. y_ref, h_ref [V, d] float32: the value rows' references
        of y and of h (None: none). gemma: the same formula in float32 ((z r) w, Gemma's 1 + w already in w)."""
        if not _on_cpu_rows(x, y, y_ref, h_ref) or x.dtype != torch.float32 or \
                (y is not None and y.dtype != LOW_DTYPE):
            return super().norm_rows(x, y, bias, post_w, w, eps, gemma, rows, y_ref, h_ref, y_scale=y_scale)
        op = "cpp norm_rows"
        x = _cpu(x, "x", op)
        h = torch.empty(x.shape, dtype=LOW_DTYPE)
        x_out = None if y is None else torch.empty_like(x)
        _ext().norm_rows(x.numpy(), _arr(y, "y", op, LOW_DTYPE), _arr(bias, "bias", op), _arr(post_w, "post_w", op),
                         _arr(w, "w", op), float(eps), _anchors(rows), rows.lead, rows.T,
                         None if x_out is None else x_out.numpy(), _bits(h),
                         None if y is None else _arr(y_ref, "y_ref", op), _arr(h_ref, "h_ref", op),
                         1.0 if y_scale is None else float(y_scale))
        return (x if x_out is None else x_out), h

    def rope_rows(self, qkv, bias, rows, cos, sin, q_norm, k_norm, eps: float, gemma: bool, H: int, Hk: int, k_out,
                  v_out, qkv_ref=None):
        """q [R, H, hd] float32, k and v written into k_out / v_out [R, Hk, hd] float32, as
        sicl_fast.models.rows.rope_rows_reference (the q / k norms included), one call (csrc/rows.cpp);
        cos, sin [n, rot] from position 0; qkv_ref [V, (H + 2 Hk) hd] float32: the value rows' reference (None:
        none)."""
        if not _on_cpu_rows(qkv, qkv_ref) or qkv.dtype != LOW_DTYPE:
            return super().rope_rows(qkv, bias, rows, cos, sin, q_norm, k_norm, eps, gemma, H, Hk, k_out, v_out,
                                     qkv_ref)
        op = "cpp rope_rows"
        R, hd = qkv.shape[0], k_out.shape[-1]
        q = torch.empty(R, H, hd)
        ko, vo = _out_rows(k_out, Hk * hd), _out_rows(v_out, Hk * hd)
        kw = ko if ko is not None and ko.is_contiguous() else torch.empty(R, Hk * hd)
        vw = vo if vo is not None and vo.is_contiguous() else torch.empty(R, Hk * hd)
        _ext().rope_rows(_arr(qkv, "qkv", op, LOW_DTYPE), _arr(bias, "bias", op), _anchors(rows), rows.lead,
                         rows.T, rows.pos0, _arr(cos, "cos", op), _arr(sin, "sin", op), _arr(q_norm, "q_norm", op),
                         _arr(k_norm, "k_norm", op), float(eps), H, Hk, q.view(R, H * hd).numpy(), kw.numpy(),
                         vw.numpy(), _arr(qkv_ref, "qkv_ref", op))
        if kw is not ko:
            k_out.copy_(kw.view(k_out.shape))
        if vw is not vo:
            v_out.copy_(vw.view(v_out.shape))
        return q

    def gated_rows(self, y, bias, act_name: str, rows, y_ref=None, a_ref=None):
        """act(gate) * up of y [R, 2I] bf16 (gate | up) plus the bias, in difference form [R, I] bf16, as
        sicl_fast.models.rows.gated_rows_reference, one call (csrc/rows.cpp); y_ref [V, 2I], a_ref [V, I] float32:
        the value rows' references of y and of the output (None: none); activations other than CPP_ACTIVATIONS'
        take the reference."""
        if not _on_cpu_rows(y, y_ref, a_ref) or y.dtype != LOW_DTYPE or act_name not in CPP_ACTIVATIONS:
            return super().gated_rows(y, bias, act_name, rows, y_ref, a_ref)
        op = "cpp gated_rows"
        out = torch.empty(y.shape[0], y.shape[1] // 2, dtype=LOW_DTYPE)
        _ext().gated_rows(_arr(y, "y", op, LOW_DTYPE), _arr(bias, "bias", op), CPP_ACTIVATIONS[act_name],
                          _anchors(rows), rows.lead, rows.T, _bits(out), _arr(y_ref, "y_ref", op),
                          _arr(a_ref, "a_ref", op))
        return out


__all__ = ["available", "require", "num_threads", "set_num_threads", "randn", "attention", "attention_rows",
           "span_head", "span_head_rows", "CppStepOps", "CppDecoderOps", "BUILD_HINT", "CPP_ACTIVATIONS", "STOP_CODES"]
