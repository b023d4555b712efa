"""Our own decoder forward for the fast backend: Llama (3.1 rope scaling, SmolLM2), Qwen3, Gemma 2, Gemma 3 text.

Weights are the loaded transformers model's own tensors (no copies); numerics follow transformers 5.17's modeling
files step by step (same dtype casts, same norm forms, rope tables computed in float32 and cast to the model dtype).
What the code needs to know of the model (sizes, family quirks) is one DecoderConfig, read once from the
transformers config (sicl_fast.models.decoder_config).

    x [B, T, d] (what the input-embedding module returns; rows at `Positions`: start .. start+T-1, or, decoding,
    the one position a device tensor holds)
      -> norm -> per layer (`block`): q, k, v products -> rotary (q / k norms) writing K / V where the layer's K/V
                            object says -> attention through that object -> o product -> residual + norm -> gated
                            MLP -> residual + next layer's norm
      -> hidden [B, T, d] (the last layer's residual add is fused with the final norm)

A layer's K/V object (gpt-fast's KVCache.update, per layer) makes batch forwards, prefill and decoding one path:
RowsKV holds a batch's own rows' K/V buffers and the shared prefix's K/V (PrefixKV, read by attention for every
batch row without a copy); CacheKV is one layer of a StaticCache (prefill writes rows in place; decoding writes the
device-held position and attends over the whole buffer with a mask).

The elementwise work goes through the model's DecoderOps (sicl_fast.ops): the torch reference
(sicl_fast.models.elementwise) or the fused Triton kernels, so a layer is 12 launches with impl 'triton' (3 + 1 +
3 products, rotary, attention, two residual norms, the gated activation; tests/test_fused_decoder.py holds the
budget). The products of each layer are a swappable object (sicl_fast.models.projections): plain, or the
difference products of a perturbation batch (`forward(near_row0=True)` on a float32 model with difference products
on: row 0 in float32, the other rows' differences in bf16; norms, rotary, attention and the activations stay
float32 on every row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..errors import SiclError
from .attention import Attention
from .decoder_config import SUPPORTED_FAMILIES, DecoderConfig, UnsupportedModelError, rope_inv_freq, unsupported
from .projections import Dense, DiffDense, LowWeights

DIFF_MATMUL = ("auto", "off", "bf16", "fp8")


# --------------------------------------------------------------------------------------------------- rotary


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


@dataclass(frozen=True)
class Positions:
    """Where a forward's T rows sit: either `start` .. start+T-1 (host ints: the rotary tables are slices, the
    attention masks cached per shape), or, decoding (T = 1), the position the int64 device tensor `at` holds ([1];
    [B], one per row, for query-only answers: sicl_fast.answer_kv): no host position, so any position replays one
    captured graph. rope: rotary key -> (cos, sin) of these positions ([T, 1, hd]), looked up once per forward for
    every layer."""

    T: int
    rope: dict
    start: int | None = None  # host rows (None: decoding at `at`)
    at: torch.Tensor | None = None  # decoding (None: host rows from `start`)

    @classmethod
    def rows(cls, rotary: dict, start: int, T: int) -> Positions:
        return cls(T, {k: r.tables(start, T) for k, r in rotary.items()}, start=start)

    @classmethod
    def decoding(cls, rotary: dict, at: torch.Tensor) -> Positions:
        return cls(1, {k: r.at(at) for k, r in rotary.items()}, at=at)


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
    next_norm: torch.Tensor | None = None  # the next layer's input norm (the final norm after the last layer),
    #                                        fused with this layer's last residual add


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


class RowsKV:
    """One layer's K/V in a batch forward: the rows' own keys, written by the rotary op into `bufs` ([B, T, Hk, hd]
    each, or fresh tensors when None), and the shared prefix's (k, v) [1, a, Hk, hd] that every row also attends
    to (None: no prefix). keep: hold the rows' (k, v) in `kept` (the prefix K/V is built this way)."""

    __slots__ = ("prefix", "bufs", "keep", "kept")

    def __init__(self, prefix=None, bufs=None, keep: bool = False) -> None:
        self.prefix, self.bufs, self.keep, self.kept = prefix, bufs, keep, None

    def targets(self, pos: Positions) -> tuple:
        return self.bufs or (None, None)

    def attend(self, attention: Attention, q, k, v, pos: Positions, window):
        if self.keep:
            self.kept = (k, v)
        return attention(q, k, v, pos.start, window, self.prefix)


