"""Our own decoder forward for the fast backend: every family of sicl_fast.models.decoder_config (Llama / SmolLM2,
Qwen3, Gemma 2, Gemma 3 text, Qwen2 / 2.5, Mistral, Ministral, Phi-3, Granite, OLMo 2, SmolLM3).

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

The family quirks are the config's fields, each applied in one place: the input multiplier (Gemma 2's normalizer,
Granite's embedding multiplier) on x as the pass starts, X itself staying the input-embedding module's output; the
norms' places (`DecoderConfig.norms`: a missing norm is None, and a residual op without one hands on its sum as it
is); Granite's residual multiplier in the residual ops (y_scale); its attention multiplier as the attention's scale;
the logits' multiplier (`logit_scale`, Granite's 1 / logits_scaling, read as the hf backend's head reads it:
models.output_head.head_terms) folded into the final norm's weight (w s: the LM head's input, so every head, plain,
difference form and decoding, scales the logits by s; exact up to one rounding of w s, none for a power of two); partial
rotary as tables narrower than a head; a layer without rope as the identity table (cos 1, sin 0: x exactly).

A layer's K/V object (gpt-fast's KVCache.update, per layer) makes batch forwards, prefill and decoding one path:
RowsKV holds a batch's own rows' K/V buffers and the shared prefix's K/V (PrefixKV, read by attention for every
batch row without a copy); CacheKV is one layer of a StaticCache (prefill writes rows in place; decoding writes the
device-held position and attends over the whole buffer with a mask).

Two forwards share the layers' weights (stacked per product and held once, sicl_fast.models.weights):

    forward(x [B, T, d])          plain: activations and products in the model dtype (decoding, prefill, single
                                  rows, the exact gradient); a layer is 3 products, rotary, attention, two residual
                                  norms and the gated activation
    forward_rows(x [R, d], rows)  a perturbation batch (sicl_fast.models.rows): float32 activations, every product
                                  one low-precision product of the rows in difference form, so the perturbations
                                  (about one bf16 ulp of an embedding) survive at the bf16 rate; the prefix rows may
                                  run in the same pass (`rows.lead`) or come as kept K/V. A layer is 9 launches with
                                  the fused ops: 4 products, rope_rows, attention, gated_rows, two norm_rows

The elementwise work goes through the model's DecoderOps (sicl_fast.ops): the torch references
(sicl_fast.models.elementwise, sicl_fast.models.rows) or the fused C++ / Triton kernels (tests/test_ops.py,
tests/test_fused_decoder.py and tests/test_cpp_launch_budget.py hold the parity and the launch budgets).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..errors import SiclError
from .attention import Attention
from .decoder_config import (NO_ROPE, SUPPORTED_FAMILIES, DecoderConfig, UnsupportedModelError, rope_inv_freq,
                             rope_threshold, unsupported)
from .projections import Dense, RowsDense
from .reductions import full_reductions
from .reference import reference_head, reference_pass
from .rows import LOW_DTYPE, RowLayout, RowsReference
from .weights import LayerWeights, LowWeight, LowWeights

DIFF_MATMUL = ("auto", "off", "bf16", "fp8")


# --------------------------------------------------------------------------------------------------- rotary


class Rotary:
    """cos / sin tables [n, rot] in the model dtype (cos, sin) and in float32 (cos32, sin32: the difference form's
    rows), grown on demand (float32 math, as transformers): rot = hd, or fewer with partial rotary (each head's first
    rot elements rotate). params: one rotary key's transformers rope parameters (sicl_fast.models.decoder_config),
    None for a layer without rope (the identity: cos 1, sin 0, so the rotation gives x exactly).

    Rope types whose frequencies depend on the sequence length past a threshold (dynamic: max_position_embeddings;
    longrope: original_max_position_embeddings) hold the tables of one prompt length (`fit`, Transformer.fit_rope):
    row p takes the frequencies of the length max(L, p + 1) for a prompt of L tokens, which are transformers' for
    one forward over the prompt (its dynamic_rope_update takes the forward's length) and, past the prompt, for each
    token greedy decoding adds (the length grows a token a step)."""

    def __init__(self, params: dict | None, hd: int, max_positions: int | None, dtype: torch.dtype, device) -> None:
        self.params, self.hd, self.max_positions = params, hd, max_positions
        if params is None:
            inv, self.scaling, self.threshold = torch.zeros(hd // 2), 1.0, None
        else:
            inv, self.scaling = rope_inv_freq(params, hd, max_positions)
            self.threshold = rope_threshold(params, max_positions)
        self.inv_freq = inv.to(device)
        self.length: int | None = None  # the prompt length of the tables, past the threshold (None: at most it)
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, 2 * inv.numel(), dtype=dtype, device=device)
        self.cos32 = self.sin32 = self.cos.float()

    def key(self, length: int) -> int | None:
        """What the tables of a prompt of `length` tokens depend on: the length past the threshold, else None."""
        return length if self.threshold is not None and length > self.threshold else None

    def fit(self, key: int | None) -> None:
        """Take the tables of the prompt length `key` (Rotary.key), in place (a captured graph reads them)."""
        if key != self.length:
            self.length = key
            n = self.cos.shape[0]
            if n:
                cos32, sin32 = self._tables(n)
                for mine, new in ((self.cos32, cos32), (self.sin32, sin32), (self.cos, cos32), (self.sin, sin32)):
                    mine.copy_(new)

    def _inv_at(self, length: int | None) -> torch.Tensor:
        """The frequencies of a sequence of `length` tokens (None: at most the threshold: the tables' base)."""
        if length is None:
            return self.inv_freq
        return rope_inv_freq(self.params, self.hd, self.max_positions, seq_len=length)[0].to(self.inv_freq.device)

    def _tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float)
        inv = self._inv_at(self.length)[None, :].expand(n, -1)
        if self.threshold is not None and n > max(self.length or 0, self.threshold):
            start = max(self.length or 0, self.threshold)  # rows past the prompt and the threshold: their own length
            if self.params.get("rope_type") == "longrope":  # one set (the long factors) for every length past it
                beyond = self._inv_at(start + 1)[None, :].expand(n - start, -1)
            else:
                beyond = torch.stack([self._inv_at(p + 1) for p in range(start, n)])
            inv = torch.cat([inv[:start], beyond])
        freqs = pos[:, None] * inv  # [n, rot/2]; a K=1 product, as transformers' matmul
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, rot]
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def reserve(self, n: int) -> None:
        """Make the tables cover positions 0 .. n-1 (grown to a power of two, at least 64)."""
        if n > self.cos.shape[0]:
            n = 1 << max(6, (n - 1).bit_length())
            self.cos32, self.sin32 = self._tables(n)
            self.cos, self.sin = self.cos32.to(self.dtype), self.sin32.to(self.dtype)

    def tables(self, pos0: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot] for positions pos0 .. pos0+T-1 (broadcast over heads)."""
        self.reserve(pos0 + T)
        return self.cos[pos0:pos0 + T, None], self.sin[pos0:pos0 + T, None]

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, rot] for the position held in the int64 [1] device tensor pos (reserve first)."""
        return self.cos.index_select(0, pos)[:, None], self.sin.index_select(0, pos)[:, None]


