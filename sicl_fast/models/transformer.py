"""Our own decoder forward for the fast backend: Llama (3.1 rope scaling, SmolLM2), Qwen3, Gemma 2, Gemma 3 text.

Weights are the loaded transformers model's own tensors (no copies); numerics follow transformers 5.17's modeling
files step by step (same dtype casts, same norm forms, rope tables computed in float32 and cast to the model dtype).

    x [B, T, d] (what the input-embedding module returns; rows at positions pos0 .. pos0+T-1)
      -> per layer: norm -> q, k, v -> (q/k norm) -> rope -> attention (causal, sliding window, soft-cap)
                    -> o_proj -> (post-norm) -> residual -> norm -> gated MLP -> (post-norm) -> residual
      -> final norm -> hidden [B, T, d]

Attention keys can come in two parts whose results are merged by log-sum-exp: a shared prefix (K/V of rows
[0, a), batch 1, attended to by every batch row without being copied) and the rows themselves. Kernels:
  math   explicit scores, float32 softmax; handles soft-capping, sliding windows, any mask (the CPU default)
  sdpa   torch's scaled_dot_product_attention (no soft-capping; falls back to math for what it cannot do exactly)
  flash  flash-attn's flash_attn_func (CUDA, fp16/bf16, optional import)

Difference products (`forward(near_row0=True)` on a float32 model with `diff_matmul` on; sicl_fast.models.diff):
in a perturbation batch rows 1.. are row 0 plus small differences, so each projection multiplies row 0 in
float32 and the differences in bf16. Norms, rotary, attention and the activations stay float32 on every row.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SiclError
from . import diff

SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")
_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
ATTN_IMPLS = ("auto", "math", "sdpa", "flash")
DIFF_MATMUL = ("auto", "off", "bf16")

try:  # optional; never needed on the CPU
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # ImportError, or a broken CUDA build
    _flash_attn_func = None


class UnsupportedModelError(SiclError):
    """The fast backend has no forward for this model family."""


def unsupported(family: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the fast backend supports the model families {', '.join(SUPPORTED_FAMILIES)} (Llama 3.x / SmolLM2, "
        f"Qwen3, Gemma 2, Gemma 3 text); this model is {family!r}: use the 'hf' backend for it"
    )


# --------------------------------------------------------------------------------------------------- rotary


def rope_inv_freq(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling) for a transformers `rope_parameters` dict."""
    kind = params.get("rope_type", "default")
    base = params["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported by the fast backend")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":  # Llama 3.1: low frequencies divided by `factor`, a smooth ramp in between
        factor = params["factor"]
        lo, hi = params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise UnsupportedModelError(
        f"rope_type {kind!r} is not supported by the fast backend (default, linear, llama3); use the 'hf' backend"
    )


