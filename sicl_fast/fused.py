"""Which implementation does the hot tensor work: torch reference, Triton kernels, or the C++ extension.

    span head (hidden [B, P, d] -> [B, P] log-probs):  Triton on CUDA or with SICL_TRITON=1, else torch (chunked)
    step ops (perturb / update):                        Triton on CUDA or with SICL_TRITON=1,
                                                        else C++ (sicl_fast._C) on the CPU when it is built,
                                                        else torch
    proxy (f, C, R, G from [B, P] log-probs):           same choice as the step ops (`proxy` below)

Every choice computes the same function as the torch reference and is tested against it (tests/test_kernel_*,
tests/test_cpp_*, tests/test_fused_*). With SICL_TRITON=1 on the CPU, TRITON_INTERPRET=1 must be set before
triton is imported (the kernels then run through numpy: slow, for tests). SICL_CPP=0 turns the C++ path off.

Neither triton nor the extension is imported until a path that needs it is chosen, so `import sicl_fast` works
without them; asking for a missing one raises a SiclError that says how to get it.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from .errors import SiclError
from .logprobs import vocab_chunked_logprobs
from .proxy import ProxyOut
from .proxy import proxy as torch_proxy
from .zo import TorchOps

_KERNELS = None


def triton_wanted(device: torch.device) -> bool:
    """Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1 when SICL_TRITON=1 asks for it."""
    return torch.device(device).type == "cuda" or os.environ.get("SICL_TRITON") == "1"


def kernels():
    """The `sicl_fast.kernels` package (Triton). Raises SiclError when triton is missing.

    Installed (pip install -e . / a wheel) it is a real subpackage (package_dir maps it to kernels/); run from
    a source checkout (PYTHONPATH=.) the top-level kernels/ folder next to sicl_fast/ is loaded under that name.
    """
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise SiclError(f"the Triton kernels need the `triton` package (pip install triton==3.6.0): {exc}") from None
    name = __package__ + ".kernels"
    if name in sys.modules:
        _KERNELS = sys.modules[name]
        return _KERNELS
    try:
        _KERNELS = importlib.import_module(name)
        return _KERNELS
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
    src = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if not src.is_file():
        raise SiclError(f"sicl_fast.kernels is not installed and {src} does not exist; reinstall sicl-fast")
    spec = importlib.util.spec_from_file_location(name, src, submodule_search_locations=[str(src.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _KERNELS = module
    return module


def cpp_available() -> bool:
    """True when the C++ extension sicl_fast._C is built (and SICL_CPP is not 0)."""
    if os.environ.get("SICL_CPP") == "0":
        return False
    from . import cpp_ops

    return cpp_ops.available()


def span_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap=None) -> torch.Tensor:
    """[B, P, d] hidden states at the span positions -> [B, P] float32 log p(target)."""
    if triton_wanted(hidden.device):
        return kernels().span_logprobs(hidden, weight, targets, softcap=softcap)
    return vocab_chunked_logprobs(hidden, weight, targets, softcap=softcap)


def default_ops(device: torch.device):
    """The step ops (perturb / update) for a device: TritonOps, CppOps or TorchOps (see module docstring)."""
    if triton_wanted(device):
        return kernels().TritonOps()
    if torch.device(device).type == "cpu" and cpp_available():
        from .cpp_ops import CppOps

        return CppOps()
    return TorchOps()


def proxy(logprobs: torch.Tensor, offsets: torch.Tensor, alpha: float = 0.6, beta: float = 0.3,
          gamma: float = 0.1, q: float = 0.1) -> ProxyOut:
    """The proxy (sicl_fast.proxy.proxy's function) on the fastest path for logprobs' device."""
    if triton_wanted(logprobs.device):
        return kernels().proxy(logprobs, offsets, alpha, beta, gamma, q)
    if logprobs.device.type == "cpu" and logprobs.dtype == torch.float32 and cpp_available():
        from .cpp_ops import proxy as cpp_proxy

        return cpp_proxy(logprobs, offsets, alpha, beta, gamma, q)
    return torch_proxy(logprobs, offsets, alpha, beta, gamma, q)


__all__ = ["triton_wanted", "kernels", "cpp_available", "span_head", "default_ops", "proxy"]
