"""What a model is, without loading its weights: its name, family and parameter count, for what a command decides
before a model loads (an icleval run resumed with nothing left to do prints its report without the model; the
command line's --pack auto, which asks whether `auto` would take the fast backend).

    name, family, n_params = model_facts("gemma3-270m")     the same as load()'s name, lm.family and numel sum
    name, config, arch = model_arch("gemma3-270m")           its config and architecture on the meta device
"""
from __future__ import annotations

import os


def model_facts(model: str | os.PathLike | None = None) -> tuple[str, str, int]:
    """(name, family, parameters) of a model as --model names it (model_arch)."""
    name, cfg, arch = model_arch(model)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return name, text.model_type, sum(p.numel() for p in arch.parameters())


def model_arch(model: str | os.PathLike | None = None):
    """(name, config, architecture) of a model as --model names it: the config from its transformers folder (a GGUF
    model's converted folder; converted first when the cache has none) and the architecture built from it on the
    meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .loading import _quiet_transformers, model_folder, resolve

    _quiet_transformers()
    name = resolve(model)[0]
    cfg = AutoConfig.from_pretrained(model_folder(model))
    with torch.device("meta"):
        arch = AutoModelForCausalLM.from_config(cfg)
    return name, cfg, arch


__all__ = ["model_arch", "model_facts"]
