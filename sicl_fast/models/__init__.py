"""Models: loading (GGUF, transformers folders, the converted-model cache) and the fast backend's own decoder."""
from .loading import HOW_TO_POINT, LoadedModel, describe, from_transformers, load, resolve

__all__ = ["HOW_TO_POINT", "LoadedModel", "describe", "from_transformers", "load", "resolve"]