class CacheKV:
    """One layer of a StaticCache: k, v [1, max_len, Hk, hd]. Prefill (host positions) writes rows start.. in
    place and attends to everything written so far; decoding writes the device-held position and attends over the
    whole buffer with a mask.

    Two branches, not gpt-fast's one KVCache.update (write at a position tensor, attend over the whole buffer with
    a mask), on purpose: run through the decoding branch, a prefill would attend over all max_len keys with the
    math path and an explicit [T, max_len] mask instead of the plan's kernel (sdpa / cpp / triton / flash) over the
    `end` rows written, which changes its bits (another kernel, another reduction length: hidden states moved by up
    to 2e-6 with sdpa and cpp on the tiny test models) and costs max_len / end times the keys, and it would copy
    each layer's K/V into the buffer (index_copy_) where the rotary op now writes them in place. Decoding cannot
    take the prefill's branch: its position is on the device (no host read, one captured graph for every
    position), so it cannot slice the buffer."""

    __slots__ = ("k", "v", "keys")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor) -> None:
        self.k, self.v, self.keys = k, v, keys

    def targets(self, pos: Positions) -> tuple:
        if pos.at is not None:
            return None, None
        return self.k[:, pos.start:pos.start + pos.T], self.v[:, pos.start:pos.start + pos.T]

    def attend(self, attention: Attention, q, k, v, pos: Positions, window):
        if pos.at is not None:
            self.k.index_copy_(1, pos.at, k)
            self.v.index_copy_(1, pos.at, v)
            return attention.decode(q, self.k, self.v, self.keys, pos.at, window)
        end = pos.start + pos.T
        return attention(q, self.k[:, :end], self.v[:, :end], pos.start, window, cache_len=end)


