"""Conformance of every causal-LM architecture of the installed transformers: what each backend computes on a tiny
random-weight model of it, against the model's own logits.

    rows = [check(family) for family in families()]      one Row per config class of the causal-LM auto mapping
    table = render(rows)                                 docs/usage.md's model table (scripts/model_table.py)

For each family: a tiny config (TINY's sizes wherever the config class has the field: 2 layers, width 32, 4 heads,
vocabulary 128; the head knobs KNOBS set off their defaults so that a rule the hf backend missed shows), the model
built from it with random weights (biases and norm weights moved off their initial values), then

  * the reference: the model's own full logits from its tokens with eager attention (transformers', every row,
    the query's included), log_softmax at the span targets;
  * `hf`: the backend as a user gets it (from_transformers, the attention the model was built with, eager where
    its math needs it), its span log-probs against the reference (TOL);
  * `auto`: the fast backend where the fast decoder's config builds from the whole config, its span log-probs
    against hf's (TOL); else the refusal, which names the family, as the reason.

A Row's status: 'fast' or 'hf' (what auto runs, within TOL), 'refused' (the hf backend refuses the model as built,
with its reason: not causal, ...), 'skipped' (no tiny model of it builds or runs here: the reason, e.g. a package
this machine lacks, a size TINY cannot reach), or 'wrong' (a backend differs by more than TOL: a defect).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import warnings
from dataclasses import dataclass

import torch

TOL = 1e-5  # log-prob, absolute: float32 through two code paths of the same math
V = 128  # the tiny vocabulary
MAX_PARAMS = 2_000_000  # above: 'skipped' (a size TINY cannot reach)
L, SPANS, DEMO_START = 24, ((6, 10), (14, 18)), 2  # the prompt: 24 tokens, two output spans, a prefix of 2 rows

# every size field name of transformers' configs that TINY sets, where the config class has it
TINY = dict(
    hidden_size=32, n_embd=32, d_model=32, embed_dim=32, emb_dim=32, intermediate_size=64, ffn_dim=64, n_inner=64,
    d_ff=64, decoder_ffn_dim=64, encoder_ffn_dim=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2, decoder_layers=2, encoder_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=128, n_positions=128,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16, rotary_dim=4,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
    ssm_state_size=8, state_size=8, n_groups=1, n_shared_experts=1, time_step_rank=4, chunk_size=16,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=V,
    initializer_range=0.1, is_decoder=True,
)
# the head's and attention's knobs, off their defaults where the family has one (a field whose default is None is
# left off: Gemma 3 checkpoints soft-cap nothing): a rule the hf backend misses then shows (Granite's default
# logits_scaling 1.0 hides it, issue #47)
KNOBS = dict(logits_scaling=4.0, logit_scale=0.25, lm_head_multiplier=0.5, final_logit_softcapping=3.0,
             logits_soft_cap=3.0, attn_logit_softcapping=2.0)
# the few families TINY's generic sizes do not fit (their own constraints)
OVERRIDES = {
    "mamba2": dict(head_dim=16),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "zamba": dict(layers_block_type=["mamba", "hybrid"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}


@dataclass
class Row:
    """One architecture's result (module docstring)."""

    family: str  # the config's model_type (the auto mapping's key)
    architecture: str  # its causal-LM class
    status: str  # 'fast', 'hf', 'refused', 'skipped', 'wrong'
    reason: str = ""  # why not fast (the fast decoder's refusal), the hf refusal, or why skipped
    head: str = ""  # the hf backend's head mode ('table' or 'own')
    hf_error: float | None = None  # max |hf - reference| over the span log-probs
    fast_error: float | None = None  # max |fast - hf|
    seconds: float = 0.0


class Skip(Exception):
    """No tiny model of this family builds or runs here (the message says why)."""


def families() -> dict[str, str]:
    """{model_type: causal-LM class name} of the installed transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _fields(cls) -> dict:
    """A config class's dataclass fields by name (transformers 5's configs are dataclasses)."""
    return {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}


def _kwargs(cls, family: str | None, layers: int) -> dict:
    """TINY, KNOBS and the family's OVERRIDES for the fields config class `cls` has; every token id 1."""
    fields = _fields(cls)
    kw = {k: v for k, v in TINY.items() if k in fields}
    kw.update({k: v for k, v in KNOBS.items() if k in fields and fields[k].default not in (None, dataclasses.MISSING)})
    for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers"):
        if name in kw:
            kw[name] = layers
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: head_dim is the rotary part's, a key per head
        kw.pop("head_dim", None)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    for name in fields:
        if name.endswith(("_token_id", "_token_index")) or name == "token_id":
            kw[name] = 1
    layer_types = fields.get("layer_types")
    if layer_types is not None and isinstance(layer_types.default, (list, tuple)) and layer_types.default:
        kw["layer_types"] = list(layer_types.default)[:layers]  # an explicit default list, cut to the layers
    kw.update({k: v for k, v in OVERRIDES.get(family, {}).items() if k in fields})
    return kw


