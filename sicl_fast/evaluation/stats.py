"""The report's significance tests, written from their textbook definitions (scipy only for special functions).

* mcnemar_exact(base, method): one-sided exact McNemar test, H1: the method is right more often than the base.
  b = #(base wrong, method right), c = #(base right, method wrong); p = P(X >= b), X ~ Binomial(b + c, 1/2);
  p = 1 when b + c = 0 (no discordant pair: no evidence either way).
* spearman_one_sided(x, y): Spearman's rho (Pearson correlation of average ranks, ties averaged) and the
  one-sided p-value for H1: rho > 0 from the t approximation t = rho sqrt((n-2) / (1 - rho^2)), df = n - 2
  (scipy.stats.spearmanr's default); also the exact permutation p-value for n <= EXACT_MAX_N (with 3-12 tasks
  the t approximation is rough: rho = 1 with n = 3 gives p = 0 there, 1/6 exactly).
* fisher_combined(ps): Fisher's method, X = -2 sum ln p_i ~ chi^2 with 2k degrees of freedom under H0.

NaN marks an undefined statistic (constant input, fewer than 3 points); callers report it as "n/a".
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from collections.abc import Sequence

import numpy as np

from ..errors import SiclError, require

EXACT_MAX_N = 8  # 8! = 40320 permutations


@dataclass(frozen=True)
class McNemar:
    b: int  # base wrong, method right
    c: int  # base right, method wrong
    n: int  # discordant pairs b + c
    p: float  # one-sided exact p-value, H1: method > base

    def to_dict(self) -> dict:
        return asdict(self)


def binom_upper_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly (rational arithmetic, then one rounding)."""
    if n < 0 or k > n + 1:
        raise SiclError(f"bad binomial tail arguments k={k}, n={n}")
    if k <= 0:
        return 1.0
    total = sum(math.comb(n, i) for i in range(k, n + 1))
    return float(Fraction(total, 2**n))


def discordant(base: Sequence[bool], method: Sequence[bool]) -> tuple[int, int]:
    if len(base) != len(method):
        raise SiclError(f"paired outcomes of different lengths: {len(base)} and {len(method)}")
    b = sum(1 for x, y in zip(base, method) if not x and y)
    c = sum(1 for x, y in zip(base, method) if x and not y)
    return b, c


def mcnemar_exact(base: Sequence[bool], method: Sequence[bool]) -> McNemar:
    """One-sided exact McNemar test on paired correct/incorrect outcomes (H1: method better than base)."""
    b, c = discordant(base, method)
    n = b + c
    return McNemar(b=b, c=c, n=n, p=binom_upper_tail(b, n) if n else 1.0)


def rankdata(values: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties get the mean of the ranks they span."""
    a = np.asarray(values, dtype=float)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=float)
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    if den == 0.0:
        return math.nan
    return max(-1.0, min(1.0, float((dx * dy).sum()) / den))


def student_t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom (regularised incomplete beta)."""
    require("scipy")
    from scipy.special import betainc

    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * float(betainc(df / 2.0, 0.5, df / (df + t * t)))
    return tail if t >= 0 else 1.0 - tail


@dataclass(frozen=True)
class Spearman:
    n: int
    rho: float
    p: float  # one-sided (H1: rho > 0), t approximation as scipy.stats.spearmanr
    p_exact: float | None  # one-sided permutation p-value, n <= EXACT_MAX_N; None beyond

    def to_dict(self) -> dict:
        return asdict(self)


def spearman_one_sided(x: Sequence[float], y: Sequence[float]) -> Spearman:
    """Spearman's rho of (x, y) and one-sided p-values for H1: positive association."""
    if len(x) != len(y):
        raise SiclError(f"x and y differ in length: {len(x)} and {len(y)}")
    n = len(x)
    if n < 2:
        return Spearman(n=n, rho=math.nan, p=math.nan, p_exact=None)
    rx, ry = rankdata(x), rankdata(y)
    rho = _pearson(rx, ry)
    if math.isnan(rho) or n < 3:
        return Spearman(n=n, rho=rho, p=math.nan, p_exact=None)
    df = n - 2
    if abs(rho) >= 1.0:
        t = math.copysign(math.inf, rho)
    else:
        t = rho * math.sqrt(df / ((1.0 - rho) * (1.0 + rho)))
    p_exact = None
    if n <= EXACT_MAX_N:
        # exact null distribution: every assignment of y's ranks to x's ranks is equally likely
        ge = total = 0
        for perm in itertools.permutations(range(n)):
            r = _pearson(rx, ry[list(perm)])
            total += 1
            ge += r >= rho - 1e-12
        p_exact = ge / total
    return Spearman(n=n, rho=rho, p=student_t_sf(t, df), p_exact=p_exact)


@dataclass(frozen=True)
class Fisher:
    k: int  # p-values combined
    statistic: float  # -2 sum ln p
    p: float

    def to_dict(self) -> dict:
        return asdict(self)


def chi2_sf_even(x: float, dof: int) -> float:
    """P(X > x) for chi^2 with an even number of degrees of freedom 2k: exp(-x/2) sum_{i<k} (x/2)^i / i!."""
    if dof <= 0 or dof % 2:
        raise SiclError(f"dof must be a positive even number, got {dof}")
    if math.isinf(x):
        return 0.0
    h = x / 2.0
    term, total = 1.0, 1.0
    for i in range(1, dof // 2):
        term *= h / i
        total += term
    return min(1.0, math.exp(-h) * total)


def fisher_combined(pvalues: Sequence[float]) -> Fisher:
    """Fisher's combined test of independent p-values (NaN entries must be dropped by the caller)."""
    ps = [float(p) for p in pvalues]
    if not ps:
        return Fisher(k=0, statistic=math.nan, p=math.nan)
    if any(not 0.0 <= p <= 1.0 for p in ps):
        raise SiclError(f"p-values must lie in [0, 1], got {ps}")
    stat = -2.0 * sum(math.log(p) if p > 0 else -math.inf for p in ps)
    return Fisher(k=len(ps), statistic=stat, p=chi2_sf_even(stat, 2 * len(ps)))


def least_squares(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """(slope, intercept) of the least-squares line y = a x + b; None when x has fewer than 2 distinct values."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 2 or float(np.ptp(xa)) == 0.0:
        return None
    dx = xa - xa.mean()
    slope = float((dx * (ya - ya.mean())).sum() / (dx * dx).sum())
    return slope, float(ya.mean() - slope * xa.mean())


__all__ = [
    "McNemar", "Spearman", "Fisher", "mcnemar_exact", "discordant", "binom_upper_tail", "rankdata",
    "spearman_one_sided", "student_t_sf", "fisher_combined", "chi2_sf_even", "least_squares", "EXACT_MAX_N",
]