class StaticCache:
    """K/V buffers [1, max_len, Hk, hd] per layer for greedy decoding (`layers`: one CacheKV each); `length` rows
    are filled. Decoding (Transformer.decode_logits) writes the next position, held on the device in `pos`
    (int64 [1]), in place and attends over the whole fixed buffer with a mask: every token has the same shapes,
    whatever its position."""

    def __init__(self, n_layers: int, max_len: int, Hk: int, hd: int, dtype, device) -> None:
        self.k = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(1, max_len, Hk, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.keys = torch.arange(max_len, device=device)  # key positions, for the mask
        self.layers = [CacheKV(k, v, self.keys) for k, v in zip(self.k, self.v)]


def _param(module, name):
    p = getattr(module, name, None) if module is not None else None
    return None if p is None else p.detach()


class Transformer:
    """The decoder of a loaded transformers model, run by our own code. lm: a LoadedModel; config: its
    DecoderConfig; ops: the DecoderOps of the run plan's implementation; attention: the plan's attention kernel
    (sicl_fast.models.attention: 'math', 'sdpa', 'flash', 'triton', 'cpp'); diff_matmul: the plan's difference
    products ('off', 'bf16', 'fp8')."""

    def __init__(self, lm, config: DecoderConfig, ops, attention: str = "sdpa", diff_matmul: str = "off") -> None:
        dec = lm.decoder
        if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
            raise unsupported(f"{config.family} ({type(lm.model).__name__} without a plain decoder)")
        self.config = c = config
        self.family, self.gemma = c.family, c.gemma
        self.dtype = lm.dtype
        self.device = lm.device
        self.d, self.H, self.Hk, self.hd, self.eps = c.d, c.H, c.Hk, c.hd, c.eps
        self.final_softcap = c.final_softcap
        self.embed = lm.model.get_input_embeddings()
        self.embed_mult = (None if c.input_mult is None
                           else torch.tensor(c.input_mult, dtype=self.dtype, device=self.device))
        self.head = lm.head_weight.detach()
        # rotary tables: one per rope parameter set (Gemma 3: local for sliding layers, global for full ones)
        self.rotary = {key: Rotary(*rope_inv_freq(c.rope_params(key), self.hd), self.dtype, self.device)
                       for key, _ in c.rope}
        self.layers: list[Layer] = []
        for i, layer in enumerate(dec.layers[:c.n_layers]):
            at, mlp = layer.self_attn, layer.mlp
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
                window=c.windows[i], rope=c.rope_of_layer[i],
            ))
        self.final_norm = self._norm_weight(dec.norm)
        for L, nxt in zip(self.layers, self.layers[1:]):
            L.next_norm = nxt.attn_norm
        self.layers[-1].next_norm = self.final_norm
        # 'fp8': the differences in FP8 e4m3, the product's output in bf16 (sicl_fast.models.diff)
        self.diff_dtype = torch.bfloat16 if diff_matmul in ("bf16", "fp8") else None
        self.diff_weights = "fp8" if diff_matmul == "fp8" else "bf16"
        self.ops = ops  # the elementwise work and the epilogues of the difference products
        self.dense = [Dense(L, c.act_name, ops) for L in self.layers]
        self._diff: list[DiffDense] | None = None  # built on the first difference forward
        self.attention = Attention(attention, c.attn_scale, c.attn_softcap, self.dtype, self.device)
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
            self._diff = [DiffDense(L, self.config.act_name, LowWeights.of(L, self.diff_weights), self.ops)
                          for L in self.layers]
        return self._diff

    def block(self, x: torch.Tensor, h: torch.Tensor, layer: Dense, pos: Positions, kv) -> tuple:
        """One decoder layer (`layer`: its products, plain or difference, over its weights layer.L) on x [B, T, d]
        at `pos`, whose input norm h = rms_norm(x, L.attn_norm) the previous op made, with its K/V object `kv`
        (RowsKV or CacheKV). Returns (x, rms_norm(x, L.next_norm)): the next layer's input norm (or the final
        norm) is fused with this layer's last residual add. Temporaries are dropped as soon as they are used
        (`del`): the peak memory is that of one sub-block (v is a view of the fused q / k / v product, so keeping it
        would keep that whole product through the MLP)."""
        L = layer.L
        B, T, _ = x.shape
        q, k, v = layer.qkv(h)
        del h
        q = q.view(B, T, self.H, self.hd)
        k = k.view(B, T, self.Hk, self.hd)
        v = v.view(B, T, self.Hk, self.hd)
        cos, sin = pos.rope[L.rope]
        q, k, v = self.ops.qk_rope(q, k, v, cos, sin, L.q_norm, L.k_norm, self.eps, self.gemma, *kv.targets(pos))
        o = kv.attend(self.attention, q, k, v, pos, L.window)
        del q, k, v
        o = layer.out(o.reshape(B, T, self.H * self.hd))
        x, h = self.residual_norm(x, o, L.post_attn_norm, L.mlp_norm)
        del o
        m = layer.mlp(h)
        del h
        return self.residual_norm(x, m, L.post_mlp_norm, L.next_norm)

    # ----------------------------------------------------------------------------------------- forwards

    def run(self, x: torch.Tensor, pos: Positions, kvs, layers, checkpoint: bool = False) -> torch.Tensor:
        """Every layer on x [B, T, d] (model dtype) at `pos`, with per-layer K/V objects `kvs` and products
        `layers` -> final-normed hidden [B, T, d]. checkpoint: with autograd recording, recompute each layer in the
        backward instead of keeping its activations (torch.utils.checkpoint): one layer's activations at a time."""
        if self.embed_mult is not None:
            x = x * self.embed_mult
        _, h = self.residual_norm(x, None, None, self.layers[0].attn_norm)
        remat = checkpoint and torch.is_grad_enabled()
        for layer, kv in zip(layers, kvs):
            if remat:
                x, h = torch.utils.checkpoint.checkpoint(self.block, x, h, layer, pos, kv, use_reentrant=False)
            else:
                x, h = self.block(x, h, layer, pos, kv)
        return h

    def forward(self, x: torch.Tensor, pos0: int = 0, prefix: PrefixKV | None = None,
                cache: StaticCache | None = None, collect: bool = False, near_row0: bool = False,
                checkpoint: bool = False):
        """x [B, T, d] (model dtype) at positions pos0 .. -> final-normed hidden [B, T, d]; with collect, also
        the per-layer (k, v). prefix: K/V of rows [0, pos0) shared by all rows; cache: a StaticCache that the rows
        are prefilled into (decoding: decode_logits). near_row0: rows 1.. are small perturbations of row 0, so
        difference products may be used (when on; see the module docstring).
        Differentiable in x (the exact-gradient ascent, sicl_fast.grad): autograd records only when x requires
        grad (the weights are detached), so the callers that never differentiate run it under no_grad or with
        inputs that need none. checkpoint: see `run`."""
        if prefix is not None and prefix.length != pos0:
            raise SiclError(f"prefix K/V covers {prefix.length} rows, the rows start at {pos0}")
        B, T = x.shape[:2]
        if cache is not None:
            kvs = cache.layers
        else:
            # the rows' K/V go to the preallocated buffers where the rotary op writes them as it goes, unless they
            # are kept (collect) or autograd records
            bufs = (self.rows_kv(B, T) if self.ops.kv_in_place and not collect and not torch.is_grad_enabled()
                    else [None] * len(self.layers))
            kvs = [RowsKV(None if prefix is None else prefix.kv[i], bufs[i], collect) for i in range(len(bufs))]
        use_diff = near_row0 and self.diff_dtype is not None and B > 1 and cache is None
        h = self.run(x, Positions.rows(self.rotary, pos0, T), kvs, self.diff_projections() if use_diff else self.dense,
                     checkpoint)
        if cache is not None:
            cache.length = pos0 + T
        return (h, [kv.kept for kv in kvs]) if collect else h

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
        h = self.run(x, Positions.decoding(self.rotary, cache.pos), cache.layers, self.dense)
        cache.pos += 1
        return self.logits(h[:, -1])[0]


__all__ = ["SUPPORTED_FAMILIES", "DIFF_MATMUL", "Transformer", "DecoderConfig", "Positions", "RowsKV", "CacheKV",
           "PrefixKV", "StaticCache", "UnsupportedModelError", "fast_low_precision", "rope_inv_freq", "unsupported"]
