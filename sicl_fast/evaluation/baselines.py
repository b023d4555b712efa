"""The classification baselines the paper compares with, on plain texts (any prompt format, any model).

Every method scores a fixed label set with a `LabelScorer` (sum of the token log-probabilities of " label" after
the context) and predicts one label.

* Contextual Calibration (Zhao et al. 2021, "Calibrate Before Use"). p = the label probabilities for the real
  input, renormalised over the labels; p_cf = the mean of the same renormalised distributions with content-free
  inputs ("N/A", "", "[MASK]") in place of the input; W = diag(p_cf)^-1, b = 0; q = softmax(W p + b);
  prediction argmax q (= argmax p_k / p_cf_k).
* Domain-conditional PMI (Holtzman et al. 2021, "Surface Form Competition"). score(y) = log p(y | prompt) -
  log p(y | domain premise), unnormalised log-probabilities; prediction argmax. The premise is a text that only
  sets up the answer domain (the ICLEval adapter uses the answer delimiter "Output:" by default).
* DEmO (Guo et al. 2024, "What Makes a Good Order of Examples in In-Context Learning"): choose the order of the
  demonstrations per test input, without data. Stage 1 (corpus level, label fairness): over the candidate orders,
  the content-free label distribution p_cf(pi) (the mean over the content-free inputs) is computed and the `top_k`
  orders with the highest entropy H(p_cf(pi)) (the most balanced) are kept. Stage 2 (instance level, influence):
  among those, the order whose demonstrations most change the model's label distribution for this input is chosen,
  influence(pi, x) = KL(p(. | pi, x) || p(. | x)), with p(. | x) the zero-shot distribution (no demonstrations);
  prediction argmax p(. | pi*, x).
  Simplifications (documented, see README of the evaluation package): with n demonstrations there are n! orders;
  when n! > `num_orders` we evaluate the original order plus `num_orders - 1` distinct random permutations (seeded)
  instead of all of them; the content-free inputs are Zhao et al.'s three; the entropy and the KL are over the
  label set renormalised; the influence reference is the zero-shot distribution ("zeroshot") or, optionally, the
  content-free distribution of the same order ("content_free").
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import SiclError

from .label_scoring import LabelScorer, normalise


def softmax(z: np.ndarray) -> np.ndarray:
    return normalise(np.asarray(z, dtype=float))


def entropy(p: np.ndarray) -> float:
    p = np.asarray(p, dtype=float)
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats (q is floored at 1e-300 so that a zero never yields inf from rounding)."""
    p, q = np.asarray(p, dtype=float), np.asarray(q, dtype=float)
    m = p > 0
    return float((p[m] * (np.log(p[m]) - np.log(np.maximum(q[m], 1e-300)))).sum())


# -----------------------------------------------------------------------------------------------------------------
# Contextual Calibration


@dataclass
class CCResult:
    p: np.ndarray  # label probabilities for the real input, renormalised over the labels
    p_cf: np.ndarray  # mean content-free distribution
    q: np.ndarray  # calibrated: softmax(diag(p_cf)^-1 p)
    pred: int
    pred_uncalibrated: int


def calibrate_probs(p: np.ndarray, p_cf: np.ndarray) -> np.ndarray:
    """Zhao et al.'s correction: W = diag(p_cf)^-1, b = 0, q = softmax(W p + b)."""
    return softmax(np.asarray(p, dtype=float) / np.asarray(p_cf, dtype=float))


def content_free_distribution(
    scorer: LabelScorer, cf_contexts: Sequence[str], continuations: Sequence[str]
) -> np.ndarray:
    if not cf_contexts:
        raise SiclError("contextual calibration needs at least one content-free input")
    return np.mean([scorer.distribution(c, continuations) for c in cf_contexts], axis=0)


def contextual_calibration(
    scorer: LabelScorer, context: str, cf_contexts: Sequence[str], continuations: Sequence[str]
) -> CCResult:
    """Predict with CC. `cf_contexts`: the same prompt with each content-free input in place of the real input."""
    p = scorer.distribution(context, continuations)
    p_cf = content_free_distribution(scorer, cf_contexts, continuations)
    q = calibrate_probs(p, p_cf)
    return CCResult(p=p, p_cf=p_cf, q=q, pred=int(np.argmax(q)), pred_uncalibrated=int(np.argmax(p)))


# -----------------------------------------------------------------------------------------------------------------
# Domain-conditional PMI


