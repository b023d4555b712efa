"""What the fast decoder needs to know of a model, read once from its transformers config (as gpt-fast's
ModelArgs): the sizes and every family quirk as a field, and every refusal of a model the fast decoder cannot run.

    cfg = DecoderConfig.from_hf(lm.text_config, lm.model.get_input_embeddings())
                                                    raises UnsupportedModelError naming what is not supported

Frozen and hashable all through (tuples, no dicts): a RunPlan holding it can be hashed, and nothing changes it.

Families: Llama 3.x / SmolLM2 (llama3 rope scaling, attention biases), Qwen3 (per-head q / k norms), Gemma 2
(norms as (1 + w), post-attention / post-MLP norms, scaled queries, attention and final soft-caps, sliding-window
layers), Gemma 3 text (as Gemma 2 without the attention soft-cap, q / k norms, its own rope per layer type).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SiclError
from .elementwise import ACTIVATIONS

SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")


class UnsupportedModelError(SiclError):
    """The fast backend has no forward for this model family."""


def unsupported(family: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the fast backend supports the model families {', '.join(SUPPORTED_FAMILIES)} (Llama 3.x / SmolLM2, "
        f"Qwen3, Gemma 2, Gemma 3 text); this model is {family!r}: use the 'hf' backend for it"
    )


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


@dataclass(frozen=True)
class DecoderConfig:
    """One model's decoder, as the fast forward runs it (module docstring). Per-layer fields are tuples of
    n_layers entries."""

    family: str
    n_layers: int
    d: int
    H: int  # query heads
    Hk: int  # key / value heads
    hd: int  # head width
    eps: float  # RMSNorm epsilon
    act_name: str  # the gated MLP's activation (sicl_fast.models.elementwise.ACTIVATIONS)
    gemma: bool  # norms as x * (1 + w) in float32, and a norm after the attention and after the MLP
    attn_scale: float  # query_pre_attn_scalar ** -0.5 (Gemma) or hd ** -0.5
    attn_softcap: float | None  # Gemma 2 only: transformers passes it there (Gemma 3's config has the field, unused)
    final_softcap: float | None  # the LM head's logit soft-cap
    input_mult: float | None  # the forward multiplies inputs_embeds by it: sqrt(d) for Gemma 2 when the embedding
    #                           module does not scale itself (transformers 5's Gemma modules do, with their
    #                           `embed_scale`; older Gemma 2 code scaled in the forward); None: no multiplication
    windows: tuple  # per layer: the sliding window (keys > query - window), or None (full attention)
    rope_of_layer: tuple  # per layer: the key of its rotary table in `rope`
    rope: tuple  # ((rotary key, its transformers rope parameters as sorted (name, value) pairs), ...) sorted by key:
    #              one key 'all', or one per layer type as Gemma 3's; rope_params(key) gives one back as a dict

    def rope_params(self, key: str) -> dict:
        """The transformers rope parameters of rotary key `key` (a fresh dict: the config stays as it is)."""
        return dict(dict(self.rope)[key])

    @classmethod
    def from_hf(cls, config, embedding) -> DecoderConfig:
        """From a transformers text config (LoadedModel.text_config) and the model's input-embedding module (whether
        it scales its output itself); UnsupportedModelError for anything the fast decoder does not run: another
        family, bidirectional attention, another activation or rope type, partial rotary embeddings, a
        sliding-window layer without a window."""
        family = config.model_type
        if family not in SUPPORTED_FAMILIES:
            raise unsupported(family)
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention (embedding models) is not supported by the fast "
                                        "backend")
        act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act_name not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {act_name!r} is not supported by the fast backend")
        gemma = family in _GEMMA
        d, H = int(config.hidden_size), int(config.num_attention_heads)
        hd = int(getattr(config, "head_dim", None) or d // H)
        n = int(config.num_hidden_layers)
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)[:n]
        rp = config.rope_parameters
        per_type = isinstance(rp, dict) and "rope_theta" not in rp and all(isinstance(v, dict) for v in rp.values())
        rope_of_layer = tuple(t if per_type else "all" for t in layer_types)
        rope = tuple((key, _frozen(rp[key] if per_type else rp)) for key in sorted(set(rope_of_layer)))
        for _, params in rope:
            rope_inv_freq(dict(params), hd)  # refuses what it cannot compute
        window = getattr(config, "sliding_window", None)
        for i, t in enumerate(layer_types):
            if t == "sliding_attention" and window is None:
                raise UnsupportedModelError(f"layer {i} is a sliding-window layer but the config has no window")
        return cls(
            family=family, n_layers=n, d=d, H=H, Hk=int(getattr(config, "num_key_value_heads", None) or H), hd=hd,
            eps=float(config.rms_norm_eps), act_name=act_name, gemma=gemma,
            attn_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else hd ** -0.5,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if family == "gemma2" else None,
            final_softcap=getattr(config, "final_logit_softcapping", None),
            input_mult=d ** 0.5 if family == "gemma2" and not hasattr(embedding, "embed_scale") else None,
            windows=tuple(int(window) if t == "sliding_attention" else None for t in layer_types),
            rope_of_layer=rope_of_layer, rope=rope)


def _frozen(value):
    """A transformers config value made immutable and hashable: dicts as sorted (name, value) pairs, lists as
    tuples, all the way down."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


__all__ = ["DecoderConfig", "SUPPORTED_FAMILIES", "UnsupportedModelError", "rope_inv_freq", "unsupported"]