@dataclass(frozen=True)
class Positions:
    """Where a forward's T rows sit: either `start` .. start+T-1 (host ints: the rotary tables are slices, the
    attention masks cached per shape), or, decoding (T = 1), the position the int64 device tensor `at` holds ([1];
    [B], one per row, for query-only answers: sicl_fast.answering.answer_kv): no host position, so any position replays
    one captured graph. rope: rotary key -> (cos, sin) of these positions ([T, 1, hd]), looked up once per forward for
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
    """One decoder layer's tensors (the transformers model's own parameters; the projections stacked, held once)
    and switches."""

    w: LayerWeights  # q | k | v, o, gate | up, down (sicl_fast.models.weights)
    attn_norm: torch.Tensor | None  # before attention (None: none, OLMo 2)
    mlp_norm: torch.Tensor | None  # before the MLP (None: none, OLMo 2)
    post_attn_norm: torch.Tensor | None  # Gemma, OLMo 2: on the attention output
    post_mlp_norm: torch.Tensor | None  # Gemma, OLMo 2: on the MLP output
    q_norm: torch.Tensor | None  # RMSNorm of q and k: per head ([hd]: Qwen3, Gemma 3) or over the whole projection
    k_norm: torch.Tensor | None  # ([H hd] / [Hk hd]: OLMo 2)
    window: int | None  # sliding window (keys > query - window), None: full attention
    rope: str  # key into Transformer.rotary (NO_ROPE: the identity)
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
    """K/V of the prefix rows [0, a) (batch 1), and their final hidden states, for the embeddings `rows`. From the
    plain forward: the model dtype; from the difference form's (Transformer.prefix_rows): float32 K/V and the hidden
    states as values in the low dtype."""

    rows: torch.Tensor  # [a, d]: the cache key
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


class Transformer:
    """The decoder of a loaded transformers model, run by our own code. lm: a LoadedModel; config: its
    DecoderConfig; ops: the DecoderOps of the run plan's implementation; attention: the plan's attention kernel
    (sicl_fast.models.attention: 'math', 'sdpa', 'flash', 'triton', 'cpp'); diff_matmul: the plan's difference
    products ('off': perturbation batches take the plain forward; 'bf16' / 'fp8': forward_rows, the differences in
    bf16 or FP8 e4m3); attention_kernels: the fused kernels of attention 'cpp' or 'triton', handed in as ops is
    (sicl_fast.ops.attention_kernels); attention_precision: the plan's float32 attention products ('ieee', 'tf32x3':
    sicl_fast.models.attention)."""

    def __init__(self, lm, config: DecoderConfig, ops, attention: str = "sdpa", diff_matmul: str = "off",
                 attention_kernels=None, attention_precision: str = "ieee") -> None:
        dec = lm.decoder
        if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
            raise unsupported(f"{config.family} ({type(lm.model).__name__} without a plain decoder)")
        self.config = c = config
        # the ops' norm formula: 'gemma' multiplies by the weight in float32, then casts (Gemma's 1 + w, OLMo 2's w)
        self.family, self.gemma = c.family, c.norm_f32
        self.dtype = lm.dtype
        self.device = lm.device
        self.d, self.H, self.Hk, self.hd, self.eps = c.d, c.H, c.Hk, c.hd, c.eps
        self.final_softcap = c.final_softcap
        self.embed = lm.model.get_input_embeddings()
        # x times it as a pass starts, a Python number read here once (so that no step, refresh or capture reads it
        # back from the device): Gemma 2's normalizer rounded to the model dtype (transformers' is a tensor of that
        # dtype), Granite's embedding multiplier as it is (a Python float in transformers)
        self.embed_scale = (None if c.input_mult is None else
                            float(torch.tensor(c.input_mult, dtype=self.dtype)) if c.gemma else c.input_mult)
        self.head = lm.head_weight.detach()
        # rotary tables: one per rope parameter set (Gemma 3: local for sliding layers, global for full ones), the
        # identity for layers without rope
        self.rotary = {key: Rotary(c.rope_params(key), self.hd, c.max_positions, self.dtype, self.device)
                       for key, _ in c.rope}
        if NO_ROPE in c.rope_of_layer:
            self.rotary[NO_ROPE] = Rotary(None, self.hd, c.max_positions, self.dtype, self.device)
        pre, post = c.norms != "post", c.norms != "pre"
        self.layers: list[Layer] = []
        for i, layer in enumerate(dec.layers[:c.n_layers]):
            at = layer.self_attn
            self.layers.append(Layer(
                w=LayerWeights.of(at, layer.mlp, c.H * c.hd),
                attn_norm=self._norm_weight(layer.input_layernorm) if pre else None,
                mlp_norm=(self._norm_weight(layer.pre_feedforward_layernorm if post else layer.post_attention_layernorm)
                          if pre else None),
                post_attn_norm=self._norm_weight(layer.post_attention_layernorm) if post else None,
                post_mlp_norm=self._norm_weight(layer.post_feedforward_layernorm) if post else None,
                q_norm=self._norm_weight(getattr(at, "q_norm", None)),
                k_norm=self._norm_weight(getattr(at, "k_norm", None)),
                window=c.windows[i], rope=c.rope_of_layer[i],
            ))
        self.final_norm = self._norm_weight(dec.norm)
        if c.logit_scale is not None:  # the logits times s: the head's input (module docstring)
            self.final_norm = self.final_norm * c.logit_scale
        self.residual_mult = c.residual_mult
        for L, nxt in zip(self.layers, self.layers[1:]):
            L.next_norm = nxt.attn_norm
        self.layers[-1].next_norm = self.final_norm
        self.diff_matmul = diff_matmul
        self.ops = ops  # the elementwise work and the row epilogues
        self.dense = [Dense(L.w, c.act_name, ops) for L in self.layers]
        self._rows_dense: list[RowsDense] | None = None  # the difference form's products, made on first use
        self._head_low: LowWeight | None = None
        self.attention = Attention(attention, c.attn_scale, c.attn_softcap, self.dtype, self.device, attention_kernels,
                                   attention_precision)
        self._rows_kv: tuple = ((), [])  # ((B, T), per layer (k, v) [B, T, Hk, hd]): see rows_kv
        self._pass_kv: tuple = (None, [])  # (R, per layer (k, v) [R, Hk, hd] float32): see pass_kv
        self._zeros = torch.zeros(0, dtype=LOW_DTYPE, device=self.device)  # see zero_form

    @property
    def rows_on(self) -> bool:
        """Do perturbation batches take the difference form's forward (forward_rows)?"""
        return self.diff_matmul != "off"

    def fit_rope(self, *lengths: int) -> None:
        """The rotary tables for prompts of these lengths (in tokens, the query included), in place: they change
        only for rope types whose frequencies depend on the length (Rotary), and only past their threshold.
        Prompts run in one pass (a packed step) must share one table: a SiclError says when they do not."""
        for key, r in self.rotary.items():
            keys = {r.key(n) for n in lengths}
            if len(keys) > 1:
                raise SiclError(f"rope {key!r} ({r.params.get('rope_type')}) gives prompts of {sorted(set(lengths))} "
                                f"tokens different rotary tables (its frequencies depend on the length past "
                                f"{r.threshold} tokens): run them one at a time (--pack 1)")
            r.fit(keys.pop())

    @property
    def rope_lengths(self) -> tuple:
        """The prompt lengths the rotary tables are fitted to (Rotary.length), key by key: what K/V kept across
        calls were computed under."""
        return tuple(r.length for r in self.rotary.values())

    def restore_rope(self, lengths: tuple) -> None:
        """Fit the rotary tables back to `lengths` (an earlier rope_lengths), in place: the server's scheduler gives
        each piece of work the tables it ran with, whatever ran in between."""
        for r, key in zip(self.rotary.values(), lengths):
            r.fit(key)

    # ----------------------------------------------------------------------------------------- pieces

    def _norm_weight(self, module):
        """Gemma: the float32 factor (1 + w), as transformers computes it; OLMo 2: w in float32 (its norms multiply
        in float32); others: w itself (model dtype)."""
        if module is None:
            return None
        w = module.weight.detach()
        return (1.0 + w.float()) if self.config.gemma else w.float() if self.config.norm_f32 else w

    def residual_norm(self, x: torch.Tensor, y: torch.Tensor | None, post_w, w) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y', rms_norm(x + y', w)), y' = rms_norm(y, post_w) or y, times the residual multiplier; y None: (x,
        rms_norm(x, w)); w None: the sum itself for both. One op."""
        return self.ops.residual_norm(x, y, post_w, w, self.eps, self.gemma, y_scale=self.residual_mult)

    def rows_kv(self, B: int, T: int) -> list:
        """Per layer, the K/V buffers [B, T, Hk, hd] of a batch's rows, allocated once per shape and written in
        place by the rotary op every step (the prefix K/V stays in its PrefixKV, read by attention without a
        copy: one buffer holding both would cost (B - 1) unused copies of the prefix)."""
        if self._rows_kv[0] != (B, T):
            self._rows_kv = ((), [])  # free the old shape's buffers first
            mk = lambda: torch.empty(B, T, self.Hk, self.hd, dtype=self.dtype, device=self.device)  # noqa: E731
            self._rows_kv = ((B, T), [(mk(), mk()) for _ in self.layers])
        return self._rows_kv[1]

    def zero_form(self, R: int, n: int) -> torch.Tensor:
        """A [R, n] tensor of bf16 zeros, contiguous: a difference form with no change, through which the reference
        pass hands a product's float32 output to rope_rows as its value rows' reference (sicl_fast.models.reference).
        One buffer, grown on demand and kept (cached_tensors)."""
        if self._zeros.numel() < R * n:
            self._zeros = torch.zeros(R * n, dtype=LOW_DTYPE, device=self.device)
        return self._zeros[:R * n].view(R, n)

    def cached_tensors(self) -> list:
        """The device tensors this model caches between forwards (rotary tables, the rows' K/V buffers, attention
        masks) and may later replace or drop: a captured CUDA graph reads them by address, so it keeps these
        references (sicl_fast.run.graphs)."""
        out = [t for r in self.rotary.values() for t in (r.cos, r.sin, r.cos32, r.sin32)]
        out += [t for kv in self._rows_kv[1] for t in kv]
        out += [t for kv in self._pass_kv[1] for t in kv]
        out.append(self._zeros)
        out += [t for got in self.attention._masks.values() for t in got if isinstance(t, torch.Tensor)]
        return out

    def rows_dense(self) -> list[RowsDense]:
        """Per layer, the difference form's products over the stacked weights in the low dtype (made once: the
        model's own tensors for a bf16 model, one bf16 copy for a float32 model)."""
        if self._rows_dense is None:
            fp8 = self.diff_matmul == "fp8"
            self._rows_dense = [RowsDense(LowWeights.of(L.w, fp8), self.ops) for L in self.layers]
        return self._rows_dense

    @property
    def head_low(self) -> LowWeight:
        """The LM head [V, d] in the low dtype, for the span head of the difference form (made once)."""
        if self._head_low is None:
            self._head_low = LowWeight(self.head, pack=False)  # the span heads read its rows a chunk at a time
        return self._head_low

    def pass_kv(self, R: int) -> list:
        """Per layer, the float32 K/V buffers [R, Hk, hd] of a difference-form pass of R rows, allocated once per R
        and written in place by rope_rows every step."""
        if self._pass_kv[0] != R:
            self._pass_kv = (None, [])
            mk = lambda: torch.empty(R, self.Hk, self.hd, dtype=torch.float32, device=self.device)  # noqa: E731
            self._pass_kv = (R, [(mk(), mk()) for _ in self.layers])
        return self._pass_kv[1]

    def block(self, x: torch.Tensor, h: torch.Tensor, L: Layer, P: Dense, pos: Positions, kv) -> tuple:
        """One decoder layer `L` (its plain products P) on x [B, T, d] at `pos`, whose input norm
        h = rms_norm(x, L.attn_norm) the previous op made, with its K/V object `kv` (RowsKV, CacheKV or
        answer_kv's QueryKV). Returns (x, rms_norm(x, L.next_norm)): the next layer's input norm (or the final norm)
        is fused with this layer's last residual add. Temporaries are dropped as soon as they are used (`del`): the
        peak memory is that of one sub-block (q, k, v are views of the stacked q / k / v product, so keeping one
        would keep that whole product through the MLP)."""
        B, T, _ = x.shape
        q, k, v = P.qkv(h)
        del h
        q = q.view(B, T, self.H, self.hd)
        k = k.view(B, T, self.Hk, self.hd)
        v = v.view(B, T, self.Hk, self.hd)
        cos, sin = pos.rope[L.rope]
        q, k, v = self.ops.qk_rope(q, k, v, cos, sin, L.q_norm, L.k_norm, self.eps, self.gemma, *kv.targets(pos))
        o = kv.attend(self.attention, q, k, v, pos, L.window)
        del q, k, v
        o = P.out(o.reshape(B, T, self.H * self.hd))
        x, h = self.residual_norm(x, o, L.post_attn_norm, L.mlp_norm)
        del o
        m = P.mlp(h)
        del h
        return self.residual_norm(x, m, L.post_mlp_norm, L.next_norm)

    def block_rows(self, x: torch.Tensor, h: torch.Tensor, L: Layer, P: RowsDense, rows: RowLayout, kv: tuple,
                   prefix, ref: dict | None = None, next_ref=None) -> tuple:
        """One decoder layer on the rows of a difference-form pass (sicl_fast.models.rows): x [R, d] float32, h its
        input norm in difference form [R, d] (low dtype); kv: this layer's float32 K/V buffers [R, Hk, hd], which
        rope_rows fills; prefix: the kept prefix's (k, v) [1, a, Hk, hd] when the prefix rows do not run in this
        pass, else None; ref: this layer's value-row references (RowsReference.layers[i]: each product's (input,
        output)), next_ref: the next product's input reference (the next layer's qkv input, or the final hidden
        states'); None: none. Returns (x, next norm of x in difference form). Nine launches with the fused ops."""
        rot, w, ops = self.rotary[L.rope], L.w, self.ops
        r = ref or {"qkv": (None, None), "o": (None, None), "gate_up": (None, None), "down": (None, None)}
        q = ops.rope_rows(P.qkv(h, rows), w.qkv_bias, rows, rot.cos32, rot.sin32, L.q_norm, L.k_norm, self.eps,
                          self.gemma, self.H, self.Hk, kv[0], kv[1], r["qkv"][1])
        del h
        o = self.attention.rows(q, kv[0], kv[1], rows, L.window, prefix, r["o"][0])
        del q
        x, h = ops.norm_rows(x, P.out(o, rows), w.o_bias, L.post_attn_norm, L.mlp_norm, self.eps, self.gemma, rows,
                             r["o"][1], r["gate_up"][0], y_scale=self.residual_mult)
        del o
        a = ops.gated_rows(P.gate_up(h, rows), w.gate_up_bias, self.config.act_name, rows, r["gate_up"][1],
                           r["down"][0])
        del h
        return ops.norm_rows(x, P.down(a, rows), w.down_bias, L.post_mlp_norm, L.next_norm, self.eps, self.gemma,
                             rows, r["down"][1], next_ref, y_scale=self.residual_mult)

    # ----------------------------------------------------------------------------------------- forwards

    def run(self, x: torch.Tensor, pos: Positions, kvs, products=None, checkpoint: bool = False) -> torch.Tensor:
        """Every layer on x [B, T, d] (model dtype) at `pos`, with per-layer K/V objects `kvs` and plain products
        (default: the model's) -> final-normed hidden [B, T, d]. checkpoint: with autograd recording, recompute each
        layer in the backward instead of keeping its activations (torch.utils.checkpoint): one layer's activations
        at a time."""
        if self.embed_scale is not None:
            x = x * self.embed_scale
        _, h = self.residual_norm(x, None, None, self.layers[0].attn_norm)
        remat = checkpoint and torch.is_grad_enabled()
        for L, P, kv in zip(self.layers, products or self.dense, kvs):
            if remat:
                x, h = torch.utils.checkpoint.checkpoint(self.block, x, h, L, P, pos, kv, use_reentrant=False)
            else:
                x, h = self.block(x, h, L, P, pos, kv)
        return h

    def forward(self, x: torch.Tensor, pos0: int = 0, prefix: PrefixKV | None = None,
                cache: StaticCache | None = None, collect: bool = False, checkpoint: bool = False):
        """x [B, T, d] (model dtype) at positions pos0 .. -> final-normed hidden [B, T, d]; with collect, also
        the per-layer (k, v). prefix: K/V of rows [0, pos0) shared by all rows; cache: a StaticCache that the rows
        are prefilled into (decoding: decode_logits). Plain products (a perturbation batch's difference form is
        forward_rows).
        Differentiable in x (the exact-gradient ascent, sicl_fast.calibration.grad): autograd records only when x
        requires grad (the weights are detached), so the callers that never differentiate run it under no_grad or with
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
        h = self.run(x, Positions.rows(self.rotary, pos0, T), kvs, checkpoint=checkpoint)
        if cache is not None:
            cache.length = pos0 + T
        return (h, [kv.kept for kv in kvs]) if collect else h

    @torch.no_grad()
    @full_reductions()  # the difference products reduce in float32 (sicl_fast.models.reductions)
    def forward_rows(self, x: torch.Tensor, rows: RowLayout, prefix: PrefixKV | None = None,
                     ref: RowsReference | None = None) -> torch.Tensor:
        """The difference form's forward (module docstring): x [R, d] float32, the pass's rows (the lead rows, then
        the batch rows), at the positions `rows` gives -> the final-normed hidden states [R, d] in difference form
        (low dtype; its value rows against ref.hidden). prefix: the kept prefix K/V (prefix_rows) the batch rows
        attend to, when rows.lead is 0 and the batch starts after a prefix. ref: the value rows' float32 reference
        (reference_rows; None: the values rounded as they are)."""
        self._check_prefix(rows, prefix)
        if self.embed_scale is not None:
            x = x * self.embed_scale  # as transformers' (the embed_scale attribute above)
        refs = ref.layers if ref is not None else [None] * len(self.layers)
        nexts = [r["qkv"][0] for r in refs[1:]] + [ref.hidden] if ref is not None else refs
        x, h = self.ops.norm_rows(x, None, None, None, self.layers[0].attn_norm, self.eps, self.gemma, rows, None,
                                  refs[0]["qkv"][0] if ref is not None else None)
        kvs = self.pass_kv(rows.R)
        for i, (L, P) in enumerate(zip(self.layers, self.rows_dense())):
            x, h = self.block_rows(x, h, L, P, rows, kvs[i], None if prefix is None else prefix.kv[i], refs[i],
                                   nexts[i])
        return h

    def _check_prefix(self, rows: RowLayout, prefix: PrefixKV | None) -> None:
        if rows.lead and prefix is not None:
            raise SiclError("a difference-form pass takes its prefix either as lead rows or as kept K/V, not both")
        if prefix is not None and prefix.length != rows.pos0:
            raise SiclError(f"prefix K/V covers {prefix.length} rows, the rows start at {rows.pos0}")
        for r in self.rotary.values():
            r.reserve(max(rows.lead, rows.pos0 + rows.T))

    @torch.no_grad()
    def reference_rows(self, x: torch.Tensor, rows: RowLayout, prefix: PrefixKV | None = None, keep: bool = False,
                       out: RowsReference | None = None):
        """The float32 reference of a pass's value rows (sicl_fast.models.rows.RowsReference): x [V, d] float32, the
        value rows alone (rows: their layout, RowLayout.value_layout()), through every layer with float32 products
        of the model's own weights (a bf16 model's without a float32 copy on CUDA) and the fused ops on float32
        rows; each product's input and output kept (sicl_fast.models.reference). What forward_rows' value rows are
        taken against (made when a run starts and every few steps). out: a RowsReference to write in place (a
        refresh); keep: also return the pass's K/V, per layer (k, v) [V, Hk, hd] (a kept prefix's: prefix_rows)."""
        return reference_pass(self, x, rows, prefix, keep, out)

    def new_reference(self, V: int) -> RowsReference:
        """A RowsReference of V value rows, zeros (what reference_rows(out=) writes: a packed pass's, one slot at a
        time)."""
        z = lambda k: torch.zeros(V, k, dtype=torch.float32, device=self.device)  # noqa: E731
        qd = self.H * self.hd
        return RowsReference([{"qkv": (z(self.d), z(L.w.qkv.shape[0])), "o": (z(qd), z(self.d)),
                               "gate_up": (z(self.d), z(2 * L.w.inter)), "down": (z(L.w.inter), z(self.d))}
                              for L in self.layers], z(self.d))

    @torch.no_grad()  # a cache of constants: never differentiated
    def prefix_kv(self, rows: torch.Tensor) -> PrefixKV:
        """Run the prefix rows [a, d] (model dtype) once, batch 1, keeping every layer's K/V."""
        h, kvs = self.forward(rows.unsqueeze(0), 0, collect=True)
        return PrefixKV(rows=rows.clone(), kv=kvs, hidden=h)

    @torch.no_grad()
    def reference_logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's float32 product of reference hidden states h [..., d] float32 (the model's own head
        weight: sicl_fast.models.reference.reference_head) -> [..., V] float32, before any soft-cap, into `out`
        (contiguous) when given: the value rows' reference logits of the difference form's span head
        (sicl_fast.step.logprobs.rows_logprobs)."""
        V = self.head.shape[0]
        z = reference_head(self.ops, h.reshape(-1, h.shape[-1]).float(), self.head,
                           None if out is None else out.view(-1, V))
        return z.view(*h.shape[:-1], V) if out is None else out

    @torch.no_grad()
    def prefix_rows(self, rows: torch.Tensor) -> PrefixKV:
        """The prefix rows [a, d] float32 through the float32 reference forward once (the value rows of a lead-only
        pass, reference_rows), keeping its float32 K/V and its float32 hidden states: what the batch rows of a pass
        whose prefix is kept attend to."""
        a = rows.shape[0]
        ref, kvs = self.reference_rows(rows.float(), RowLayout.build(a, 0, 0, a, device=self.device), keep=True)
        return PrefixKV(rows=rows.clone(), kv=[(k[None], v[None]) for k, v in kvs], hidden=ref.hidden[None])

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
        h = self.run(x, Positions.decoding(self.rotary, cache.pos), cache.layers)
        cache.pos += 1
        return self.logits(h[:, -1])[0]


__all__ = ["SUPPORTED_FAMILIES", "DIFF_MATMUL", "LOW_DTYPE", "Transformer", "DecoderConfig", "Positions", "RowsKV",
           "CacheKV", "PrefixKV", "StaticCache", "UnsupportedModelError", "fast_low_precision", "rope_inv_freq",
           "Rotary", "unsupported"]
