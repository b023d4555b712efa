"""Model loading (and, later, the fast backend's own model code)."""
from .loading import HOW_TO_POINT, LoadedModel, describe, from_transformers, load, resolve

__all__ = ["HOW_TO_POINT", "LoadedModel", "describe", "from_transformers", "load", "resolve"]
