"""How many threads the engine computes on: one number per process, applied once to torch and to the C++ ops.

    n = resolve_threads(None)      the cores this process may use (os.sched_getaffinity)
    apply_threads(n)               torch's intra-op threads and sicl_fast._C's thread count, both n

torch and the C++ extension share one OpenMP runtime (the extension links libgomp.so.1, which resolves to the
copy torch has already loaded), so there is one pool of threads; the extension takes its count from the value set
here for every calling thread (csrc/threads.h), not from the calling thread's OpenMP setting.
"""
from __future__ import annotations

import os

from .errors import SiclError


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), or the machine's count where that is not known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """The thread count to use: `threads` checked (an int >= 1), or the available cores when None."""
    if threads is None:
        return available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SiclError(f"threads must be an integer >= 1, got {threads!r}")
    return threads


def apply_threads(threads: int | None) -> int:
    """Set torch's and the C++ ops' thread count to resolve_threads(threads); returns it."""
    import torch

    from .ops import cpp_ops

    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if cpp_ops.available():
        cpp_ops.set_num_threads(n)
    return n


__all__ = ["available_cores", "apply_threads", "resolve_threads"]
