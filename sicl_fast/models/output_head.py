"""How a causal LM makes its logits from its decoder's last hidden states, read once from the model and checked
against the model's own forward: what the `hf` backend computes at the span positions (never [B, L, V]).

    head = check_output(lm)     an OutputHead, or a SiclError naming why the model cannot be calibrated as loaded
    why = eager_reason(config)  why a family's math needs transformers' eager attention (None: it does not)

A family does more to its logits than the LM head's product: a bias in the output module (Phi-2, GPT-J, CodeGen,
CTRL), a multiplier (Cohere's logit_scale, Granite's 1 / logits_scaling, Falcon-H1's lm_head_multiplier), a final
soft-cap (Gemma 2 / 3, RecurrentGemma), a vocabulary cut to its unpadded size (Inkling). HEAD_FIELDS reads each from
the config, the bias from the output module: z = softcap(scale * (h W^T + b)) over the first `vocab` rows. The
probe (check_output) runs the model's own forward on a few tokens and compares: where the table reproduces the
model's logits, the hf backend takes the head's weight a vocabulary chunk at a time (mode 'table'); where it does
not (a head with a transform of its own, as BERT's, or a family's rule the table does not know), the span rows'
logits come from the model's own forward at those rows alone (mode 'own': `logits_to_keep`, else its full rows
then the span rows). The same probe refuses a model that is not causal as loaded (the proxy's log p(x_t | x_<t)
needs one) and one whose forward does not take its input embeddings as its tokens' (calibrating them would not
calibrate the model).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..errors import SiclError

# config field -> what it does to the logits after the head's product, and the families that set it (transformers
# 5.17's forwards; tests/test_conformance.py and scripts/model_table.py check every causal LM against them)
HEAD_FIELDS = (
    ("logit_scale", "times", "Cohere, Cohere 2"),
    ("logits_scaling", "divided by", "Granite, Granite MoE"),
    ("lm_head_multiplier", "times", "Falcon-H1"),
    ("logits_mup_width_multiplier", "divided by", "Inkling"),
    ("final_logit_softcapping", "soft-capped at", "Gemma 2 / 3, Nanochat"),
    ("logits_soft_cap", "soft-capped at", "RecurrentGemma"),
    ("output_logit_soft_cap", "soft-capped at", "xLSTM"),
    ("unpadded_vocab_size", "cut to the first", "Inkling"),
)
# the families whose forwards read a field of HEAD_FIELDS otherwise, or not at all (None)
FAMILY_FIELDS = {"hyperclovax": {"logits_scaling": "times"}, "mpt": {"logit_scale": None}}
PROBE_TOKENS, PROBE_CUT = 8, 3  # the probe's length, and how many of its last tokens the causality check cuts off
# the probe's tolerance, relative to the largest logit (at least 1): the same math through two code paths differs
# by rounding only; a missing multiplier, bias or soft-cap of any size that matters is far above it
PROBE_TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def eager_reason(config) -> str | None:
    """Why this model's math needs transformers' eager attention (None: any attention computes it): transformers'
    SDPA and flash paths drop an attention soft-cap (Gemma 2's attn_logit_softcapping; 3.6e-3 relative in f(X0)
    with caps 2 / 5, issue #47)."""
    for cfg in _configs(config):
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap is not None:
            return (f"it soft-caps its attention scores (attn_logit_softcapping {cap}), which only transformers' "
                    "eager attention computes")
    return None


def use_eager_where_needed(model) -> None:
    """Switch a transformers model to eager attention where its math needs it (eager_reason); load() and
    from_transformers() call it, and the run plan refuses the hf and naive backends on a model left otherwise."""
    if eager_reason(model.config) is not None and attention_of(model) != "eager":
        model.set_attn_implementation("eager")


def attention_of(model) -> str | None:
    """The transformers attention implementation a model runs ('eager', 'sdpa', ...)."""
    return getattr(model.config, "_attn_implementation", None)


@dataclass(frozen=True)
class OutputHead:
    """How the hf backend makes the logits at the span rows (module docstring). mode 'table': the output module's
    weight (and bias) a vocabulary chunk at a time, z = softcap(scale * (h W^T + b)) over its first `vocab` rows;
    'own': the model's own forward at the span rows (keep: through logits_to_keep, else its full rows then those).
    why: what the probe found, for the run plan."""

    mode: str
    scale: float | None = None
    bias: bool = False
    softcap: float | None = None
    vocab: int | None = None  # the logits' vocabulary when smaller than the head's rows
    keep: bool = False
    why: str = ""

    def weight_and_bias(self, lm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's weight [V, d] and bias [V] (times the scale, which the hidden states take; None: no bias), cut
        to the logits' vocabulary."""
        out = lm.model.get_output_embeddings()
        w, b = out.weight, getattr(out, "bias", None) if self.bias else None
        if self.vocab is not None:
            w, b = w[:self.vocab], None if b is None else b[:self.vocab]
        if b is not None and self.scale is not None:
            b = b * self.scale
        return w, b

    def logits(self, lm, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, n, d] -> [B, n, V] float32 logits by the table (the probe's comparison; the backends never make
        them for more than a few rows)."""
        w, b = self.weight_and_bias(lm)
        z = torch.matmul(hidden if self.scale is None else hidden * self.scale, w.t()).float()
        if b is not None:
            z = z + b.float()
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


@dataclass(frozen=True)
class HeadTerms:
    """What a model's configs do to its logits after the head's product, by HEAD_FIELDS (head_terms): the one reading
    of them, for the hf backend's table (head_table) and the fast decoder alike (DecoderConfig: its final norm takes
    the scale, its span head the soft-cap)."""

    scale: float | None  # the logits times it (None: 1)
    softcap: float | None
    vocab: int | None  # unpadded_vocab_size where a config sets it (the head's rows may be as many)
    parts: tuple  # each term in words: "divided by 8 (logits_scaling)", ...


def head_terms(config) -> HeadTerms:
    """The HeadTerms of a transformers config (and its text config: _configs), FAMILY_FIELDS applied."""
    rules = {name: how for name, how, _ in HEAD_FIELDS}
    for cfg in _configs(config):
        rules.update(FAMILY_FIELDS.get(getattr(cfg, "model_type", None), {}))
    found: dict[str, float] = {}
    for cfg in _configs(config):
        for name in rules:
            value = getattr(cfg, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in found:
                found[name] = float(value)
    found = {name: value for name, value in found.items() if rules[name] is not None}
    scale = None
    for name, value in found.items():
        if rules[name] in ("times", "divided by"):
            scale = (scale or 1.0) * (value if rules[name] == "times" else 1.0 / value)
    softcap = next((value for name, value in found.items() if rules[name] == "soft-capped at"), None)
    vocab = int(found["unpadded_vocab_size"]) if "unpadded_vocab_size" in found else None
    parts = tuple(f"{rules[n]} {v:g} ({n})" for n, v in found.items() if n != "unpadded_vocab_size")
    return HeadTerms(scale, softcap, vocab, parts)


def head_table(lm) -> OutputHead:
    """The table's head of a loaded model (head_terms of its config, the output module's bias), unchecked."""
    terms = head_terms(lm.model.config)
    out = lm.model.get_output_embeddings()
    if out is None or not isinstance(getattr(out, "weight", None), torch.Tensor):
        return OutputHead("own", why="no output module with a weight (get_output_embeddings)")
    bias = isinstance(getattr(out, "bias", None), torch.Tensor)
    V = out.weight.shape[0]
    vocab = terms.vocab if terms.vocab is not None and terms.vocab < V else None
    parts = list(terms.parts)
    if vocab is not None:
        parts.append(f"cut to the first {vocab} rows (unpadded_vocab_size)")
    if bias:
        parts.insert(0, "the output module's bias")
    what = "the LM head's weight" + (": " + ", ".join(parts) if parts else " alone")
    return OutputHead("table", scale=terms.scale, bias=bias, softcap=terms.softcap, vocab=vocab, why=what)


OWN_ELEMS = 1 << 26  # mode 'own': the most logits one call makes (256 MB in float32); the batch goes in parts


def own_rows(per_row: int, V: int) -> int:
    """Mode 'own': the batch rows one call of the model's forward takes, so that its logits [rows, per_row, V] hold
    at most OWN_ELEMS (one row at least); per_row: the span rows (keep), else the forward's rows."""
    return max(1, OWN_ELEMS // max(1, per_row * V))


def own_logits(lm, x: torch.Tensor, rows: torch.Tensor, keep: bool) -> torch.Tensor:
    """The model's own logits at `rows` [P] of inputs_embeds x [B, n, d] -> [B, P, V] float32 (float64 from a float64
    model): through logits_to_keep when `keep`, else its full rows then those."""
    if keep:
        z = lm.model(inputs_embeds=x, use_cache=False, logits_to_keep=rows).logits
    else:
        z = lm.model(inputs_embeds=x, use_cache=False).logits.index_select(1, rows)
    return z if z.dtype == torch.float64 else z.float()


def probe_ids(lm, n: int = PROBE_TOKENS) -> torch.Tensor:
    """n token ids [n] for the probe: spread over the vocabulary, none of the ids the configs name (an image
    token would ask for an image)."""
    special = set()
    for cfg in _configs(lm.model.config):
        for key, value in vars(cfg).items():
            if key.endswith(("token_id", "token_ids", "token_index", "_id")):
                special.update(v for v in (value if isinstance(value, (list, tuple)) else [value])
                               if isinstance(v, int))
    V = lm.model.get_input_embeddings().weight.shape[0]
    order = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:n + len(special)].tolist()
    return torch.tensor([i for i in order if i not in special][:n])