class Rotary:
    """cos / sin tables [n, head_dim] in the model dtype, grown on demand (float32 math, as transformers)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, device) -> None:
        self.inv_freq = inv_freq.to(device)
        self.scaling = scaling
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype, device=device)

    def tables(self, pos0: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, hd] for positions pos0 .. pos0+T-1 (broadcast over heads)."""
        if pos0 + T > self.cos.shape[0]:
            n = 1 << max(6, (pos0 + T - 1).bit_length())
            pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float)
            freqs = pos[:, None] * self.inv_freq[None, :]  # [n, hd/2]; a K=1 product, as transformers' matmul
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
            self.cos = (emb.cos() * self.scaling).to(self.dtype)
            self.sin = (emb.sin() * self.scaling).to(self.dtype)
        return self.cos[pos0:pos0 + T, None], self.sin[pos0:pos0 + T, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd], cos / sin [T, 1, hd]."""
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------------------------------- attention


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


def attend_math(q, k, v, bias, scale: float, softcap: float | None):
    """Explicit attention. q [B, T, H, hd]; k, v [Bk, N, Hk, hd] with Bk == B, or Bk == 1 for keys every batch
    row shares (the batch is folded into the query rows: no copy of k / v per row); bias: None (all visible)
    or float32 [T, 1, N], 0 / -inf. Returns o [B, T, H, hd] (q's dtype) and lse [B, T, H] float32 (-inf where
    a query sees no key; its o is 0 then)."""
    B, T, H, hd = q.shape
    Bk, N, Hk, _ = k.shape
    G = H // Hk
    Bq, X = (1, B) if (Bk == 1 and B > 1) else (B, 1)
    qq = q.view(Bq, X, T, Hk, G, hd).permute(0, 3, 1, 2, 4, 5).reshape(Bq, Hk, X * T * G, hd)
    s = torch.matmul(qq, k.permute(0, 2, 3, 1))  # [Bq, Hk, X*T*G, N]
    s = s.float() if s.dtype != torch.float32 else s
    s.mul_(scale)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        s.view(Bq, Hk, X, T, G, N).add_(bias)
    m = s.amax(dim=-1, keepdim=True)
    if bias is not None:
        m.masked_fill_(m == -math.inf, 0.0)  # a row that sees nothing: e = 0, l = 0, lse = -inf, o = 0
    e = s.sub_(m).exp_()  # unnormalised probabilities, in place of the scores
    l = e.sum(dim=-1, keepdim=True)
    lse = m + l.log()
    if bias is not None:
        l.clamp_(min=torch.finfo(torch.float32).tiny)
    vv = v.transpose(1, 2)  # [Bk, Hk, N, hd]
    if v.dtype == torch.float32:
        o = torch.matmul(e, vv).div_(l)  # [Bq, Hk, X*T*G, hd]
    else:  # normalise in float32 before the cast, as transformers' eager attention
        o = torch.matmul(e.div_(l).to(v.dtype), vv)
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


# --------------------------------------------------------------------------------------------------- model


@dataclass
class Layer:
    """One decoder layer's tensors (the transformers model's own parameters) and switches."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    bo: torch.Tensor | None
    attn_norm: torch.Tensor  # before attention
    mlp_norm: torch.Tensor  # before the MLP
    post_attn_norm: torch.Tensor | None  # Gemma: on the attention output
    post_mlp_norm: torch.Tensor | None  # Gemma: on the MLP output
    q_norm: torch.Tensor | None  # Qwen3 / Gemma 3: per-head RMSNorm of q and k
    k_norm: torch.Tensor | None
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    b_gate: torch.Tensor | None
    b_up: torch.Tensor | None
    b_down: torch.Tensor | None
    window: int | None  # sliding window (keys > query - window), None: full attention
    rope: str  # key into Transformer.rotary


@dataclass
class LowWeights:
    """One layer's projection weights, concatenated per product and cast once to the difference dtype."""

    qkv: torch.Tensor  # [(H + 2 Hk) hd, d]: q, k, v stacked
    o: torch.Tensor  # [d, H hd]
    gate_up: torch.Tensor  # [2 I, d]: gate, up stacked
    down: torch.Tensor  # [d, I]


