"""Our own decoder forward for the fast backend: Llama (3.1 rope scaling, SmolLM2), Qwen3, Gemma 2, Gemma 3 text.

Weights are the loaded transformers model's own tensors (no copies); numerics follow transformers 5.17's modeling
files step by step (same dtype casts, same norm forms, rope tables computed in float32 and cast to the model dtype).

    x [B, T, d] (what the input-embedding module returns; rows at positions pos0 .. pos0+T-1)
      -> norm -> per layer: q, k, v products -> rotary (q / k norms) writing K / V in place -> attention
                            -> o product -> residual + norm -> gated MLP -> residual + next layer's norm
      -> hidden [B, T, d] (the last layer's residual add is fused with the final norm)

The elementwise work goes through the model's Ops object (sicl_fast.ops): TorchOps runs the reference
(sicl_fast.models.elementwise), TritonOps the fused kernels, so a layer is 12 launches with impl 'triton' (3 + 1 + 3
products, rotary, attention, two residual norms, the gated activation; tests/test_fused_decoder.py holds the
budget). Attention (sicl_fast.models.attention) reads the demonstration-free prefix's K/V from its PrefixKV for
every batch row without copying it (the Triton kernel in the same launch as the rows' own keys); the rows' K/V go
to per-layer buffers allocated once per batch shape (rows_kv). The products of each layer are a swappable object
(sicl_fast.models.projections): plain, or the difference products of a perturbation batch
(`forward(near_row0=True)` on a float32 model with `diff_matmul` on: row 0 in float32, the other rows'
differences in bf16; norms, rotary, attention and the activations stay float32 on every row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..errors import SiclError
from .attention import Attention
from .elementwise import ACTIVATIONS
from .projections import Dense, DiffDense, LowWeights

SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")
DIFF_MATMUL = ("auto", "off", "bf16", "fp8")


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

    def reserve(self, n: int) -> None:
        """Make the tables cover positions 0 .. n-1 (grown to a power of two, at least 64)."""
        if n > self.cos.shape[0]:
            n = 1 << max(6, (n - 1).bit_length())
            pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float)
            freqs = pos[:, None] * self.inv_freq[None, :]  # [n, hd/2]; a K=1 product, as transformers' matmul
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
            self.cos = (emb.cos() * self.scaling).to(self.dtype)
            self.sin = (emb.sin() * self.scaling).to(self.dtype)

    def tables(self, pos0: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, hd] for positions pos0 .. pos0+T-1 (broadcast over heads)."""
        self.reserve(pos0 + T)
        return self.cos[pos0:pos0 + T, None], self.sin[pos0:pos0 + T, None]

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, hd] for the position held in the int64 [1] device tensor pos (reserve first)."""
        return self.cos.index_select(0, pos)[:, None], self.sin.index_select(0, pos)[:, None]


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
    """K/V buffers [1, max_len, Hk, hd] per layer for greedy decoding; `length` rows are filled. Decoding
    (Transformer.decode_logits) writes the next position, held on the device in `pos` (int64 [1]), in place and
    attends over the whole fixed buffer with a mask: every token has the same shapes, whatever its position."""

    def __init__(self, n_layers: int, max_len: int, Hk: int, hd: int, dtype, device) -> None:
        self.k = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.keys = torch.arange(max_len, device=device)  # key positions, for the mask


def _param(module, name):
    p = getattr(module, name, None) if module is not None else None
    return None if p is None else p.detach()


class Transformer:
    """The decoder of a loaded transformers model, run by our own code. `lm` is a LoadedModel; attn the attention
    kernel (sicl_fast.models.attention); ops the Ops object whose epilogues the difference products use."""

    def __init__(self, lm, attn: str = "auto", diff_matmul: str = "auto", ops=None) -> None:
        family = lm.family
        if family not in SUPPORTED_FAMILIES:
            raise unsupported(family)
        if diff_matmul not in DIFF_MATMUL:
            raise SiclError(f"unknown diff_matmul {diff_matmul!r}; choose one of {DIFF_MATMUL}")
        if diff_matmul in ("bf16", "fp8") and lm.dtype != torch.float32:
            raise SiclError(f"diff_matmul={diff_matmul!r} is for float32 models; this one is {lm.dtype} (use 'off')")
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
        if act_name not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act_name!r} is not supported by the fast backend")
        self.act = ACTIVATIONS[act_name]
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
        # 'fp8' is never chosen by 'auto': its accuracy is measured (bench/diff_accuracy.py) but its speed is not yet
        self.diff_dtype = torch.bfloat16 if use_diff or diff_matmul == "fp8" else None
        self.diff_weights = "fp8" if diff_matmul == "fp8" else "bf16"
        if ops is None:
            from ..ops import TorchOps

            ops = TorchOps()
        self.ops = ops  # the elementwise work and the epilogues of the difference products
        self.dense = [Dense(L, act_name, ops) for L in self.layers]
        self._diff: list[DiffDense] | None = None  # built on the first difference forward
        self.attention = Attention(attn, self.scale, self.attn_softcap, self.dtype, self.device,
                                   triton_ops=ops.name == "triton")
        self._rows_kv: tuple = ((), [])  # ((B, T), per layer (k, v) [B, T, Hk, hd]): see rows_kv

    # ----------------------------------------------------------------------------------------- pieces

    def _norm_weight(self, module):
        """Gemma: the float32 factor (1 + w), as transformers computes it; others: w itself (model dtype)."""
        if module is None:
            return None
        w = module.weight.detach()
        return (1.0 + w.float()) if self.gemma else w

    def residual_norm(self, x: torch.Tensor, y: torch.Tensor | None, post_w, w) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y', rms_norm(x + y', w)), y' = rms_norm(y, post_w) or y; y None: (x, rms_norm(x, w)). One op."""
        return self.ops.residual_norm(x, y, post_w, w, self.eps, self.gemma)

    def rows_kv(self, B: int, T: int) -> list:
        """Per layer, the K/V buffers [B, T, Hk, hd] of a batch's rows, allocated once per shape and written in
        place by the rotary op every step (the prefix K/V stays in its PrefixKV, read by attention without a
        copy: one buffer holding both would cost (B - 1) unused copies of the prefix)."""
        if self._rows_kv[0] != (B, T):
            self._rows_kv = ((), [])  # free the old shape's buffers first
            mk = lambda: torch.empty(B, T, self.Hk, self.hd, dtype=self.dtype, device=self.device)  # noqa: E731
            self._rows_kv = ((B, T), [(mk(), mk()) for _ in self.layers])
        return self._rows_kv[1]

    def cached_tensors(self) -> list:
        """The device tensors this model caches between forwards (rotary tables, the rows' K/V buffers, attention
        masks) and may later replace or drop: a captured CUDA graph reads them by address, so it keeps these
        references (sicl_fast.graphs)."""
        out = [t for r in self.rotary.values() for t in (r.cos, r.sin)]
        out += [t for kv in self._rows_kv[1] for t in kv]
        out += [t for got in self.attention._masks.values() for t in got if isinstance(t, torch.Tensor)]
        return out

    def diff_projections(self) -> list[DiffDense]:
        """Per layer, the difference-product projections, with the stacked weights in the difference dtype (made
        once: half the float32 weights' memory in bf16)."""
        if self._diff is None:
            self._diff = [DiffDense(L, self.act, self.act_name, LowWeights.of(L, self.diff_weights), self.ops)
                          for L in self.layers]
        return self._diff

    def block(self, L: Layer, proj: Dense, x: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor, pos0: int,
              prefix=None, cache: StaticCache | None = None, i: int = 0, kv_out=None, keep_kv: bool = False):
        """One decoder layer on x [B, T, d] at positions pos0 .. pos0+T-1, whose input norm h = rms_norm(x,
        L.attn_norm) the previous op made, with the layer's products `proj`. Returns (x, rms_norm(x, next_norm),
        (k, v) if keep_kv else None): the next layer's input norm (or the final norm) is fused with this layer's
        last residual add. kv_out: buffers [B, T, Hk, hd] the rotary op writes k / v into (else fresh tensors).
        Temporaries are dropped as soon as they are used (`del`): the peak memory is that of one sub-block (v is a
        view of the fused q / k / v product, so keeping it would keep that whole product through the MLP)."""
        B, T, _ = x.shape
        q, k, v = proj.qkv(h)
        del h
        q = q.view(B, T, self.H, self.hd)
        k = k.view(B, T, self.Hk, self.hd)
        v = v.view(B, T, self.Hk, self.hd)
        decoding = cache is not None and pos0 < 0  # one token at the position cache.pos holds on the device
        cos, sin = self.rotary[L.rope].at(cache.pos) if decoding else self.rotary[L.rope].tables(pos0, T)
        if cache is not None and not decoding:  # prefill: k / v go straight into the cache
            kv_out = (cache.k[i][:, pos0:pos0 + T], cache.v[i][:, pos0:pos0 + T])
        q, k, v = self.ops.qk_rope(q, k, v, cos, sin, L.q_norm, L.k_norm, self.eps, self.gemma,
                                   *(kv_out or (None, None)))
        if decoding:
            cache.k[i].index_copy_(1, cache.pos, k)
            cache.v[i].index_copy_(1, cache.pos, v)
            o = self.attention.decode(q, cache.k[i], cache.v[i], cache.keys, cache.pos, L.window)
        elif cache is not None:  # attend to everything written so far
            o = self.attention(q, cache.k[i][:, :pos0 + T], cache.v[i][:, :pos0 + T], pos0, L.window,
                               cache_len=pos0 + T)
        else:
            o = self.attention(q, k, v, pos0, L.window, prefix)
        kv = (k, v) if keep_kv else None
        del q, k, v
        o = proj.out(o.reshape(B, T, self.H * self.hd))
        x, h = self.residual_norm(x, o, L.post_attn_norm, L.mlp_norm)
        del o
        m = proj.mlp(h)
        del h
        x, h = self.residual_norm(x, m, L.post_mlp_norm, next_norm)
        return x, h, kv

    # ----------------------------------------------------------------------------------------- forwards

    def forward(self, x: torch.Tensor, pos0: int = 0, prefix: PrefixKV | None = None,
                cache: StaticCache | None = None, collect: bool = False, near_row0: bool = False,
                checkpoint: bool = False):
        """x [B, T, d] (model dtype) at positions pos0 .. -> final-normed hidden [B, T, d]; with collect, also
        the per-layer (k, v). prefix: K/V of rows [0, pos0) shared by all rows; cache: generation KV cache
        (pos0 = -1: one token at the position cache.pos holds, see decode_logits). near_row0: rows 1.. are small perturbations of row 0, so difference products may be used (when
        enabled; see the module docstring).
        Differentiable in x (the exact-gradient ascent, sicl_fast.grad): autograd records only when x requires
        grad (the weights are detached), so the callers that never differentiate run it under no_grad or with
        inputs that need none. checkpoint: with autograd recording, recompute each layer in the backward instead
        of keeping its activations (torch.utils.checkpoint): one layer's activations at a time."""
        if prefix is not None and prefix.length != pos0:
            raise SiclError(f"prefix K/V covers {prefix.length} rows, the rows start at {pos0}")
        if self.embed_mult is not None:
            x = x * self.embed_mult
        use_diff = near_row0 and self.diff_dtype is not None and x.shape[0] > 1 and cache is None
        projs = self.diff_projections() if use_diff else self.dense
        # the rows' K/V go to the preallocated buffers where the rotary op writes them as it goes, unless they
        # are kept (collect) or autograd records
        bufs = (self.rows_kv(*x.shape[:2]) if self.ops.kv_in_place and cache is None and not collect
                and not torch.is_grad_enabled() else None)
        kvs = []
        n = len(self.layers)
        remat = checkpoint and torch.is_grad_enabled()
        _, h = self.residual_norm(x, None, None, self.layers[0].attn_norm)
        for i, L in enumerate(self.layers):
            next_norm = self.layers[i + 1].attn_norm if i + 1 < n else self.final_norm
            pkv = None if prefix is None else prefix.kv[i]
            kv_out = None if bufs is None else bufs[i]
            if remat:
                x, h, kv = torch.utils.checkpoint.checkpoint(self.block, L, projs[i], x, h, next_norm, pos0, pkv,
                                                             cache, i, kv_out, collect, use_reentrant=False)
            else:
                x, h, kv = self.block(L, projs[i], x, h, next_norm, pos0, pkv, cache, i, kv_out, collect)
            if collect:
                kvs.append(kv)
        if cache is not None and pos0 >= 0:
            cache.length = pos0 + x.shape[1]
        return (h, kvs) if collect else h

    @torch.no_grad()  # a cache of constants: never differentiated
    def prefix_kv(self, rows: torch.Tensor) -> PrefixKV:
        """Run the prefix rows [a, d] (model dtype) once, batch 1, keeping every layer's K/V."""
        h, kvs = self.forward(rows.unsqueeze(0), 0, collect=True)
        return PrefixKV(rows=rows.clone(), kv=kvs, hidden=h)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> logits [..., V] in the model dtype, soft-capped as transformers' LM head does."""
        z = F.linear(h, self.head)
        if self.final_softcap is not None:
            z = self.ops.softcap_(z, self.final_softcap)
        return z

    def new_cache(self, max_len: int) -> StaticCache:
        for r in self.rotary.values():
            r.reserve(max_len)  # decoding reads the tables at device positions: no growth then
        return StaticCache(len(self.layers), max_len, self.Hk, self.hd, self.dtype, self.device)

    @torch.no_grad()
    def decode_logits(self, token: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """Feed one token (int64 [1] device tensor) at position cache.pos, advance it; -> next-token logits [V].
        Same shapes at every position and no host read: capturable in a CUDA graph."""
        x = self.embed(token.view(1, 1))  # [1, 1, d], as the model embeds input_ids
        h = self.forward(x, -1, cache=cache)
        cache.pos += 1
        return self.logits(h[:, -1])[0]


__all__ = ["SUPPORTED_FAMILIES", "DIFF_MATMUL", "Transformer", "PrefixKV", "StaticCache", "UnsupportedModelError",
           "fast_low_precision", "rope_inv_freq", "unsupported"]