@torch.no_grad()
def check_output(lm) -> OutputHead:
    """Probe the model's own forward on PROBE_TOKENS tokens (module docstring): its causality, its input embeddings
    and its head. Returns the OutputHead the hf backend runs; raises a SiclError naming what is wrong for a model
    that is not causal as loaded, or whose forward does not take input embeddings as its tokens'. Three forwards
    where the table holds (the tokens, the first tokens alone, the decoder on their embeddings beside a row off
    every token's, as the ascent's); the model's own forward on the embeddings only to find out why it does not."""
    model, name = lm.model, f"model {lm.name!r} ({lm.family})"
    ids = probe_ids(lm).to(lm.device).unsqueeze(0)  # [1, n]
    kept = PROBE_TOKENS - PROBE_CUT
    tol = PROBE_TOL.get(lm.dtype, 1e-2)
    try:
        own = model(input_ids=ids, use_cache=False).logits.float()  # [1, n, V]
        own_cut = model(input_ids=ids[:, :kept], use_cache=False).logits.float()  # the hf backend's truncation
    except Exception as exc:  # transformers raises many types; the model cannot run as the backends run it
        raise SiclError(f"{name}: its own forward does not run on {PROBE_TOKENS} tokens alone "
                        f"({type(exc).__name__}: {_line(exc)}); sicl_fast calibrates causal LMs run on their tokens"
                        ) from None
    d = _difference(own_cut, own[:, :kept])
    if d > tol:
        raise SiclError(f"{name} is not causal as loaded: its logits at a position change with the tokens after "
                        f"it (by {d:.1e} of the largest, {PROBE_CUT} of {PROBE_TOKENS} tokens cut off), and the "
                        "proxy's log p(x_t | x_<t) needs a causal LM (a BERT-style model needs is_decoder=True)")
    x = model.get_input_embeddings()(ids)
    moved = torch.cat([x, x * (1 + 1e-3)])  # the ascent's rows are no token's embedding
    head = head_table(lm)
    if head.mode == "table":
        try:  # the hf backend's path: the decoder on input embeddings, then the table's head
            hidden = lm.decoder(inputs_embeds=moved, use_cache=False).last_hidden_state[:1]
            d = _difference(head.logits(lm, hidden), own)
            problem = None if d <= tol else f"differs from its logits by {d:.1e} of the largest"
        except Exception as exc:  # a decoder that does not return what the head takes, or needs the tokens
            problem = f"its decoder does not give the hidden states its head takes ({type(exc).__name__})"
        if problem is None:
            return OutputHead(head.mode, head.scale, head.bias, head.softcap, head.vocab,
                              why=f"{head.why}, checked against the model's own logits")
        why = f"{head.why} {problem}"
    else:
        why = head.why
    what = "input embeddings"
    try:
        own_x = model(inputs_embeds=x.clone(), use_cache=False).logits.float()
        what = "input embeddings that are no token's"
        model(inputs_embeds=moved[1:], use_cache=False)
    except Exception as exc:
        raise SiclError(f"{name}: its forward does not take {what} ({type(exc).__name__}: {_line(exc)}), and the "
                        "ascent runs it on input embeddings off every token's") from None
    d = _difference(own_x, own)
    if d > tol:
        raise SiclError(f"{name}: its forward computes other logits from its input embeddings than from its "
                        f"tokens (by {d:.1e} of the largest), so calibrating the embeddings would not calibrate it")
    rows = torch.arange(PROBE_TOKENS - 1, -1, -2, device=lm.device)  # some rows, out of order
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    if keep:
        try:
            keep = _difference(own_logits(lm, x.clone(), rows, True), own_x[:, rows]) <= tol
        except Exception:  # a forward that takes only an int
            keep = False
    how = "logits_to_keep" if keep else "its full rows, then the span rows"
    return OutputHead("own", keep=keep, why=f"the model's own forward at the span rows ({how}): {why}")


def _line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut to `limit` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the largest |b| (at least 1)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _configs(config) -> list:
    """The text config first, then the model's config (a multimodal model keeps its head's fields in one of them)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [text] if text is config else [text, config]


__all__ = ["FAMILY_FIELDS", "HEAD_FIELDS", "HeadTerms", "OutputHead", "attention_of", "check_output", "eager_reason",
           "head_table", "head_terms", "own_logits", "probe_ids", "use_eager_where_needed"]
