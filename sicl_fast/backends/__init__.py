"""Backends: `hf` (any transformers causal LM), `naive` (the reference's form), `fast` (own forward, later)."""
from __future__ import annotations

from ..errors import SiclError
from .base import Backend
from .hf import HFBackend
from .naive import NaiveBackend

BACKENDS: dict[str, type[Backend]] = {"hf": HFBackend, "naive": NaiveBackend}


def make_backend(name: str, lm) -> Backend:
    """Backend by name. 'auto' picks the best available backend for the model."""
    if name == "auto":
        name = "hf"
    if name not in BACKENDS:
        raise SiclError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    return BACKENDS[name](lm)


__all__ = ["Backend", "BACKENDS", "HFBackend", "NaiveBackend", "make_backend"]
