"""The range of every numeric knob, in one table: the CLI's argument types, CalibrationConfig, the Engine, the Ray
pool and the server's caps all check against it, so a value is refused with the same limit wherever it comes in,
before a model is loaded.

    check_range("max_steps", v, "CalibrationConfig")    -> v, or SiclError "CalibrationConfig: max_steps must be ..."
    check_mu(mu, "CalibrationConfig")                   -> mu, or SiclError when float32 cannot perturb by it
    arg_type("max_steps")                               an argparse type that refuses while parsing

An upper bound is what the step can use: a buffer that grows with the knob (the history: one value a step), a
loop that runs the knob's count between two checks (sync_every), the noise generator's 32-bit key (seed).
"""
from __future__ import annotations

import argparse
import numbers
from dataclasses import dataclass

from ..errors import SiclError

MAX_STEPS = 1_000_000  # the history keeps one float a step; a million steps is weeks of calibration on a CPU
F32_EPS = 2.0**-23  # float32's relative precision (1.2e-7)
F32_TINY = 2.0**-126  # float32's smallest normal number (1.2e-38)
F32_MAX = (2 - 2.0**-23) * 2.0**127  # float32's largest number (3.4e38)
# mu is in units of the embedding scale, so X + mu U moves an entry of typical size by about mu of itself: below
# ~10 float32 ulps (1e-6) the finite differences are rounding noise, and below one ulp X + mu U == X
MIN_MU = 1e-6
MAX_BUDGET_S = 30 * 24 * 3600.0  # a calibration's time budget, in seconds


@dataclass(frozen=True)
class Range:
    """[lo, hi] (hi None: unbounded); integer: only whole numbers; why: said with the upper limit."""

    lo: float
    hi: float | None
    integer: bool = True
    why: str = ""

    def problem(self, value) -> str | None:
        """What is wrong with `value` (one phrase), or None."""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                return f"must be an integer, got {value!r}"
        elif isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
            return f"must be a number, got {value!r}"
        if value < self.lo:
            return f"must be >= {self.lo}, got {value}"
        if self.hi is not None and value > self.hi:
            why = f" ({self.why})" if self.why else ""
            return f"must be <= {self.hi}{why}, got {value}"
        return None


RANGES: dict[str, Range] = {
    # the ascent (CalibrationConfig)
    "N": Range(1, 65_536, why="directions per step; each is one more forward row, and the paper uses 8-16"),
    "max_steps": Range(1, MAX_STEPS, why="the history keeps one value a step"),
    "patience": Range(0, MAX_STEPS, why="the largest max_steps; 0 turns early stopping off"),
    "seed": Range(0, 2**32 - 1, why="the noise generator's key is 32 bits"),
    "min_delta": Range(0.0, 1.0, integer=False, why="the proxy lies in [0, 1]"),
    "min_delta_rel": Range(0.0, 1.0, integer=False, why="a fraction of the last counted proxy; 1 asks a step to "
                                                           "double it"),
    # how the engine runs it
    "sync_every": Range(1, MAX_STEPS, why="the largest max_steps"),
    "pack": Range(1, 1024, why="prompts calibrated at once"),
    "graph_cache": Range(1, 1024, why="captured shapes kept, each with its graph's memory"),
    "length_buckets": Range(1, 64, why="length buckets a doubling (a power of two); 64 pads at most 1.6 %"),
    "max_new_tokens": Range(0, 1 << 20, why="tokens to generate"),
    "port": Range(0, 65_535, why="a TCP port; 0 takes a free one"),
    "store_mib": Range(0, 1 << 30, why="MiB of memory for the calibration store"),
    "time_budget_s": Range(0.0, MAX_BUDGET_S, integer=False, why="30 days; 0 runs one step"),
    "threads": Range(1, 4096, why="threads of one process (torch's and the C++ ops')"),
    # a Ray pool
    "workers": Range(1, 4096, why="engine actors"),
    "cpus_per_worker": Range(1, 4096, why="CPUs of one actor"),
    "gpus_per_worker": Range(0, 64, integer=False, why="GPUs of one actor"),
    "max_retries": Range(0, 100, why="retries of one request after its worker died"),
    # the commands' own counts
    "limit": Range(1, 10**9, why="samples per task"),
    "repeats": Range(1, 10_000, why="timed calls"),
    "length": Range(1, 1 << 20, why="tokens"),
    "profile_length": Range(8, 1 << 20, why="tokens"),
    "prefix": Range(0, 1 << 20, why="tokens"),
    "calibration_steps": Range(0, MAX_STEPS, why="the largest max_steps"),
    "seeds": Range(1, 10_000, why="seeds per cell"),
    "points": Range(0, MAX_STEPS, why="the largest max_steps"),
    "chunk": Range(1, 65_536, why="forward rows per batch"),
    "demo_orders": Range(1, 100_000, why="candidate orders"),
    "demo_top_k": Range(1, 100_000, why="orders kept"),
    "check_budget_s": Range(1.0, 24 * 3600.0, integer=False, why="a day; bench/gpu_check.py is sized for 9 minutes"),
}


def check_range(name: str, value, where: str, label: str | None = None):
    """`value` if it lies in RANGES[name], else SiclError "{where}: {label or name} must be ..."."""
    problem = RANGES[name].problem(value)
    if problem is not None:
        raise SiclError(f"{where}: {label or name} {problem}")
    return value


def check_mu(mu: float, where: str, label: str = "mu") -> float:
    """A smoothing radius mu (embedding-scale units, finite) large enough for float32 to perturb: > 0 and >= MIN_MU,
    else SiclError "{where}: {label} must be ...". The one rule for CalibrationConfig's mu and gradstudy's radii."""
    if mu <= 0:
        raise SiclError(f"{where}: {label} must be > 0")
    if mu < MIN_MU:
        raise SiclError(f"{where}: {label} must be >= {MIN_MU:g} (in units of the embedding scale): a smaller "
                        f"perturbation is lost to the float32 rounding of the embeddings (relative precision "
                        f"{F32_EPS:.1e})")
    return mu


def arg_type(name: str, auto: bool = False, words: tuple = ()):
    """An argparse type for the knob `name`: the text as an integer (or number) within its range, refused while
    parsing (argparse prints "argument --flag: must be ..." and exits 2); auto: the word 'auto' too, as it is;
    words: other words taken as they are."""
    rng = RANGES[name]
    literal = (("auto",) if auto else ()) + tuple(words)

    def conv(text: str):
        if text in literal:
            return text
        try:
            value = int(text) if rng.integer else float(text)
        except ValueError:  # the words the flag takes named with the number (--length-buckets on)
            kinds = [repr(w) for w in literal] + ["an integer" if rng.integer else "a number"]
            either = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
            raise argparse.ArgumentTypeError(f"must be {either}, got {text!r}") from None
        problem = rng.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    conv.__name__ = name
    return conv


__all__ = ["RANGES", "Range", "MAX_STEPS", "MIN_MU", "F32_EPS", "F32_TINY", "F32_MAX", "MAX_BUDGET_S", "check_range",
           "check_mu", "arg_type"]