@dataclass
class PMIResult:
    logp: np.ndarray  # log p(y | prompt)
    logp_domain: np.ndarray  # log p(y | domain premise)
    scores: np.ndarray  # logp - logp_domain
    pred: int
    pred_uncalibrated: int


def dc_pmi(scorer: LabelScorer, context: str, premise: str, continuations: Sequence[str]) -> PMIResult:
    """argmax_y log p(y | context) - log p(y | premise)."""
    lp = scorer.score(context, continuations)
    ld = scorer.score(premise, continuations)
    s = lp - ld
    return PMIResult(logp=lp, logp_domain=ld, scores=s, pred=int(np.argmax(s)), pred_uncalibrated=int(np.argmax(lp)))


# -----------------------------------------------------------------------------------------------------------------
# DEmO


@dataclass
class DEmOResult:
    orders: list[tuple[int, ...]]  # candidate orders evaluated (the original order first)
    fairness: list[float]  # entropy of each candidate's content-free label distribution
    candidates: list[int]  # indices (into orders) kept by stage 1, fairest first
    influence: dict[int, float]  # stage 2: influence of each kept order on this input
    chosen: int  # index into orders
    p: np.ndarray  # label distribution with the chosen order
    pred: int
    p_cf: list[list[float]] = field(default_factory=list)  # content-free distribution per candidate order
    p_orders: list[list[float]] = field(default_factory=list)  # label distribution of the input per candidate order

    @property
    def order(self) -> tuple[int, ...]:
        return self.orders[self.chosen]


def candidate_orders(n: int, num_orders: int, seed: int | str = 0) -> list[tuple[int, ...]]:
    """All n! orders when n! <= num_orders; else the original order and num_orders-1 distinct random ones."""
    if n < 1 or num_orders < 1:
        raise SiclError(f"need n >= 1 demonstrations and num_orders >= 1, got {n}, {num_orders}")
    ident = tuple(range(n))
    if math.factorial(n) <= num_orders:
        perms = list(itertools.permutations(range(n)))
        return [ident] + [p for p in perms if p != ident]
    rng = random.Random(f"demo-orders:{seed}")
    out, seen = [ident], {ident}
    while len(out) < num_orders:
        p = list(range(n))
        rng.shuffle(p)
        t = tuple(p)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def demo_select(
    scorer: LabelScorer,
    build: Callable[[tuple[int, ...], str | None], str],
    n_demos: int,
    continuations: Sequence[str],
    cf_inputs: Sequence[str],
    zero_shot: str,
    num_orders: int = 24,
    top_k: int = 4,
    seed: int | str = 0,
    influence_reference: str = "zeroshot",
) -> DEmOResult:
    """DEmO for one test input.

    build(order, cf): the scoring context with the demonstrations in `order` and the real input (cf=None) or the
    content-free input `cf` in place of it. zero_shot: the context without demonstrations (the reference of the
    influence when influence_reference="zeroshot").
    """
    if influence_reference not in ("zeroshot", "content_free"):
        raise SiclError(f"influence_reference must be 'zeroshot' or 'content_free', got {influence_reference!r}")
    orders = candidate_orders(n_demos, num_orders, seed)
    fairness, p_cf, p_x = [], [], []
    for order in orders:
        # the real input right after the content-free ones: they share the ordered demonstrations (prefix cache)
        cf = content_free_distribution(scorer, [build(order, c) for c in cf_inputs], continuations)
        p_cf.append(cf)
        fairness.append(entropy(cf))
        p_x.append(scorer.distribution(build(order, None), continuations))
    k = max(1, min(top_k, len(orders)))
    kept = sorted(range(len(orders)), key=lambda i: (-fairness[i], i))[:k]
    ref0 = scorer.distribution(zero_shot, continuations) if influence_reference == "zeroshot" else None
    influence = {i: kl(p_x[i], ref0 if ref0 is not None else p_cf[i]) for i in kept}
    chosen = max(kept, key=lambda i: (influence[i], -kept.index(i)))
    return DEmOResult(orders=orders, fairness=fairness, candidates=kept, influence=influence, chosen=chosen,
                      p=p_x[chosen], pred=int(np.argmax(p_x[chosen])), p_cf=[list(map(float, c)) for c in p_cf],
                      p_orders=[list(map(float, c)) for c in p_x])


__all__ = [
    "CCResult", "PMIResult", "DEmOResult", "calibrate_probs", "content_free_distribution", "contextual_calibration",
    "dc_pmi", "demo_select", "candidate_orders", "entropy", "kl", "softmax",
]
