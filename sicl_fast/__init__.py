"""sicl_fast: fast self-improving in-context learning (test-time calibration of a fixed few-shot prompt).

Public API:
    load(model=None, dtype="auto", device="auto") -> LoadedModel       the embedded SmolLM2-135M by default
    Engine(lm=None, backend="auto")                                    prepare / proxy / calibrate / generate
    CalibrationConfig, Calibrator, CalibrationResult                   Algorithm 1 and its knobs
    Request, parse_request, read_requests, render_structured           the two request forms
    proxy(logprobs, offsets, ...) -> ProxyOut                          the reference proxy
"""
from .threads import choose_wait_policy

choose_wait_policy()  # before torch loads OpenMP, which reads the wait policy once (sicl_fast.threads)

from .ascent import PRESETS, CalibrationConfig, CalibrationResult, Calibrator
from .engine import Engine
from .errors import ContextLengthError, ModelLoadError, NumericalError, RequestError, SiclError
from .generate import Generation
from .models import LoadedModel, from_transformers, load
from .proxy import ProxyOut, proxy
from .requests import DEFAULT_TEMPLATE, Request, parse_request, read_requests, render_structured
from .spans import Prompt, tokenize

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "CalibrationConfig", "CalibrationResult", "Calibrator", "Engine", "ContextLengthError",
    "ModelLoadError", "NumericalError", "RequestError", "SiclError", "Generation", "LoadedModel",
    "from_transformers", "load", "ProxyOut", "proxy", "DEFAULT_TEMPLATE", "Request", "parse_request",
    "read_requests", "render_structured", "Prompt", "tokenize",
]
