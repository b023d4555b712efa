"""What a model is, without loading its weights: its name, family and parameter count, its architecture as load()
would place it, and a fingerprint of its files, for what a command decides before a model loads (a run resumed with
nothing left to do ends without the model; a resume with other settings is refused before it loads).

    name, family, n_params = model_facts("gemma3-270m")     the same as load()'s name, lm.family and numel sum
    lm = unloaded(model, dtype, device)                     a LoadedModel without weights
    model_identity(lm)                                      {"name", "fingerprint"}: what records name the model by
    name, config, arch = model_arch("gemma3-270m")           its config and architecture on the meta device (the
                                                             command line's --pack auto asks whether `auto` would
                                                             take the fast backend)
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .loading import LoadedModel
from .output_head import OutputHead, head_table

# the files of a transformers folder that make its numbers: config, tokenizer and weights (not a README, not the
# cache's own manifest, which holds the time of its conversion)
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".tiktoken", ".gguf")


def _architecture(model: str | os.PathLike | None):
    """(name, path, the architecture built on the meta device: no memory, no weights read) of a model as --model
    names it, from the config of its transformers folder (a GGUF model's converted folder; converted first when the
    cache has none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .loading import _quiet_transformers, model_folder, resolve

    _quiet_transformers()
    name, path, _ = resolve(model)
    cfg = AutoConfig.from_pretrained(model_folder(model))
    with torch.device("meta"):
        arch = AutoModelForCausalLM.from_config(cfg)
    return name, path, arch


def model_arch(model: str | os.PathLike | None = None):
    """(name, config, architecture on the meta device) of a model as --model names it (_architecture)."""
    name, _, arch = _architecture(model)
    return name, arch.config, arch


def model_facts(model: str | os.PathLike | None = None) -> tuple[str, str, int]:
    """(name, family, parameters) of a model as --model names it (_architecture)."""
    name, _, arch = _architecture(model)
    cfg = arch.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return name, text.model_type, sum(p.numel() for p in arch.parameters())


@dataclass
class Unloaded(LoadedModel):
    """A LoadedModel without weights (its architecture on the meta device) that reports the device and dtype a load
    would give it: what the run plan reads (sicl_fast.run.plan.make_plan), before the model loads."""

    at: torch.device | None = None
    as_dtype: torch.dtype | None = None

    @property
    def device(self) -> torch.device:
        return self.at

    @property
    def dtype(self) -> torch.dtype:
        return self.as_dtype

    @cached_property
    def output_head(self) -> OutputHead:
        """The head by the table alone (output_head.head_table): the check runs the model's forward, which a model
        on the meta device cannot; the load checks it (LoadedModel.output_head), and its plan is the record's."""
        return head_table(self)


def unloaded(model: str | os.PathLike | None, dtype: str = "auto", device: str = "auto") -> Unloaded:
    """The model as load(model, dtype, device) would give it, without its weights ('auto' decided as load decides
    it, from what the checkpoint stores: stored_dtype.bf16_checkpoint). The tokenizer is not loaded (None)."""
    from .loading import resolve, resolve_device, resolve_dtype
    from .stored_dtype import bf16_checkpoint

    dev, _ = resolve_device(device)
    _, path, kind = resolve(model)
    dt, _ = resolve_dtype(dtype, dev, lambda: bf16_checkpoint(path, kind))
    name, path, arch = _architecture(model)
    return Unloaded(model=arch, tokenizer=None, name=name, extra={"path": str(path)}, at=dev, as_dtype=dt)


def transformers_attention(lm: LoadedModel) -> str:
    """The attention transformers' own forward runs for this model, as its config names it ('transformers:sdpa',
    'transformers:eager', ...): what the hf and naive backends run (Backend.attention_kernel)."""
    return f"transformers:{getattr(lm.model.config, '_attn_implementation', None)}"


def weights_digest(lm) -> str:
    """A digest of every parameter (name, dtype, shape, bytes) and the model config, computed once per
    LoadedModel (kept in lm.extra): about a second per 500 MB of weights on a CPU core."""
    got = lm.extra.get("weights_digest")
    if got is None:
        h = hashlib.blake2b(digest_size=20)
        h.update(lm.model.config.to_json_string(use_diff=False).encode())
        for name, p in lm.model.named_parameters():
            t = p.detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        got = lm.extra["weights_digest"] = h.hexdigest()
    return got


def files_fingerprint(path: str | os.PathLike) -> str:
    """'file:' and 16 hex digits of the sha256 of a model's files: a GGUF file's content, or a transformers folder's
    config, tokenizer and weight files (MODEL_FILE_SUFFIXES: their names and contents). Each file's digest is
    remembered by the model cache against its size and mtime (converted.source_digest), so only a changed file is
    read again."""
    from .converted import source_digest

    p = Path(path)
    if p.is_file():
        return "file:" + source_digest(p)[:16]
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.suffix in MODEL_FILE_SUFFIXES:
            h.update(f"{f.name}|{source_digest(f)}\n".encode())
    return "file:" + h.hexdigest()[:16]


def model_identity(lm: LoadedModel) -> dict:
    """What records name a model by: its name and a fingerprint of its files where it was loaded from a path
    (files_fingerprint; the same for an Unloaded model of that path), else of its weights ('weights:' and 16 hex
    digits of weights_digest: a model built in memory)."""
    path = lm.extra.get("path")
    fingerprint = files_fingerprint(path) if path else "weights:" + weights_digest(lm)[:16]
    return {"name": lm.name, "fingerprint": fingerprint}


__all__ = ["model_arch", "model_facts", "Unloaded", "unloaded", "transformers_attention", "weights_digest",
           "files_fingerprint", "model_identity", "MODEL_FILE_SUFFIXES"]
