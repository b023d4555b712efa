"""Attention of the fast backend: causal (and sliding-window, soft-capped) attention whose keys may come in two
parts merged by log-sum-exp: a shared prefix (K/V of rows [0, a), batch 1, attended to by every batch row without
being copied) and the rows themselves (or a KV cache's keys). Kernels:

  math   explicit scores, float32 softmax; handles soft-capping, sliding windows, any mask (the reference)
  sdpa   torch's scaled_dot_product_attention (no soft-capping; falls back to math for what it cannot do exactly)
  flash  flash-attn's flash_attn_func (CUDA, fp16/bf16, optional: `pip install "sicl-fast[flash]"`)
  triton the fused kernel kernels/attention.py: prefix and rows in one launch, soft-cap and window included
         (CUDA, or the CPU under TRITON_INTERPRET=1; what the run plan picks with impl 'triton')
  cpp    the C++ extension's (csrc/attention.cpp): prefix and rows in one call, soft-cap and window included
         (float32 CPU tensors, as every difference-form pass is; what the run plan picks with impl 'cpp'; a bf16
         model's plain forward takes the math path)

Shapes: q [B, T, H, hd]; k, v [Bk, N, Hk, hd] with Bk == B, or Bk == 1 for keys every batch row shares;
o [B, T, H, hd] in q's dtype; lse [B, T, H] float32.

precision: how a float32 attention's products round (the run plan's attention_precision; sicl_fast.models.tensor_cores):
'ieee' (IEEE float32: the math, SDPA and C++ kernels' own, the Triton kernel's FMA on the CUDA cores when asked) or
'tf32x3' (the Triton kernel's products on the tensor cores; on the math path the same rounding emulated in torch,
the precision study's path: bench/precision_fidelity.py).
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ..errors import SiclError
from .tensor_cores import tc_matmul

ATTN_IMPLS = ("auto", "math", "sdpa", "flash", "triton", "cpp")
PRECISE_IMPLS = ("triton", "math")  # the kernels whose float32 products take another precision than IEEE

try:  # optional; never needed on the CPU
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # ImportError, or a broken CUDA build
    _flash_attn_func = None


def visibility(q0: int, T: int, k0: int, N: int, window: int | None):
    """Which keys (positions k0 .. k0+N-1) each query (positions q0 .. q0+T-1) sees: causal, and inside the
    sliding window (key > query - window, as transformers). Returns 'all', 'causal' (square, aligned, nothing
    else cut) or a bool mask [T, N] (True = visible)."""
    last_q, last_k = q0 + T - 1, k0 + N - 1
    in_window = window is None or k0 > last_q - window
    if last_k <= q0 and in_window:
        return "all"
    if q0 == k0 and T == N and in_window:
        return "causal"
    qp = torch.arange(q0, q0 + T)[:, None]
    kp = torch.arange(k0, k0 + N)[None, :]
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    return ok


def _is(vis, what: str) -> bool:
    return isinstance(vis, str) and vis == what


def attend_math(q, k, v, bias, scale: float, softcap: float | None, precision: str = "ieee"):
    """Explicit attention. q [B, T, H, hd]; k, v [Bk, N, Hk, hd] with Bk == B, or Bk == 1 for keys every batch
    row shares (the batch is folded into the query rows: no copy of k / v per row); bias: None (all visible)
    or float32 [T, 1, N], 0 / -inf. Returns o [B, T, H, hd] (q's dtype) and lse [B, T, H] float32 (-inf where
    a query sees no key; its o is 0 then). In place on its own temporaries, except while autograd records
    (the exact-gradient ascent): in-place ops would overwrite what the backward needs, so the same operations
    run out of place then. precision: a float32 attention's two products as the tensor cores round them
    (tensor_cores.tc_matmul; 'ieee': torch.matmul)."""
    mm = torch.matmul if precision == "ieee" or q.dtype != torch.float32 else (
        lambda a, b: tc_matmul(a, b, precision))
    B, T, H, hd = q.shape
    Bk, N, Hk, _ = k.shape
    G = H // Hk
    Bq, X = (1, B) if (Bk == 1 and B > 1) else (B, 1)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    qq = q.view(Bq, X, T, Hk, G, hd).permute(0, 3, 1, 2, 4, 5).reshape(Bq, Hk, X * T * G, hd)
    s = mm(qq, k.permute(0, 2, 3, 1))  # [Bq, Hk, X*T*G, N]
    s = s.float() if s.dtype != torch.float32 else s
    if grad:
        s = s * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s = (s.view(Bq, Hk, X, T, G, N) + bias).view(s.shape)
    else:
        s.mul_(scale)
        if softcap is not None:
            s.div_(softcap).tanh_().mul_(softcap)
        if bias is not None:
            s.view(Bq, Hk, X, T, G, N).add_(bias)
    m = s.amax(dim=-1, keepdim=True)
    if bias is not None:
        m = m.masked_fill(m == -math.inf, 0.0)  # a row that sees nothing: e = 0, l = 0, lse = -inf, o = 0
    if grad:
        m = m.detach()  # any shift gives the same softmax; a constant one keeps amax's ties out of the backward
        e = torch.exp(s - m)
    else:
        e = s.sub_(m).exp_()  # unnormalised probabilities, in place of the scores
    l = e.sum(dim=-1, keepdim=True)
    lse = m + l.log()
    if bias is not None:
        l = l.clamp(min=torch.finfo(torch.float32).tiny)
    vv = v.transpose(1, 2)  # [Bk, Hk, N, hd]
    if v.dtype == torch.float32:
        o = mm(e, vv)
        o = o / l if grad else o.div_(l)  # [Bq, Hk, X*T*G, hd]
    else:  # normalise in float32 before the cast, as transformers' eager attention
        o = torch.matmul((e / l if grad else e.div_(l)).to(v.dtype), vv)
    o = o.view(Bq, Hk, X, T, G, hd).permute(0, 2, 3, 1, 4, 5).reshape(B, T, H, hd)
    lse = lse.view(Bq, Hk, X, T, G).permute(0, 2, 3, 1, 4).reshape(B, T, H)
    return o, lse


def _sdpa_lse(q, k, v, causal: bool, scale: float):
    """(o, lse) from torch's fused kernels. q [Bq, Hh, M, hd]; k, v [Bq, Hh, N, hd] (same batch and heads)."""
    if q.device.type == "cuda":
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                         scale=scale)[:2]
        return o, lse[..., : q.shape[2]]  # the kernel pads lse along the rows
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def attend_sdpa(q, k, v, vis, scale: float, need_lse: bool):
    """torch SDPA (no soft-capping). Same shapes as attend_math; returns None where it cannot be exact."""
    B, T, H, hd = q.shape
    Bk, N, Hk, _ = k.shape
    G = H // Hk
    if not need_lse:
        if Bk != B:
            return None
        mask = None if isinstance(vis, str) else vis
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=_is(vis, "causal"), scale=scale,
                                           enable_gqa=G > 1)
        return o.transpose(1, 2), None
    if _is(vis, "all"):  # fold batch and query groups into rows: one [1 or B, Hk, X*T*G, hd] problem
        Bq, X = (1, B) if (Bk == 1 and B > 1) else (B, 1)
        qq = q.view(Bq, X, T, Hk, G, hd).permute(0, 3, 1, 2, 4, 5).reshape(Bq, Hk, X * T * G, hd)
        o, lse = _sdpa_lse(qq, k.transpose(1, 2), v.transpose(1, 2), False, scale)
        o = o.reshape(Bq, Hk, X, T, G, hd).permute(0, 2, 3, 1, 4, 5).reshape(B, T, H, hd)
        return o, lse.reshape(Bq, Hk, X, T, G).permute(0, 2, 3, 1, 4).reshape(B, T, H)
    if _is(vis, "causal") and Bk == B:  # square and aligned: the kernel's own causal mask
        kk = k.repeat_interleave(G, dim=2) if G > 1 else k
        vv = v.repeat_interleave(G, dim=2) if G > 1 else v
        o, lse = _sdpa_lse(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), True, scale)
        return o.transpose(1, 2), lse.transpose(1, 2)
    return None


