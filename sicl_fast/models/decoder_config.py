"""What the fast decoder needs to know of a model, read once from its transformers config (as gpt-fast's
ModelArgs): the sizes and every family quirk as a field, and every refusal of a model the fast decoder cannot run.

    cfg = DecoderConfig.from_hf(lm.text_config, lm.model.get_input_embeddings())
                                                    raises UnsupportedModelError naming what is not supported

Frozen and hashable all through (tuples, no dicts): a RunPlan holding it can be hashed, and nothing changes it.

Families: Llama 3.x / SmolLM2 (llama3 rope scaling, attention biases), Qwen3 (per-head q / k norms), Gemma 2
(norms as (1 + w), post-attention / post-MLP norms, scaled queries, attention and final soft-caps, sliding-window
layers), Gemma 3 text (as Gemma 2 without the attention soft-cap, q / k norms, its own rope per layer type), Qwen2 /
2.5 (q / k / v biases, windows per layer type), Mistral (a window on every layer) and Ministral (per layer type),
Phi-3 / 3.5 / Phi-4-mini (q | k | v and gate | up fused in the checkpoint: already the stacked layout; partial rotary;
longrope), Granite (embedding, residual, attention and logits multipliers), OLMo 2 (norms after attention and MLP
only, q / k norms over the whole projection), SmolLM3 (layers without rope). Every family takes the rope types
default, linear, llama3, yarn, dynamic and longrope, their frequencies and attention factor from transformers' own
rope functions (rope_inv_freq). The features are general fields, not family branches: a family is its fields.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SiclError
from .elementwise import ACTIVATIONS
from .output_head import head_terms

SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text", "qwen2", "mistral", "ministral", "phi3", "granite",
                      "olmo2", "smollm3")
_NAMES = ("Llama 3.x / SmolLM2, Qwen3, Gemma 2, Gemma 3 text, Qwen2 / 2.5, Mistral, Ministral, Phi-3 / 3.5 / "
          "Phi-4-mini, Granite, OLMo 2, SmolLM3")
_GEMMA = ("gemma2", "gemma3_text")
_POST_NORMS = ("olmo2",)  # a norm after attention and after the MLP only, none before
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
NO_ROPE = "none"  # the rotary key of a layer without rope (SmolLM3's): the identity table, cos 1 and sin 0
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(SiclError):
    """The fast backend has no forward for this model family."""


def unsupported(family: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the fast backend supports the model families {', '.join(SUPPORTED_FAMILIES)} ({_NAMES}); this model is "
        f"{family!r}: use the 'hf' backend for it"
    )


class _RopeConfig:
    """What transformers' rope functions (modeling_rope_utils.ROPE_INIT_FUNCTIONS) read of a model config, for one
    rotary key's parameters: they are called as the model's own rotary module calls them, on these values."""

    def __init__(self, params: dict, head_dim: int, max_positions: int | None) -> None:
        self.rope_parameters, self.head_dim, self.max_position_embeddings = params, head_dim, max_positions
        self.hidden_size, self.num_attention_heads = head_dim, 1  # read only where head_dim is missing

    def standardize_rope_params(self) -> None:
        """As transformers' own for one parameter set: the pretraining length of the scaled types defaults to
        max_position_embeddings (a loaded config has it already; one set by hand after construction may not)."""
        if self.rope_parameters.get("rope_type") in ("llama3", "yarn", "longrope"):
            self.rope_parameters.setdefault("original_max_position_embeddings", self.max_position_embeddings)


def rope_inv_freq(params: dict, head_dim: int, max_positions: int | None = None,
                  seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot/2] float32, attention scaling) for a transformers `rope_parameters` dict: rot = head_dim, or
    int(head_dim * partial_rotary_factor) (the rotated part of a head). 'default' computed here as transformers'
    models do; the other ROPE_TYPES by transformers' own function (the attention factor of yarn and longrope
    included). seq_len: the sequence length, for the types whose frequencies depend on it past rope_threshold
    (dynamic, longrope), as transformers' rotary module passes it (None: the frequencies at construction, those of
    any sequence up to the threshold). max_positions: the config's max_position_embeddings."""
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported by the fast backend "
                                    f"({', '.join(ROPE_TYPES)}); use the 'hf' backend")
    try:
        if kind == "default":
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            arange = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float)
            return 1.0 / (params["rope_theta"] ** (arange / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[kind](_RopeConfig(dict(params), head_dim, max_positions), None,
                                                 seq_len=None if seq_len is None else torch.tensor(seq_len))
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise UnsupportedModelError(f"rope_type {kind!r}: the fast backend cannot compute its frequencies from "
                                    f"this config ({type(exc).__name__}: {exc}); use the 'hf' backend") from None
    return inv.float(), float(scaling)


def rope_threshold(params: dict, max_positions: int | None) -> int | None:
    """The sequence length past which a rope type's frequencies depend on the length (transformers'
    dynamic_rope_update): max_position_embeddings for 'dynamic', original_max_position_embeddings for 'longrope';
    None for the others."""
    kind = params.get("rope_type", "default")
    if kind == "dynamic":
        return max_positions
    if kind == "longrope":
        return int(params.get("original_max_position_embeddings") or max_positions)
    return None


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
    gemma: bool  # Gemma: norm weights as 1 + w in float32; the MLP's input norm is pre_feedforward_layernorm
    norms: str  # where the layer's norms sit: 'pre' (before attention and MLP: Llama), 'sandwich' (before and after:
    #             Gemma), 'post' (after attention and after the MLP only: OLMo 2)
    norm_f32: bool  # the norms multiply by their weight in float32, then cast (Gemma, OLMo 2); else cast, then
    #                 multiply (Llama); the same in float32
    attn_scale: float  # query_pre_attn_scalar ** -0.5 (Gemma), attention_multiplier (Granite) or hd ** -0.5
    attn_softcap: float | None  # Gemma 2 only: transformers passes it there (Gemma 3's config has the field, unused)
    final_softcap: float | None  # the LM head's logit soft-cap (models.output_head.head_terms)
    input_mult: float | None  # the forward multiplies inputs_embeds by it: sqrt(d) for Gemma 2 when the embedding
    #                           module does not scale itself (transformers 5's Gemma modules do, with their
    #                           `embed_scale`; older Gemma 2 code scaled in the forward), Granite's
    #                           embedding_multiplier; None: no multiplication. X (what the ascent perturbs) stays the
    #                           input-embedding module's output either way
    residual_mult: float | None  # Granite: the attention's and the MLP's outputs times it before the residual add
    logit_scale: float | None  # the LM head's logits times it (Granite: 1 / logits_scaling): what the hf backend's
    #                            head takes (models.output_head.head_terms, the one reading of the head's fields)
    windows: tuple  # per layer: the sliding window (keys > query - window), or None (full attention)
    rope_of_layer: tuple  # per layer: the key of its rotary table in `rope`, or NO_ROPE (a layer without rope)
    rope: tuple  # ((rotary key, its transformers rope parameters as sorted (name, value) pairs), ...) sorted by key:
    #              one key 'all', or one per layer type as Gemma 3's; rope_params(key) gives one back as a dict
    max_positions: int | None = None  # max_position_embeddings: what rope types dynamic, yarn and longrope read

    def rope_params(self, key: str) -> dict:
        """The transformers rope parameters of rotary key `key` (a fresh dict: the config stays as it is)."""
        return dict(dict(self.rope)[key])

    @classmethod
    def from_hf(cls, config, embedding) -> DecoderConfig:
        """From a transformers text config (LoadedModel.text_config) and the model's input-embedding module (whether
        it scales its output itself); UnsupportedModelError for anything the fast decoder does not run: another
        family, bidirectional attention, another activation, rope type or layer type, a rotary width it cannot
        take, a sliding-window layer without a window."""
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
        window = getattr(config, "sliding_window", None)
        # no layer types: a window on every layer where the config has one (Mistral, Phi-3), as their masks apply it
        layer_types = list(getattr(config, "layer_types", None)
                           or ["sliding_attention" if window is not None else "full_attention"] * n)[:n]
        for i, t in enumerate(layer_types):
            if t not in LAYER_TYPES:
                raise UnsupportedModelError(f"layer {i} is a {t!r} layer: the fast backend runs "
                                            f"{' and '.join(LAYER_TYPES)} layers; use the 'hf' backend")
            if t == "sliding_attention" and window is None:
                raise UnsupportedModelError(f"layer {i} is a sliding-window layer but the config has no window")
        rp = config.rope_parameters
        per_type = isinstance(rp, dict) and "rope_theta" not in rp and all(isinstance(v, dict) for v in rp.values())
        nope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 where a layer has rope, 0 where not
        rope_of_layer = tuple(NO_ROPE if nope is not None and not nope[i] else t if per_type else "all"
                              for i, t in enumerate(layer_types))
        rope = tuple((key, _frozen(rp[key] if per_type else rp)) for key in sorted(set(rope_of_layer) - {NO_ROPE}))
        max_positions = getattr(config, "max_position_embeddings", None)
        for key, params in rope:
            inv, _ = rope_inv_freq(dict(params), hd, max_positions)  # refuses what it cannot compute
            if not 0 < 2 * inv.numel() <= hd:
                raise UnsupportedModelError(f"rope {key!r} rotates {2 * inv.numel()} of a head's {hd} dims: the "
                                            "fast backend rotates an even part of at most the whole head")
        mult = getattr(config, "attention_multiplier", None)  # Granite's query scale
        head = head_terms(config)  # a cut vocabulary or a head bias: refused by the run plan (fast_head_refusal)
        return cls(
            family=family, n_layers=n, d=d, H=H, Hk=int(getattr(config, "num_key_value_heads", None) or H), hd=hd,
            eps=float(config.rms_norm_eps), act_name=act_name, gemma=gemma,
            norms="sandwich" if gemma else "post" if family in _POST_NORMS else "pre",
            norm_f32=gemma or family in _POST_NORMS,
            attn_scale=(float(config.query_pre_attn_scalar) ** -0.5 if gemma else float(mult) if mult is not None
                        else hd ** -0.5),
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if family == "gemma2" else None,
            final_softcap=head.softcap,
            input_mult=(d ** 0.5 if family == "gemma2" and not hasattr(embedding, "embed_scale")
                        else _multiplier(config, "embedding_multiplier")),
            residual_mult=_multiplier(config, "residual_multiplier"),
            logit_scale=head.scale,
            windows=tuple(int(window) if t == "sliding_attention" else None for t in layer_types),
            rope_of_layer=rope_of_layer, rope=rope, max_positions=max_positions)


def _multiplier(config, name: str) -> float | None:
    """A config's multiplier `name` (Granite's), None where it is absent or 1 (nothing to multiply)."""
    m = getattr(config, name, None)
    return None if m is None or float(m) == 1.0 else float(m)


def _frozen(value):
    """A transformers config value made immutable and hashable: dicts as sorted (name, value) pairs, lists as
    tuples, all the way down."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


__all__ = ["DecoderConfig", "SUPPORTED_FAMILIES", "ROPE_TYPES", "NO_ROPE", "UnsupportedModelError", "rope_inv_freq",
           "rope_threshold", "unsupported"]
