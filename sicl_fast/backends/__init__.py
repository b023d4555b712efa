"""Backends: `hf` (any transformers causal LM), `naive` (the reference's form), `fast` (own forward: Llama, Qwen3,
Gemma 2, Gemma 3, with prefix KV reuse). `auto` picks `fast` for the families it supports, `hf` otherwise."""
from __future__ import annotations

from ..errors import SiclError
from .base import Backend
from .fast import SUPPORTED_FAMILIES as FAST_FAMILIES
from .fast import FastBackend
from .hf import HFBackend
from .naive import NaiveBackend

BACKENDS: dict[str, type[Backend]] = {"hf": HFBackend, "naive": NaiveBackend, "fast": FastBackend}


def make_backend(name: str, lm) -> Backend:
    """Backend by name. 'auto' picks the best available backend for the model."""
    if name == "auto":
        name = "fast" if lm.family in FAST_FAMILIES else "hf"
    if name not in BACKENDS:
        raise SiclError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    return BACKENDS[name](lm)


__all__ = ["Backend", "BACKENDS", "FAST_FAMILIES", "FastBackend", "HFBackend", "NaiveBackend", "make_backend"]