def attend_flash(q, k, v, vis, q0: int, k0: int, window, scale: float, softcap):
    """flash-attn (CUDA, fp16 / bf16). Returns None where it cannot be exact (then the caller uses math)."""
    if _flash_attn_func is None or q.dtype not in (torch.float16, torch.bfloat16) or q.device.type != "cuda":
        return None
    B, T, H, hd = q.shape
    Bk, N = k.shape[:2]
    cap = 0.0 if softcap is None else float(softcap)
    if _is(vis, "all"):
        qq = q.reshape(1, B * T, H, hd) if (Bk == 1 and B > 1) else q
        o, lse, _ = _flash_attn_func(qq, k, v, softmax_scale=scale, causal=False, softcap=cap,
                                     return_attn_probs=True)
        return o.reshape(B, T, H, hd), lse.transpose(1, 2).reshape(B, T, H)
    if q0 == k0 and T == N and Bk == B:  # square, aligned: causal + window (key > query - window)
        ws = (window - 1, 0) if window is not None else (-1, -1)
        o, lse, _ = _flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=ws, softcap=cap,
                                     return_attn_probs=True)
        return o, lse.transpose(1, 2)
    return None


def merge(o1, lse1, o2, lse2):
    """Attention over the union of two key sets from each part's (output, log-sum-exp)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def attention_rows_reference(attention: Attention, q, k, v, rows, window, prefix=None, o_ref=None,
                             dtype=None) -> torch.Tensor:
    """Attention.rows composed from the kernel's own calls (lead rows, then the batch rows over the prefix) and the
    difference form of its output (sicl_fast.models.rows.to_rows, in `dtype`: the low dtype by default, float32 for
    the values themselves): the reference of the fused forms."""
    from .rows import LOW_DTYPE, to_rows

    lead, B, T = rows.lead, rows.B, rows.T
    H, hd = q.shape[1:]
    parts = []
    if lead:
        parts.append(attention(q[None, :lead], k[None, :lead], v[None, :lead], 0, window).view(lead, H * hd))
        prefix = (k[None, :lead], v[None, :lead])
    if B:
        pos0 = rows.pos0
        o = attention(rows.batch(q), rows.batch(k), rows.batch(v), pos0, window, prefix)
        parts.append(o.reshape(B * T, H * hd))
    return to_rows(torch.cat(parts) if len(parts) > 1 else parts[0], rows, dtype or LOW_DTYPE, o_ref)


def rows_need_math(q) -> bool:
    """Autograd records through q: the fused kernels have no backward (never the case in a perturbation pass)."""
    return torch.is_grad_enabled() and q.requires_grad


def flash_available() -> bool:
    """Is flash-attn importable (the optional extra)?"""
    return _flash_attn_func is not None


class Attention:
    """The attention of one model: its kernel (`impl`: 'math', 'sdpa', 'flash', 'cpp' or 'triton', as the run plan
    resolved it, sicl_fast.run.plan.resolve_attention), scale, soft-cap, and a cache of masks per shape. `kernels`:
    the fused forms 'cpp' and 'triton' run, handed in as the decoder's other ops are (sicl_fast.ops.attention_kernels:
    `attention` and `attention_rows` for 'cpp', `prefix_attention` and `attention_rows` for 'triton'); the other
    kernels are torch's and flash-attn's. precision: a float32 attention's products (module docstring: 'tf32x3' on the
    Triton kernel, or emulated on the math path; 'ieee' on every kernel). On CUDA a fused kernel is trusted only after
    `verify` (FastBackend calls it once, explicitly)."""

    def __init__(self, impl: str, scale: float, softcap: float | None, dtype, device, kernels=None,
                 precision: str = "ieee") -> None:
        self.scale, self.softcap, self.dtype, self.device = scale, softcap, dtype, torch.device(device)
        if impl in ("cpp", "triton") and kernels is None:
            raise SiclError(f"the {impl!r} attention runs the kernels it is handed: pass "
                            f"kernels=sicl_fast.ops.attention_kernels({impl!r})")
        if precision != "ieee" and impl not in PRECISE_IMPLS:
            raise SiclError(f"the {impl!r} attention multiplies in IEEE float32; precision {precision!r} runs on "
                            f"{' and '.join(repr(i) for i in PRECISE_IMPLS)} (sicl_fast.run.plan)")
        self._kernels = kernels
        self.impl = impl
        self.precision = precision  # a float32 attention's products (module docstring)
        self._masks: dict = {}

    def _math_precision(self, impl: str) -> str:
        """The precision of the math path's products in a call of kernel `impl`: this attention's where it is the
        math path itself (the emulation), IEEE where a fused kernel hands a call over or a check's reference runs."""
        return self.precision if impl == self.impl == "math" else "ieee"

    def masks(self, q0: int, T: int, k0: int, N: int, window):
        """(visibility, bool mask [T, N] or None, additive float32 bias [T, 1, N] or None) on the device, cached."""
        key = (q0, T, k0, N, window)
        got = self._masks.get(key)
        if got is None:
            vis = visibility(q0, T, k0, N, window)
            if isinstance(vis, str) and vis == "all":
                mask = None
            elif isinstance(vis, str):  # 'causal': square and aligned
                mask = torch.ones(T, N, dtype=torch.bool).tril()
            else:
                mask = vis
            bias = None
            if mask is not None:
                bias = torch.zeros(T, 1, N, dtype=torch.float32).masked_fill_(~mask.view(T, 1, N), -math.inf)
                mask, bias = mask.to(self.device), bias.to(self.device)
            if not isinstance(vis, str):
                vis = mask
            if len(self._masks) > 256:
                self._masks.clear()
            got = self._masks[key] = (vis, mask, bias)
        return got

    def __call__(self, q, k, v, pos0: int, window, prefix=None, cache_len: int | None = None, impl=None):
        """q [B, T, H, hd] at positions pos0 ..; k, v [B, N, Hk, hd]: the same rows (N == T) or, with
        cache_len, a KV cache's keys at positions 0 .. cache_len-1. prefix: (k, v) [1, pos0, Hk, hd] of
        positions 0 .. pos0-1, shared by every row. impl: another kernel than self.impl (verify's reference).
        -> o [B, T, H, hd]."""
        impl = impl or self.impl
        T = q.shape[1]
        if impl == "triton" and (cache_len is None or (pos0 == 0 and cache_len == T)):
            return self._kernels.prefix_attention(q, k, v, prefix, pos0, window, self.scale, self.softcap,
                                                  precision=self.precision if impl == self.impl else "ieee")
        if impl == "cpp" and q.dtype == torch.float32 and not (torch.is_grad_enabled() and (q.requires_grad
                                                                                          or k.requires_grad)):
            return self._kernels.attention(q, k, v, prefix, pos0, 0 if cache_len is not None else pos0, self.scale,
                                       self.softcap, window)
        parts = [(k, v, 0 if cache_len is not None else pos0)]
        if prefix is not None:
            parts.insert(0, (prefix[0], prefix[1], 0))
        need_lse = len(parts) > 1
        out = None
        for kk, vv, k0 in parts:
            vis, mask, bias = self.masks(pos0, T, k0, kk.shape[1], window)
            res = None
            if impl == "flash":
                res = attend_flash(q, kk, vv, vis, pos0, k0, window, self.scale, self.softcap)
            elif impl == "sdpa" and self.softcap is None:
                res = attend_sdpa(q, kk, vv, vis, self.scale, need_lse)
            if res is None:
                res = attend_math(q, kk, vv, bias, self.scale, self.softcap, self._math_precision(impl))
            out = res if out is None else (merge(out[0], out[1], res[0], res[1]), None)
        return out[0]

    def rows(self, q, k, v, rows, window, prefix=None, o_ref=None) -> torch.Tensor:
        """The attention of a difference-form pass (sicl_fast.models.rows): q [R, H, hd] float32 and the pass's own
        K/V k, v [R, Hk, hd] float32 (the lead rows first, then the B x T batch rows) -> o [R, H hd] in difference
        form (low dtype; the value rows against o_ref [V, H hd], their reference, when given). The lead rows attend
        causally among themselves (positions 0 ..); each batch row attends to the prefix (the lead rows' K/V, or
        `prefix` (k, v) [1, a, Hk, hd] kept from an earlier pass) and causally to its own keys. The C++ and Triton
        kernels do it in one call (csrc/attention.cpp, kernels/attention.py); the other kernels compose it:
        attention_rows_reference."""
        if self.impl == "cpp" and not rows_need_math(q):
            return self._kernels.attention_rows(q, k, v, rows, prefix, self.scale, self.softcap, window, o_ref)
        if self.impl == "triton":
            return self._kernels.attention_rows(q, k, v, rows, prefix, self.scale, self.softcap, window, o_ref,
                                                precision=self.precision)
        return attention_rows_reference(self, q, k, v, rows, window, prefix, o_ref)

    def decode(self, q, k, v, keys: torch.Tensor, pos: torch.Tensor, window) -> torch.Tensor:
        """One query q [1, 1, H, hd] at the position held in pos (int64 [1] device tensor) over a whole KV buffer
        k, v [1, max_len, Hk, hd] whose key positions are keys [max_len]: the keys after pos (and, with a window,
        at or before pos - window) are masked on the device. -> o [1, 1, H, hd]."""
        seen = keys <= pos
        if window is not None:
            seen &= keys > pos - window
        bias = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(~seen, -math.inf)
        return attend_math(q, k, v, bias.view(1, 1, -1), self.scale, self.softcap)[0]

    def max_error(self, H: int, Hk: int, hd: int, dtype=None) -> float:
        """Largest difference between this kernel and the math path in float32, on small random problems in `dtype`
        (None: the model's) with and without a shared prefix and a window. The kernel's own exceptions propagate."""
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(self.device, dtype or self.dtype)  # noqa: E731
        B, T, a = 3, 37, 21
        q, k, v = mk(B, T, H, hd), mk(B, T, Hk, hd), mk(B, T, Hk, hd)
        kp, vp = mk(1, a, Hk, hd), mk(1, a, Hk, hd)
        f32 = lambda t: t.float()  # noqa: E731
        err = 0.0
        for window in (None, 24):
            for prefix in (None, (kp, vp)):
                pos0 = a if prefix else 0
                got = self(q, k, v, pos0, window, prefix)
                ref = self(f32(q), f32(k), f32(v), pos0, window, None if prefix is None else (f32(kp), f32(vp)),
                           impl="math")
                err = max(err, float((got.float() - ref).abs().max()))
        return err

    def rows_error(self, H: int, Hk: int, hd: int) -> float:
        """Largest difference between this kernel's attention of a difference-form pass (rows) and the math path's
        composition (attention_rows_reference), beyond a bf16 ulp of the form (float32 rows: lead rows, or a kept
        prefix; with and without a window). The kernel's own exceptions propagate."""
        from .rows import RowLayout

        g = torch.Generator(device="cpu").manual_seed(1)
        mk = lambda *s: torch.randn(*s, generator=g).to(self.device, torch.float32)  # noqa: E731
        ref_attn = Attention("math", self.scale, self.softcap, torch.float32, self.device)
        B, T, a = 3, 37, 21
        err = 0.0
        for window in (None, 24):
            for lead in (0, a):
                rows = RowLayout.build(lead, B, T, a, device=self.device)
                q, k, v = mk(rows.R, H, hd), mk(rows.R, Hk, hd), mk(rows.R, Hk, hd)
                prefix = None if lead else (mk(1, a, Hk, hd), mk(1, a, Hk, hd))
                got = self.rows(q, k, v, rows, window, prefix).float()
                ref = attention_rows_reference(ref_attn, q, k, v, rows, window, prefix).float()
                err = max(err, float(((got - ref).abs() - ref.abs() * 2 ** -7).max()))
        return err

    def checks(self, H: int, Hk: int, hd: int, rows: bool) -> list:
        """[(what, error function, tolerance)]: every form of this kernel a model of heads H / Hk of hd runs: its
        prefix attention in the model dtype and, with the difference form (rows), in float32 (the value rows'
        reference pass) and over a pass's rows (the fused kernels' attention_rows)."""
        names = {"triton": ("prefix_attention", "attention_rows"), "cpp": ("attention", "attention_rows"),
                 "flash": ("flash_attn_func", None), "sdpa": ("scaled_dot_product_attention", None)}[self.impl]
        dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
        out = [(f"{names[0]} ({dt(self.dtype)}, head_dim {hd})", lambda: self.max_error(H, Hk, hd),
                1e-4 if self.dtype == torch.float32 else 5e-2)]
        if rows and self.dtype != torch.float32:
            out.append((f"{names[0]} (float32, head_dim {hd}: the reference pass)",
                        lambda: self.max_error(H, Hk, hd, torch.float32), 1e-4))
        if rows and names[1]:
            out.append((f"{names[1]} (float32 rows, head_dim {hd})", lambda: self.rows_error(H, Hk, hd), 1e-5))
        return out

    def verify(self, H: int, Hk: int, hd: int, fallback: bool, rows: bool = False) -> str | None:
        """Check the chosen kernel against the math path, once (the run plan does it on CUDA,
        sicl_fast.run.plan.verify_attention): every form a model of these heads runs (checks). On a mismatch or any
        error of a kernel (Triton's OutOfResources or CompilationError is a TritonError, not a RuntimeError): with
        fallback (impl 'auto'), warn naming the kernel and why, and use 'math'; without (a kernel asked for by
        name), raise. Returns the problem (None: the kernel passed, or is the math path)."""
        if self.impl == "math":
            return None
        problem = None
        for what, run, tol in self.checks(H, Hk, hd, rows):
            try:
                err = run()
            except Exception as exc:  # any kernel error: the math path takes over (or the error is raised)
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                problem = f"{what} raised {type(exc).__name__}: {lines[0][:300].rstrip('.') if lines else ''}"
            else:  # NaN fails too
                problem = None if err <= tol else f"{what} differs from the math path by {err:.3g} (tolerance {tol})"
            if problem is not None:
                break
        if problem is None:
            return None
        msg = f"fast backend: the {self.impl!r} attention failed its check on this machine: {problem}"
        if not fallback:
            raise SiclError(msg + "; use attn='math'")
        warnings.warn(msg + "; using 'math'", RuntimeWarning, stacklevel=3)
        self.impl, self.precision = "math", "ieee"  # the math path in IEEE float32 (no emulation)
        return problem


__all__ = ["ATTN_IMPLS", "PRECISE_IMPLS", "Attention", "flash_available", "visibility", "attend_math", "attend_sdpa",
           "attend_flash", "merge", "attention_rows_reference"]
