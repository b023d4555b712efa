"""How many threads the engine computes on, and how they wait: one number per process, applied once to torch and
to the C++ ops, and one OpenMP wait policy.

    n, why = resolve_threads(None)  the count asked for, else OMP_NUM_THREADS when set, else the cores this process
                                    may use (os.sched_getaffinity); why says which (a run plan axis)
    apply_threads(n)                torch's intra-op threads and sicl_fast.ops._C's thread count, both n
                                    (sicl_fast.backends.build_backend calls it with the plan's count: the one place)
    choose_wait_policy()            once, when sicl_fast is imported: OMP_WAIT_POLICY=PASSIVE unless the user set
                                    OMP_WAIT_POLICY or GOMP_SPINCOUNT; returns (policy, why) for the run plan

torch and the C++ extension share one OpenMP runtime (the extension links libgomp.so.1, which resolves to the
copy torch has already loaded), so there is one pool of threads; the extension takes its count from the value set
here for every calling thread (csrc/threads.h), not from the calling thread's OpenMP setting.

The wait policy: at the end of every parallel region a thread waits for the others. libgomp's default lets a
waiting thread spin on its core for a while first; beside other busy processes the spinning takes the core from
the thread being waited for, and the step collapses (bench/contention.py compares the policies). PASSIVE sleeps
at once. libgomp reads the variable once, when it loads (at `import torch`), so it is set before that or not at
all: sicl_fast/__init__.py calls choose_wait_policy() before it imports torch, which covers the CLI and every
program that imports sicl_fast first; a program that imported torch before keeps libgomp's default (the plan says
so). Processes started later (Ray's workers, bench/contention.py's) inherit the variable.
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from .knobs import check_range

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's own choice of how OpenMP threads wait
_policy: tuple[str, str] | None = None  # what choose_wait_policy decided, once per process


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), or the machine's count where that is not known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> tuple[int, str]:
    """(the thread count to use, why): `threads` checked against the knob table (an int in [1, 4096]), else
    OMP_NUM_THREADS when it holds one number (the user said so for every OpenMP program: the issue's workaround,
    and the test suite's setting; refused beyond the table's limit, naming the variable, before a model loads:
    Choices checks it), else the available cores (the reason says when OMP_NUM_THREADS was set but not used)."""
    if threads is not None:
        n = check_range("threads", threads, "Engine")
        return n, "asked for" + _beyond_cores(n)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isascii() and env.isdigit() and int(env) >= 1:  # ASCII: "²".isdigit() holds and int("²") fails
        n = check_range("threads", int(env), f"OMP_NUM_THREADS={env}", "the thread count")
        return n, f"default: OMP_NUM_THREADS={env} in the environment" + _beyond_cores(n)
    n = available_cores()
    ignored = f"; OMP_NUM_THREADS={env!r} is not one thread count, so not used" if env else ""
    return n, f"default: the {n} core(s) this process may use (its CPU affinity){ignored}"


def oversubscribed(n: int) -> str | None:
    """Why n threads are too many here (None: they are not): more than the cores this process may use, so the
    threads beyond them wait for a core at every parallel region and a step runs slower, not faster (77.7 s against
    5.4 s, 999 threads against 2, on a 2-core machine)."""
    cores = available_cores()
    if n <= cores:
        return None
    return (f"more than the {cores} core(s) this process may use: the threads beyond {cores} wait for a core at "
            f"every step, which makes it slower, not faster (use {cores} or fewer)")


def _beyond_cores(n: int) -> str:
    """The run plan's note on a count beyond the cores ("" when it is not)."""
    why = oversubscribed(n)
    return f"; {why}" if why else ""


def warn_oversubscribed(threads: int | None) -> None:
    """One warning when the count resolve_threads picks (asked for, or OMP_NUM_THREADS) exceeds the cores: legal,
    but slower (Choices calls it once per engine, before a model loads; `sicl-fast plan` says it too)."""
    import warnings

    from ..errors import SiclWarning

    n = resolve_threads(threads)[0]
    over = oversubscribed(n)
    if over is not None:
        source = f"threads {n}" if threads is not None else f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS'].strip()}"
        warnings.warn(f"{source}: {over}", SiclWarning, stacklevel=3)


def apply_threads(threads: int | None, cpp: bool = True) -> int:
    """Set torch's thread count, and the C++ ops' when `cpp` (a plan on other ops never touches the extension), to
    resolve_threads(threads); returns it."""
    import torch

    from ..ops import cpp_ops

    n = resolve_threads(threads)[0]
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if cpp and cpp_ops.available():
        cpp_ops.set_num_threads(n)
    return n


def decide_wait_policy(env: MutableMapping[str, str], openmp_started: bool) -> tuple[str, str]:
    """(policy, why), setting OMP_WAIT_POLICY=PASSIVE in `env` when the user set neither variable of WAIT_ENV and
    OpenMP has not started yet (module docstring)."""
    given = [f"{k}={env[k]}" for k in WAIT_ENV if env.get(k)]
    if given:
        asked = env.get("OMP_WAIT_POLICY", "")
        policy = asked.strip().lower() if asked else f"spin count {env['GOMP_SPINCOUNT']}"
        if asked and policy not in ("active", "passive"):  # libgomp warns and keeps its default
            return "libgomp default", (f"OMP_WAIT_POLICY={asked!r} is neither ACTIVE nor PASSIVE: libgomp ignores "
                                       "it, and threads spin a while at each barrier")
        return policy, f"the environment's: {', '.join(given)}"
    if openmp_started:
        return "libgomp default", ("OMP_WAIT_POLICY was unset and torch had started OpenMP before sicl_fast was "
                                   "imported: threads spin a while at each barrier; set OMP_WAIT_POLICY=PASSIVE "
                                   "before Python starts on a shared machine")
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "passive", ("set by sicl_fast (OMP_WAIT_POLICY was unset): waiting threads sleep instead of spinning, "
                       "which holds up beside other work; OMP_WAIT_POLICY=ACTIVE to spin")


def choose_wait_policy() -> tuple[str, str]:
    """The process's wait policy, decided at the first call (sicl_fast's import) and kept."""
    global _policy
    if _policy is None:
        _policy = decide_wait_policy(os.environ, "torch" in sys.modules)
    return _policy


__all__ = ["WAIT_ENV", "available_cores", "apply_threads", "oversubscribed", "warn_oversubscribed",
           "choose_wait_policy", "decide_wait_policy", "resolve_threads"]
