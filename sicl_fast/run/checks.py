"""Entry-point checks of the Python API: what comes in from a user (a prompt, embeddings, the size of a step) is
checked once here, before any work, and refused with a SiclError naming the argument.

    check_prompt(prompt, lm)                           a Prompt from Engine.prepare, of this model's vocabulary
    check_tokens(prompt, lm)                           token ids inside the model's vocabulary
    check_embeddings(X, prompt, lm, "embeds")          [L, d] floating, finite, this prompt's length, the model's
                                                       width, on the model's device
    check_calibration(cal, lm, where)                  a stored Calibration whose rows have the model's width
    check_perturbation(config, lm)                     mu * scale large enough for float32 to perturb this model
    check_step_memory(lm, prompt, config)              refuse a step whose estimated memory (what it keeps and its
                                                       activations: sicl_fast.run.memory) exceeds what is free
    check_inputs(backend, prompt, config, X0)          a calibration's prompt, X0 and perturbation; with the
    calibration_inputs(...)                            memory of its step too
"""
from __future__ import annotations


import torch

from ..errors import NumericalError, SiclError
from .knobs import MIN_MU
from .memory import available_memory, form_of, step_bytes
from ..step.spec import block_end
from ..formats.spans import Prompt, vocabulary_key, vocabulary_size

GiB = 1 << 30


def check_prompt(prompt, lm=None, name: str = "prompt") -> Prompt:
    """A Prompt; with `lm`, one made for this model: the tokenizer's vocabulary (Prompt.vocabulary) and the token ids
    (check_tokens) are the model's."""
    if not isinstance(prompt, Prompt):
        raise SiclError(f"{name}: must be a Prompt (from Engine.prepare(request)), got {type(prompt).__name__}")
    ids = prompt.input_ids
    if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu" or ids.dtype != torch.int64:
        what = f"a {ids.dtype} tensor on {ids.device}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise SiclError(f"request {prompt.id!r}: {name}.input_ids: must be an int64 tensor on the CPU, got {what}")
    if lm is not None:
        if prompt.vocabulary is not None and prompt.vocabulary != vocabulary_key(lm.tokenizer):
            raise SiclError(f"request {prompt.id!r}: {name}: was tokenized for another model's vocabulary "
                            f"({vocabulary_size(prompt.vocabulary)} tokens; this model's has "
                            f"{len(lm.tokenizer)}); prepare it with this engine (Engine.prepare)")
        check_tokens(prompt, lm)
    return prompt


def check_embeddings(X, prompt: Prompt, lm, name: str = "embeds") -> torch.Tensor:
    """X [L, d]: a floating tensor with one row per prompt token (L = prompt.length) and the model's width d,
    finite. Returns X. Rows of another prompt of another length are caught by L."""
    where = f"request {check_prompt(prompt).id!r}: {name}"
    if not isinstance(X, torch.Tensor):
        raise SiclError(f"{where}: must be a torch.Tensor [L, d], got {type(X).__name__}")
    if X.device != lm.device:
        raise SiclError(f"{where}: is on device {X.device}, the model is on {lm.device} (embeddings of another "
                        f"engine?); move it there first (.to({str(lm.device)!r}))")
    if not X.is_floating_point():
        raise SiclError(f"{where}: must be a floating-point tensor (float32, bfloat16, float16), got {X.dtype}")
    d = lm.hidden_size
    if X.dim() != 2 or X.shape[1] != d:
        other = " (embeddings of another model?)" if X.dim() == 2 else ""
        raise SiclError(f"{where}: must have shape [L, {d}] (L = {prompt.length} tokens), got {tuple(X.shape)}"
                        f"{other}")
    if X.shape[0] != prompt.length:
        raise SiclError(f"{where}: has {X.shape[0]} rows, the prompt has {prompt.length} tokens "
                        "(embeddings of another prompt?)")
    if not bool(torch.isfinite(X).all()):
        row = int(torch.nonzero(~torch.isfinite(X))[0, 0])
        raise NumericalError(f"{where}: contains NaN or inf (row {row})")
    return X


def check_calibration(cal, lm, where: str) -> None:
    """A stored Calibration (sicl_fast.store) made by a model of this width: its rows [n, d] replace the first n
    rows of a prompt's embeddings. One of another model with the same width and vocabulary cannot be told from
    this one's (names differ for one model loaded two ways); another vocabulary shows in its token ids
    (sicl_fast.answering.reuse.fits)."""
    w = int(cal.rows.shape[-1])
    if cal.rows.dim() != 2 or w != lm.hidden_size:
        raise SiclError(f"{where}: calibration {cal.key[:12]} was made by model {cal.model!r}, of width {w}; this "
                        f"engine's model {lm.name!r} has width {lm.hidden_size}: calibrate the prompt with this engine")


