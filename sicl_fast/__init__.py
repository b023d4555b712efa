"""sicl_fast: fast self-improving in-context learning (test-time calibration of a fixed few-shot prompt).

Public API:
    load(model=None, dtype="auto", device="auto") -> LoadedModel       the embedded SmolLM2-135M by default
    Engine(lm=None, backend="auto")                                    prepare / proxy / calibrate / generate
    CalibrationConfig, Calibrator, CalibrationResult                   Algorithm 1 and its knobs
    Request, parse_request, read_requests, render_structured           the two request forms
    proxy(logprobs, offsets, ...) -> ProxyOut                          the reference proxy
"""
from .run.threads import choose_wait_policy

choose_wait_policy()  # before torch loads OpenMP, which reads the wait policy once (sicl_fast.run.threads)

import importlib
import importlib.abc
import importlib.util
import sys

from .backends.generate import Generation
from .calibration.ascent import PRESETS, CalibrationConfig, CalibrationResult, Calibrator
from .step.proxy import ProxyOut, proxy
from .engine import Engine
from .errors import ContextLengthError, ModelLoadError, NumericalError, RequestError, SiclError
from .formats.requests import DEFAULT_TEMPLATE, Request, parse_request, read_requests, render_structured
from .formats.spans import Prompt, tokenize
from .models import LoadedModel, from_transformers, load

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "CalibrationConfig", "CalibrationResult", "Calibrator", "Engine", "ContextLengthError",
    "ModelLoadError", "NumericalError", "RequestError", "SiclError", "Generation", "LoadedModel",
    "from_transformers", "load", "ProxyOut", "proxy", "DEFAULT_TEMPLATE", "Request", "parse_request",
    "read_requests", "render_structured", "Prompt", "tokenize",
]

# The module paths before the modules were grouped by role (issues #41, #48): `sicl_fast.OLD` is the module
# `sicl_fast.NEW` itself (one object: a patch of either name patches both), so code that imported the old paths
# keeps working. CHANGELOG.md lists them.
MOVED = {
    "answer": "answering.answer", "answer_kv": "answering.answer_kv", "ascent": "calibration.ascent",
    "benchmark": "diagnostics.benchmark", "best": "step.best", "chat": "answering.chat",
    "checks": "run.checks", "cli": "commands.cli", "client": "serve.client", "distributed": "commands.distributed",
    "export": "answering.export", "generate": "backends.generate", "grad": "calibration.grad",
    "gradstudy": "diagnostics.gradstudy", "graphs": "run.graphs", "inputs": "formats.inputs", "jobs": "commands.work",
    "kernel_count": "diagnostics.kernel_count", "knobs": "run.knobs", "logprobs": "step.logprobs",
    "models.cache": "models.converted", "packed": "calibration.packed", "plan": "run.plan",
    "profile": "diagnostics.profile", "progress": "run.progress", "proxy": "step.proxy",
    "records": "formats.records", "requests": "formats.requests", "reuse": "answering.reuse",
    "rng": "step.rng", "run_args": "run.run_args", "spans": "formats.spans",
    "spec": "step.spec", "static": "calibration.static", "step_state": "step.step_state",
    "threads": "run.threads", "workers": "run.workers", "zo": "step.zo",
    # one step's math had a folder under calibration/ before it got a floor of its own (issue #48)
    "calibration.step": "step", **{f"calibration.step.{m}": f"step.{m}" for m in (
        "best", "logprobs", "proxy", "rng", "spec", "step_state", "stop_rule", "zo")},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of MOVED and answers with the module at its new path (imported then, not before)."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix(__name__ + ".")
        if old == name or old not in MOVED:
            return None
        # the new path's file as the origin: `python -m` puts it in sys.argv[0]
        return importlib.util.spec_from_loader(name, self, origin=importlib.util.find_spec(self.new(name)).origin)

    @staticmethod
    def new(name: str) -> str:
        return f"{__name__}.{MOVED[name.removeprefix(__name__ + '.')]}"

    def create_module(self, spec):
        module = importlib.import_module(self.new(spec.name))
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old path's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name):
        """`python -m sicl_fast.cli`: runs the moved module's main(), as its own `python -m` would."""
        return compile(f"import sys\nfrom {self.new(name)} import main\nsys.exit(main())", name, "exec")


sys.meta_path.append(_MovedModules())
# The old paths of modules already imported are registered now: `import sicl_fast.proxy` then leaves the package's
# `proxy` (the function) as it was, where a first import through the finder would set it to the module.
for _old, _new in MOVED.items():
    if f"{__name__}.{_new}" in sys.modules:
        sys.modules.setdefault(f"{__name__}.{_old}", sys.modules[f"{__name__}.{_new}"])
del _old, _new