def tiny_config(family: str, layers: int = 2):
    """The family's config at TINY size (its sub-configs too: a vision tower, a text config)."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    kw = _kwargs(cls, family, layers)
    for name, sub in getattr(cls, "sub_configs", {}).items():
        if isinstance(sub, type) and issubclass(sub, PretrainedConfig):
            kw[name] = sub(**_kwargs(sub, None, layers))
    return cls(**kw)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def build(family: str):
    """A tiny random-weight model of `family` in eval mode (2 layers, else 4 where 2 cannot hold the layer kinds),
    or Skip with the reason."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    errors = []
    for layers in (2, 4):
        try:
            cfg = tiny_config(family, layers)
            with torch.device("meta"):
                n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
            if n > MAX_PARAMS:
                raise Skip(f"{n / 1e6:.0f}M parameters at the smallest sizes set (the limit is "
                           f"{MAX_PARAMS / 1e6:.0f}M)")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).eval()
            _move_off_init(model)
            _ = _reference(model, _prompt(model))  # its own forward runs
            return model
        except Skip:
            raise
        except ImportError as exc:  # a package this machine lacks (a vision tower's timm, ...)
            raise Skip(f"needs a package not installed here: {_first_line(exc)}") from None
        except Exception as exc:  # transformers raises many types for a config it cannot build or run
            errors.append(_first_line(exc))
    raise Skip(f"no tiny model builds and runs its own forward: {errors[0]}")


def _move_off_init(model) -> None:
    """Biases and norm weights off their initial zeros and ones, so that a backend dropping one shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if "norm" in name and p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g).to(p.dtype))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g).to(p.dtype))


def _prompt(model):
    """The check's prompt over the model's vocabulary (token ids from 2: 0 and 1 are often special)."""
    from ..formats.requests import Request
    from ..formats.spans import Prompt

    vocab = min(model.get_input_embeddings().weight.shape[0], V)
    ids = torch.randint(2, vocab, (L,), generator=torch.Generator().manual_seed(0))
    return Prompt(request=Request(id="conformance", prompt="x" * L, output_spans=((0, 1),)), input_ids=ids,
                  token_spans=SPANS, demo_start=DEMO_START, demo_end=SPANS[-1][1])


@contextlib.contextmanager
def attention_as(model, impl: str = "eager"):
    """The model with transformers' attention `impl` for the block (its own restored after)."""
    before = getattr(model.config, "_attn_implementation", None)
    if before != impl:
        model.set_attn_implementation(impl)
    try:
        yield model
    finally:
        if before != impl:
            model.set_attn_implementation(before)


