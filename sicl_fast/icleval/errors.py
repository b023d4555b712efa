"""Errors and warnings of the ICLEval support. Every message names the file, the uid and the field or span."""
from __future__ import annotations

from ..errors import SiclError, SiclWarning


class ICLEvalError(SiclError):
    """An ICLEval file or sample is malformed, unknown, or breaks a rendering/span invariant."""


class ICLEvalDataWarning(SiclWarning):
    """A task file differs from the released ICLEval data (sha256 mismatch); it is still loaded."""


def where(task_file: str, uid: object = None, field: str | None = None) -> str:
    """The 'file: uid N: field F' prefix every ICLEval error message starts with."""
    parts = [f"{task_file}.json" if not task_file.endswith(".json") else task_file]
    if uid is not None:
        parts.append(f"uid {uid}")
    if field is not None:
        parts.append(f"field {field!r}")
    return ": ".join(parts)
