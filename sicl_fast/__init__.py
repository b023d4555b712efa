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
import os
import sys
import types

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

# The module paths before the modules were grouped by role (issues #41, #48, #54): `sicl_fast.OLD` is the module
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
    # the C++ extension was built at the package's root, above the ops that import it (issue #54)
    "_C": "ops._C",
    # one step's math had a folder under calibration/ before it got a floor of its own (issue #48)
    "calibration.step": "step", **{f"calibration.step.{m}": f"step.{m}" for m in (
        "best", "logprobs", "proxy", "rng", "spec", "step_state", "stop_rule", "zo")},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of MOVED, or a module under one (`sicl_fast.calibration.step.X`), and answers with the
    module at its new path (imported then, not before). It is the first finder: the path finder would otherwise load
    a module under an old package path (whose __path__ is the new package's folder) a second time, as a second
    module object."""

    def find_spec(self, name, path=None, target=None):
        new = self.new(name)
        spec = importlib.util.find_spec(new) if new is not None else None
        if spec is None:
            return None
        # the new path's file as the origin: `python -m` puts it in sys.argv[0]
        return importlib.util.spec_from_loader(name, self, origin=spec.origin)

    @staticmethod
    def new(name: str) -> str | None:
        """The new path of an old one: its longest prefix in MOVED replaced (None: not an old path)."""
        parts = name.split(".")
        if parts[0] != __name__:
            return None
        for i in range(len(parts), 1, -1):
            old = ".".join(parts[1:i])
            if old in MOVED:
                return ".".join([__name__, MOVED[old], *parts[i:]])
        return None

    def create_module(self, spec):
        module = importlib.import_module(self.new(spec.name))
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old path's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name):
        """`python -m OLD`: the moved module's main() where it has one (`python -m sicl_fast.cli`); else one line
        and exit status 2, as for any usage error (its new path would run nothing)."""
        new = self.new(name)
        if callable(getattr(importlib.import_module(new), "main", None)):
            return compile(f"import sys\nfrom {new} import main\nsys.exit(main())", name, "exec")
        line = (f"python -m {name}: {name} (now {new}) has no command line; the command line is `sicl-fast` "
                "(or python -m sicl_fast.cli)")
        return compile(f"import sys\nprint({line!r}, file=sys.stderr)\nsys.exit(2)", name, "exec")


class _Package(types.ModuleType):
    """The package's module type: an old path imported through the finder becomes an attribute of its parent (as
    any submodule does), except where the package has a name of its own there: `sicl_fast.proxy` stays the
    function `proxy`, whose module is sicl_fast.step.proxy."""

    def __setattr__(self, name, value):
        if name in MOVED and isinstance(value, types.ModuleType) and not isinstance(
                self.__dict__.get(name, value), types.ModuleType):
            return
        super().__setattr__(name, value)


class _TreeKernels(importlib.abc.MetaPathFinder):
    """Finds `sicl_fast.kernels` in a source tree, where the kernels sit beside the package (kernels/ at the top
    level, as the layout has it) and nothing is installed: a plain copy of the repository (the GPU machine's device
    check, bench/gpu_check.py) imports them as an install does (pyproject.toml's package-dir maps them there; a
    wheel holds them as sicl_fast/kernels, and this finder is then not installed). The package's own folder's
    neighbour, never another copy's: a tree run beside an editable install of another tree takes its own kernels."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != f"{__name__}.kernels":
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(self.folder, "__init__.py"),
                                                      submodule_search_locations=[self.folder])


_here = os.path.dirname(os.path.abspath(__file__))
_tree = os.path.dirname(_here)
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ not in ("_MovedModules", "_TreeKernels")]
sys.meta_path.insert(0, _MovedModules())
if not os.path.isdir(os.path.join(_here, "kernels")) and os.path.isfile(os.path.join(_tree, "pyproject.toml")) \
        and os.path.isfile(os.path.join(_tree, "kernels", "__init__.py")):
    sys.meta_path.insert(0, _TreeKernels(os.path.join(_tree, "kernels")))
del _here, _tree
sys.modules[__name__].__class__ = _Package