def fast_low_precision(device: torch.device) -> bool:
    """Does this device multiply bf16 much faster than float32 (AVX512-BF16 / AMX CPUs, CUDA sm_80+)?"""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cpu":
        return any(bool(getattr(torch.cpu, name, lambda: False)())
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


@dataclass
class PrefixKV:
    """K/V of the prefix rows [0, a) (batch 1), and their final hidden states, for the embeddings `rows`."""

    rows: torch.Tensor  # [a, d] in the model dtype: the cache key
    kv: list  # per layer (k, v), each [1, a, Hk, hd]
    hidden: torch.Tensor  # [1, a, d] after the final norm

    @property
    def length(self) -> int:
        return int(self.rows.shape[0])


class StaticCache:
    """K/V buffers [1, max_len, Hk, hd] per layer for greedy decoding; `length` rows are filled."""

    def __init__(self, n_layers: int, max_len: int, Hk: int, hd: int, dtype, device) -> None:
        self.k = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0


def _param(module, name):
    p = getattr(module, name, None) if module is not None else None
    return None if p is None else p.detach()


class Transformer:
    """The decoder of a loaded transformers model, run by our own code. `lm` is a LoadedModel."""

    def __init__(self, lm, attn: str = "auto", diff_matmul: str = "auto") -> None:
        family = lm.family
        if family not in SUPPORTED_FAMILIES:
            raise unsupported(family)
        if attn not in ATTN_IMPLS:
            raise SiclError(f"unknown attention implementation {attn!r}; choose one of {ATTN_IMPLS}")
        if diff_matmul not in DIFF_MATMUL:
            raise SiclError(f"unknown diff_matmul {diff_matmul!r}; choose one of {DIFF_MATMUL}")
        if diff_matmul == "bf16" and lm.dtype != torch.float32:
            raise SiclError(f"diff_matmul='bf16' is for float32 models; this one is {lm.dtype} (use 'off')")
        cfg = lm.text_config
        dec = lm.decoder
        if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
            raise unsupported(f"{family} ({type(lm.model).__name__} without a plain decoder)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention (embedding models) is not supported by the fast "
                                        "backend")
        self.family = family
        self.gemma = family in _GEMMA
        self.dtype = lm.dtype
        self.device = lm.device
        self.d = int(cfg.hidden_size)
        self.H = int(cfg.num_attention_heads)
        self.Hk = int(getattr(cfg, "num_key_value_heads", None) or self.H)
        self.hd = int(getattr(cfg, "head_dim", None) or self.d // self.H)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5 if self.gemma else self.hd ** -0.5
        # transformers passes the attention soft-cap only in Gemma 2 (Gemma 3's config has the field, unused)
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if family == "gemma2" else None
        self.final_softcap = lm.final_softcap
        act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act_name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act_name!r} is not supported by the fast backend")
        self.act = _ACTIVATIONS[act_name]
        self.act_name = act_name
        self.embed = lm.model.get_input_embeddings()
        # transformers 5 Gemma embedding modules scale themselves (X is scaled); older Gemma 2 code scaled
        # inputs_embeds by sqrt(d) in the model dtype inside the forward, with a plain nn.Embedding.
        self.embed_mult = None
        if family == "gemma2" and not hasattr(self.embed, "embed_scale"):
            self.embed_mult = torch.tensor(self.d ** 0.5, dtype=self.dtype, device=self.device)
        self.head = lm.head_weight.detach()

        # rotary tables: one per rope parameter set (Gemma 3: local for sliding layers, global for full ones)
        n = int(cfg.num_hidden_layers)
        layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
        rp = cfg.rope_parameters
        per_type = isinstance(rp, dict) and "rope_theta" not in rp and all(isinstance(v, dict) for v in rp.values())
        self.rotary: dict[str, Rotary] = {}
        for t in sorted(set(layer_types)):
            key = t if per_type else "all"
            if key not in self.rotary:
                inv, sc = rope_inv_freq(rp[t] if per_type else rp, self.hd)
                self.rotary[key] = Rotary(inv, sc, self.dtype, self.device)
        window = getattr(cfg, "sliding_window", None)

        self.layers: list[Layer] = []
        for i, layer in enumerate(dec.layers[:n]):
            at, mlp = layer.self_attn, layer.mlp
            sliding = layer_types[i] == "sliding_attention"
            if sliding and window is None:
                raise UnsupportedModelError(f"layer {i} is a sliding-window layer but the config has no window")
            self.layers.append(Layer(
                wq=_param(at.q_proj, "weight"), wk=_param(at.k_proj, "weight"), wv=_param(at.v_proj, "weight"),
                wo=_param(at.o_proj, "weight"), bq=_param(at.q_proj, "bias"), bk=_param(at.k_proj, "bias"),
                bv=_param(at.v_proj, "bias"), bo=_param(at.o_proj, "bias"),
                attn_norm=self._norm_weight(layer.input_layernorm),
                mlp_norm=self._norm_weight(layer.pre_feedforward_layernorm if self.gemma
                                           else layer.post_attention_layernorm),
                post_attn_norm=self._norm_weight(layer.post_attention_layernorm) if self.gemma else None,
                post_mlp_norm=self._norm_weight(layer.post_feedforward_layernorm) if self.gemma else None,
                q_norm=self._norm_weight(getattr(at, "q_norm", None)),
                k_norm=self._norm_weight(getattr(at, "k_norm", None)),
                w_gate=_param(mlp.gate_proj, "weight"), w_up=_param(mlp.up_proj, "weight"),
                w_down=_param(mlp.down_proj, "weight"), b_gate=_param(mlp.gate_proj, "bias"),
                b_up=_param(mlp.up_proj, "bias"), b_down=_param(mlp.down_proj, "bias"),
                window=int(window) if sliding else None,
                rope=layer_types[i] if per_type else "all",
            ))
        self.final_norm = self._norm_weight(dec.norm)
        # bf16 difference products (module docstring): 'auto' where bf16 products are much faster than float32
        use_diff = diff_matmul == "bf16" or (diff_matmul == "auto" and self.dtype == torch.float32
                                              and fast_low_precision(self.device))
        self.diff_dtype = torch.bfloat16 if use_diff else None
        self._low: list[LowWeights] | None = None  # built on the first difference forward
        self._masks: dict = {}
        self.attn = self._pick_attn(attn)

    # ----------------------------------------------------------------------------------------- pieces

    def _norm_weight(self, module):
        """Gemma: the float32 factor (1 + w), as transformers computes it; others: w itself (model dtype)."""
        if module is None:
            return None
        w = module.weight.detach()
        return (1.0 + w.float()) if self.gemma else w

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:  # (x * (1 + w)) in float32, then the model dtype
            return (xf * w).type_as(x)
        return w * xf.to(x.dtype)  # Llama / Qwen: cast, then multiply

    def _pick_attn(self, attn: str) -> str:
        if attn == "auto":
            if self.device.type != "cuda":
                # torch's CPU flash kernel: exact to 1e-5 against math (tested) and ~1.5x faster at SmolLM2's
                # head shapes; soft-capped layers still go to the math path
                return "sdpa"
            if _flash_attn_func is not None and self.dtype in (torch.float16, torch.bfloat16):
                attn = "flash"
            else:
                attn = "sdpa"
        if attn == "flash" and _flash_attn_func is None:
            raise SiclError("attention implementation 'flash' asked for, but flash-attn is not installed")
        if attn != "math" and self.device.type == "cuda" and not self._self_check(attn):
            warnings.warn(f"fast backend: the {attn!r} attention path disagrees with the math path on this "
                          f"machine; using 'math'", RuntimeWarning, stacklevel=3)
            return "math"
        return attn

    def _self_check(self, attn: str) -> bool:
        """Small random problems (with / without a shared prefix and a window) through `attn` and through the
        math path in float32: do they agree? Guards the private / optional kernels on a new machine."""
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            mk = lambda *s: torch.randn(*s, generator=g).to(self.device, self.dtype)  # noqa: E731
            B, T, a, H, Hk, hd = 3, 37, 21, self.H, self.Hk, self.hd
            q, k, v = mk(B, T, H, hd), mk(B, T, Hk, hd), mk(B, T, Hk, hd)
            kp, vp = mk(1, a, Hk, hd), mk(1, a, Hk, hd)
            f32 = lambda t: t.float()  # noqa: E731
            tol = 1e-4 if self.dtype == torch.float32 else 5e-2
            ok = True
            for window in (None, 24):
                for prefix in (None, (kp, vp)):
                    pos0 = a if prefix else 0
                    self.attn = attn
                    got = self.attention(q, k, v, pos0, window, prefix)
                    self.attn = "math"
                    ref = self.attention(f32(q), f32(k), f32(v), pos0, window,
                                         None if prefix is None else (f32(kp), f32(vp)))
                    ok = ok and bool(torch.allclose(got.float(), ref, atol=tol, rtol=tol))
            return ok
        except Exception:  # a private kernel missing, or refusing the shapes
            return False
        finally:
            self.attn = attn

    def low_weights(self) -> list[LowWeights]:
        """Per layer, the stacked projection weights in the difference dtype (made once: half the float32
        weights' memory in bf16)."""
        if self._low is None:
            dt = self.diff_dtype
            self._low = [LowWeights(qkv=torch.cat([L.wq, L.wk, L.wv]).to(dt), o=L.wo.to(dt),
                                    gate_up=torch.cat([L.w_gate, L.w_up]).to(dt), down=L.w_down.to(dt))
                         for L in self.layers]
        return self._low

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

    def attention(self, q, k, v, pos0: int, window, prefix=None, cache_len: int | None = None):
        """q [B, T, H, hd] at positions pos0 ..; k, v [B, N, Hk, hd]: the same rows (N == T) or, with
        cache_len, a KV cache's keys at positions 0 .. cache_len-1. prefix: (k, v) [1, pos0, Hk, hd] of
        positions 0 .. pos0-1, shared by every row. -> o [B, T, H, hd]."""
        T = q.shape[1]
        parts = [(k, v, 0 if cache_len is not None else pos0)]
        if prefix is not None:
            parts.insert(0, (prefix[0], prefix[1], 0))
        need_lse = len(parts) > 1
        out = None
        for kk, vv, k0 in parts:
            vis, mask, bias = self.masks(pos0, T, k0, kk.shape[1], window)
            res = None
            if self.attn == "flash":
                res = attend_flash(q, kk, vv, vis, pos0, k0, window, self.scale, self.attn_softcap)
            elif self.attn == "sdpa" and self.attn_softcap is None:
                res = attend_sdpa(q, kk, vv, vis, self.scale, need_lse)
            if res is None:
                res = attend_math(q, kk, vv, bias, self.scale, self.attn_softcap)
            out = res if out is None else (merge(out[0], out[1], res[0], res[1]), None)
        return out[0]

    def block(self, L: Layer, x: torch.Tensor, pos0: int, prefix=None, cache: StaticCache | None = None,
              i: int = 0, low: LowWeights | None = None, keep_kv: bool = False):
        """One decoder layer on x [B, T, d] at positions pos0 .. pos0+T-1. Returns (x, (k, v) of these rows if
        keep_kv, else None). low: the layer's bf16 weights for difference products (rows 1.. near row 0), None
        for plain ones. Temporaries are dropped as soon as they are used (`del`): the peak memory is that of
        one sub-block, as in transformers' own layers."""
        B, T, _ = x.shape
        h = self.norm(x, L.attn_norm)
        if low is None:
            q = F.linear(h, L.wq, L.bq)
            k = F.linear(h, L.wk, L.bk)
            v = F.linear(h, L.wv, L.bv)
        else:
            qkv = diff.linear(h, (L.wq, L.wk, L.wv), (L.bq, L.bk, L.bv), low.qkv)
            q, k, v = qkv.split([L.wq.shape[0], L.wk.shape[0], L.wv.shape[0]], dim=-1)
            del qkv
        del h
        q = q.view(B, T, self.H, self.hd)
        k = k.view(B, T, self.Hk, self.hd)
        v = v.view(B, T, self.Hk, self.hd)
        if L.q_norm is not None:
            q, k = self.norm(q, L.q_norm), self.norm(k, L.k_norm)
        cos, sin = self.rotary[L.rope].tables(pos0, T)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write this step's rows, attend to everything written so far
            cache.k[i][:, pos0:pos0 + T] = k
            cache.v[i][:, pos0:pos0 + T] = v
            o = self.attention(q, cache.k[i][:, :pos0 + T], cache.v[i][:, :pos0 + T], pos0, L.window,
                               cache_len=pos0 + T)
        else:
            o = self.attention(q, k, v, pos0, L.window, prefix)
        kv = (k, v) if keep_kv else None
        del q, k, v
        o = o.reshape(B, T, self.H * self.hd)
        if low is None:
            o = F.linear(o, L.wo, L.bo)
        else:
            o = diff.linear(o, (L.wo,), (L.bo,), low.o)
        if L.post_attn_norm is not None:
            o = self.norm(o, L.post_attn_norm)
        x = x + o
        del o
        h = self.norm(x, L.mlp_norm)
        if low is None:
            m = F.linear(self.act(F.linear(h, L.w_gate, L.b_gate)) * F.linear(h, L.w_up, L.b_up), L.w_down,
                         L.b_down)
        else:  # the gated activations come out as row 0 and bf16 differences, ready for the down product
            a0, da = diff.gated_diff(*diff.product(h[:1], diff.diff_rows(h), (L.w_gate, L.w_up),
                                                   (L.b_gate, L.b_up), low.gate_up), self.act, self.act_name)
            m = diff.add_rows(*diff.product(a0, da, (L.w_down,), (L.b_down,), low.down))
            del a0, da
        del h
        if L.post_mlp_norm is not None:
            m = self.norm(m, L.post_mlp_norm)
        return x + m, kv

    # ----------------------------------------------------------------------------------------- forwards

    @torch.no_grad()
    def forward(self, x: torch.Tensor, pos0: int = 0, prefix: PrefixKV | None = None,
                cache: StaticCache | None = None, collect: bool = False, near_row0: bool = False):
        """x [B, T, d] (model dtype) at positions pos0 .. -> final-normed hidden [B, T, d]; with collect, also
        the per-layer (k, v). prefix: K/V of rows [0, pos0) shared by all rows; cache: generation KV cache.
        near_row0: rows 1.. are small perturbations of row 0, so difference products may be used (when
        enabled; see the module docstring)."""
        if prefix is not None and prefix.length != pos0:
            raise SiclError(f"prefix K/V covers {prefix.length} rows, the rows start at {pos0}")
        if self.embed_mult is not None:
            x = x * self.embed_mult
        use_diff = near_row0 and self.diff_dtype is not None and x.shape[0] > 1 and cache is None
        lows = self.low_weights() if use_diff else None
        kvs = []
        for i, L in enumerate(self.layers):
            x, kv = self.block(L, x, pos0, None if prefix is None else prefix.kv[i], cache, i,
                               None if lows is None else lows[i], keep_kv=collect)
            if collect:
                kvs.append(kv)
        if cache is not None:
            cache.length = pos0 + x.shape[1]
        h = self.norm(x, self.final_norm)
        return (h, kvs) if collect else h

    def prefix_kv(self, rows: torch.Tensor) -> PrefixKV:
        """Run the prefix rows [a, d] (model dtype) once, batch 1, keeping every layer's K/V."""
        h, kvs = self.forward(rows.unsqueeze(0), 0, collect=True)
        return PrefixKV(rows=rows.clone(), kv=kvs, hidden=h)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> logits [..., V] in the model dtype, soft-capped as transformers' LM head does."""
        z = F.linear(h, self.head)
        if self.final_softcap is not None:
            z = torch.tanh(z / self.final_softcap) * self.final_softcap
        return z

    def new_cache(self, max_len: int) -> StaticCache:
        return StaticCache(len(self.layers), max_len, self.Hk, self.hd, self.dtype, self.device)


__all__ = ["SUPPORTED_FAMILIES", "DIFF_MATMUL", "Transformer", "PrefixKV", "StaticCache", "UnsupportedModelError",
           "LowWeights", "fast_low_precision", "rope_inv_freq", "attend_math", "visibility", "merge",
           "unsupported"]