@torch.no_grad()
def _reference(model, prompt, X: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own log-probs of the span targets [P] from its full logits over the whole prompt with eager
    attention: from its tokens, or from input embeddings X [L, d] (a perturbed row has no tokens)."""
    ones = torch.ones(1, L, dtype=torch.long)
    inputs = dict(input_ids=prompt.input_ids.unsqueeze(0)) if X is None else dict(inputs_embeds=X.unsqueeze(0).clone())
    with attention_as(model, "eager"):
        logits = model(**inputs, attention_mask=ones, use_cache=False).logits.float()
    return torch.log_softmax(logits[0], dim=-1)[prompt.positions - 1, prompt.targets]


def _batch(X: torch.Tensor, prompt) -> torch.Tensor:
    """[X, X perturbed on the demonstration rows]: [2, L, d]."""
    g = torch.Generator().manual_seed(2)
    batch = X.unsqueeze(0).repeat(2, 1, 1)
    batch[1, prompt.demo_start:prompt.demo_end] += 0.05 * torch.randn(
        prompt.demo_end - prompt.demo_start, X.shape[1], generator=g)
    return batch


def check(family: str) -> Row:
    """One architecture's Row (module docstring); a SiclError for a name that is not a causal-LM model type of the
    installed transformers (families())."""
    known = families()
    if family not in known:
        from ..errors import SiclError

        raise SiclError(f"conformance: unknown architecture {family!r}: not a model type of the installed "
                        f"transformers' causal-LM auto mapping ({len(known)} of them: conformance.families())")
    t0 = time.perf_counter()
    row = Row(family, known[family], "skipped")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(family)
        except Skip as exc:
            row.reason = str(exc)
        else:
            _check_backends(row, model)
    row.seconds = time.perf_counter() - t0
    return row


def _check_backends(row: Row, model) -> None:
    """check's comparisons on a built model, into `row`."""
    from ..backends import build_backend, make_backend
    from ..errors import SiclError
    from ..models.loading import from_transformers
    from ..run.plan import make_plan

    prompt = _prompt(model)
    ref = _reference(model, prompt)
    lm = from_transformers(model, tokenizer=None, name=f"tiny-{row.family}")
    try:
        hf = make_backend("hf", lm)
    except SiclError as exc:
        row.status, row.reason = "refused", str(exc)
        return
    try:
        auto = make_plan(lm, backend="auto")  # fast where the fast decoder's config builds, else hf and why
        row.head = hf.plan.head.mode
        X = _batch(hf.embed(prompt), prompt)
        given = X.clone()
        got = hf.span_logprobs(X, prompt)
        if not torch.equal(X, given):  # CTRL and GIT scale or shift their inputs_embeds in place
            raise RuntimeError("the hf backend let the model change the embeddings it was given")
        row.hf_error = max(float((got[0] - ref).abs().max()),
                           float((got[1] - _reference(model, prompt, X[1])).abs().max()))
        row.status, row.reason = "hf", dict((a, w) for a, _, w in auto.why)["backend"].removeprefix("auto: ")
        if auto.backend == "fast":
            row.fast_error = float((build_backend(auto, lm).span_logprobs(X, prompt) - got).abs().max())
            row.status, row.reason = "fast", ""
    except Exception as exc:  # a backend (or auto) failing where the model's own forward runs: a defect
        row.status, row.reason = "wrong", _first_line(exc)
        return
    if row.hf_error > TOL or (row.fast_error or 0.0) > TOL:
        row.status = "wrong"



# ------------------------------------------------------------------------------------------------- the model table

TABLE_BEGIN, TABLE_END = "<!-- model-table:begin -->", "<!-- model-table:end -->"
COLUMNS = ("family", "class", "auto runs", "hf head", "why not fast, or why refused or skipped")


def short_reason(row: Row, width: int = 110) -> str:
    """The table's reason, one line of at most `width` characters: the fast decoder's refusal without its preamble
    ('another family' for a family it does not run at all), the hf backend's refusal without the model's name, or
    why no tiny model was checked."""
    reason = " ".join(row.reason.split())
    if reason.startswith("the fast decoder refuses this"):
        reason = reason.split(": ", 1)[1]
    if row.status == "hf" and reason.startswith("the fast backend supports the model families"):
        return "another family"
    if row.status == "refused":
        reason = re.sub(r"^model '[^']*' \([^)]*\):? (is )?", "", reason)
    if len(reason) > width:
        reason = reason[:reason.rfind(" ", 0, width - 4)] + " ..."
    return reason.replace("|", "\\|")


def render(rows: list[Row], version: str) -> str:
    """The model table (markdown, between TABLE_BEGIN and TABLE_END) with its summary line."""
    count = {s: sum(r.status == s for r in rows) for s in ("fast", "hf", "refused", "skipped", "wrong")}
    own = sum(r.head == "own" for r in rows if r.status == "hf")
    lines = [TABLE_BEGIN, "",
             f"Generated by `python scripts/model_table.py --write docs/usage.md` from transformers {version}'s "
             f"causal-LM auto mapping: {len(rows)} architectures, {count['fast']} on the fast backend, "
             f"{count['hf']} on hf ({own} of them through the model's own forward at the span rows, head 'own'; the "
             f"others through its LM head's weight, head 'table'), {count['refused']} refused, {count['skipped']} "
             "not checked here" + (f", {count['wrong']} WRONG" if count["wrong"] else "") + ".", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(rows, key=lambda r: r.family):
        head = r.head or "-"
        lines.append(f"| {r.family} | {r.architecture} | {r.status} | {head} | {short_reason(r)} |")
    return "\n".join(lines + ["", TABLE_END])


def table_span(text: str, where: str) -> tuple[int, int]:
    """(start, end) of the model table in a document's text, its markers included; a SiclError naming `where` when
    the text does not hold TABLE_BEGIN and, after it, TABLE_END."""
    start = text.find(TABLE_BEGIN)
    end = text.find(TABLE_END, max(start, 0))
    if start < 0 or end < 0:
        from ..errors import SiclError

        raise SiclError(f"{where}: holds no model table (the markers {TABLE_BEGIN} and {TABLE_END}, in that order)")
    return start, end + len(TABLE_END)


def parse(text: str, where: str = "the document") -> tuple[str, dict[str, dict]]:
    """(the transformers version, {family: {column: value}}) of the model table in a document's text."""
    start, end = table_span(text, where)
    body = text[start:end]
    version = body.split("from transformers ", 1)[1].split("'s ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if line.startswith("| ") and len(cells) == len(COLUMNS) and cells[0] != COLUMNS[0]:
            rows[cells[0]] = dict(zip(COLUMNS, cells))
    return version, rows


def check_doc(path) -> str:
    """The text of the document `path` that write() will rewrite, checked before the sweep (scripts/model_table.py
    --write): a readable text file it can write, holding the table's markers; a SiclError naming it otherwise."""
    import os
    from pathlib import Path

    from ..errors import SiclError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SiclError(f"--write {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not os.access(path, os.W_OK):
        raise SiclError(f"--write {path}: cannot write to it (permission denied)")
    table_span(text, f"--write {path}")
    return text


def write(path, table: str) -> None:
    """Replace the model table in the document at `path` (between its markers) with `table` (check_doc's checks)."""
    from pathlib import Path

    text = check_doc(path)
    start, end = table_span(text, f"--write {path}")
    Path(path).write_text(text[:start] + table + text[end:], encoding="utf-8")


__all__ = ["COLUMNS", "KNOBS", "MAX_PARAMS", "OVERRIDES", "Row", "Skip", "TINY", "TOL", "attention_as", "build",
           "check", "check_doc", "families", "parse", "render", "short_reason", "table_span", "tiny_config", "write"]