def step_memory(lm, prompt: Prompt, config, kept: int = 0, bucket=None, form: str | None = None,
                prefix: bool = True) -> int:
    """Estimated peak bytes of one ascent step: what the step keeps (its state with the history and `kept` copies of
    X [L, d], the perturbation batch, and with the fast backend's forward (form 'rows' or 'plain') the prefix K/V,
    the value rows' reference and its logits, the pass's K/V) and one layer's activations for its rows
    (sicl_fast.run.memory.step_bytes; bucket: the length bucket it runs padded to, or None; prefix: False without
    the prefix K/V, the packed step)."""
    return step_bytes(lm, prompt, config, kept, bucket, form, prefix).total


def check_tokens(prompt: Prompt, lm) -> None:
    """The prompt's token ids (the span targets among them) lie in the model's vocabulary [0, V): the kernels
    that read targets on the device rely on it and never check again."""
    ids, V = prompt.input_ids, int(lm.head_weight.shape[0])
    bad = torch.nonzero((ids < 0) | (ids >= V))
    if bad.numel():
        t = int(bad[0, 0])
        raise SiclError(f"request {prompt.id!r}: token {int(ids[t])} at position {t} is outside the model's "
                        f"vocabulary [0, {V}) (a prompt tokenized for another model?)")


def calibration_inputs(backend, prompt: Prompt, config, X0=None, kept: int = 0, bucket=None,
                       reclaimable: int = 0) -> torch.Tensor:
    """Calibrator.run's entry checks: the prompt and its tokens, X0 (default: the prompt's own embeddings;
    returned as float32), the perturbation's size and the memory of one step with `kept` copies of X beside it
    (padded to `bucket`, a length bucket, where one is given; reclaimable: what a step cache would give back for
    it)."""
    X0 = check_inputs(backend, prompt, config, X0)
    check_step_memory(backend.lm, prompt, config, kept=kept, bucket=bucket, form=form_of(backend.plan),
                      reclaimable=reclaimable)
    return X0


def check_inputs(backend, prompt: Prompt, config, X0=None) -> torch.Tensor:
    """calibration_inputs' checks but the memory's: the prompt and its tokens, X0 (default: the prompt's own
    embeddings; returned as float32) and the perturbation's size. A StepPlan (sicl_fast.calibration.step_plan) checks
    the memory on the bytes it counted."""
    check_prompt(prompt, backend.lm)
    X0 = check_embeddings(backend.embed(prompt) if X0 is None else X0, prompt, backend.lm, "X0")
    check_perturbation(config, backend.lm)
    return X0.detach().float()  # the ascent moves X itself; no autograd history of the caller's tensor comes along


def check_perturbation(config, lm) -> None:
    """The effective mu (config with its scale resolved) against the model's embedding scale: below MIN_MU of it,
    X + mu U rounds back to X in float32 (the config checks mu alone; an explicit scale can still make it so)."""
    if config.estimator == "grad":
        return  # no perturbation
    rel = config.mu_eff / lm.embedding_scale
    if rel < MIN_MU:
        raise SiclError(f"CalibrationConfig: mu * scale = {config.mu_eff:.3g} is {rel:.2g} of this model's "
                        f"embedding scale ({lm.embedding_scale:.3g}); below {MIN_MU:g} of it the perturbation is lost "
                        "to float32 rounding (raise mu or scale)")


def check_step_memory(lm, prompt: Prompt, config, pack: int = 1, kept: int = 0, bucket=None, form: str | None = None,
                      reclaimable: int = 0, size=None) -> None:
    """Refuse a step whose estimate (step_memory with `kept` copies of X, padded to `bucket` where given, its forward
    of `form`; `pack` such steps at once, without the prefix K/V, for the packed step) exceeds the memory free on
    the model's device and what a step cache would give back for it (`reclaimable`: the bytes its kept steps
    hold). size: the step's StepBytes where the caller counted them (a StepPlan's, its copies of X among them):
    the estimate is theirs then."""
    need = pack * (size.total if size is not None else step_memory(lm, prompt, config, kept, bucket, form,
                                                                   prefix=pack == 1))
    free = available_memory(lm.device) + reclaimable
    if need > free:
        rows = block_end(config, prompt, bucket)
        packed = f", {pack} prompts packed (--pack)" if pack > 1 else ""
        raise SiclError(
            f"request {prompt.id!r}: one ascent step needs about {need / GiB:.1f} GiB (" + (
                f"the exact gradient of {rows} tokens), more than the {free / GiB:.1f} GiB of memory free; "
                + ("shorten the prompt" if config.checkpoint else "use checkpoint (--checkpoint)")
                if config.estimator == "grad" else
                f"N={config.N}: {config.batch} rows of {rows} tokens{packed}), more than the {free / GiB:.1f} GiB "
                "of memory free; lower N" + (" or --pack" if pack > 1 else "")))


__all__ = ["check_prompt", "check_tokens", "check_embeddings", "calibration_inputs", "check_inputs",
           "check_perturbation", "check_step_memory", "step_memory", "available_memory"]
