"""The classification baselines on the real SmolLM2: label scoring against a plain forward, CC and DC-PMI on
hand-made prompts whose right answer is known, DEmO's selection rule, and the runner on ICLEval-format files."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sicl_fast.engine import Engine
from sicl_fast.evaluation import icleval_cls as C
from sicl_fast.evaluation.baselines import (calibrate_probs, candidate_orders, contextual_calibration, dc_pmi,
                                            demo_select, entropy, kl)
from sicl_fast.evaluation.label_scoring import LabelScorer
from sicl_fast.evaluation.methods import BaselineOptions, run_methods
from sicl_fast.icleval import score
from sicl_fast.icleval.loader import load_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::sicl_fast.icleval.ICLEvalDataWarning")]

FIXTURES = Path(__file__).parent / "fixtures" / "icleval" / "data"

# A sentiment prompt whose demonstrations are all positive: a planted majority-label bias.
BIASED = "".join(f"Review: {r}\nSentiment: positive\n\n"
                 for r in ["great film", "I loved it", "wonderful", "superb acting", "a delight", "fun"])
LABELS = [" positive", " negative"]
CF = [BIASED + f"Review: {cf}\nSentiment:" for cf in ("N/A", "", "[MASK]")]
QUERIES = {"awful movie": 1, "terrible": 1, "nice": 0}  # index of the right label


@pytest.fixture(scope="module")
def scorer(smol):
    return LabelScorer(smol)


def _naive_logprob(lm, context: str, continuation: str) -> float:
    a = list(lm.tokenizer(context)["input_ids"])
    b = list(lm.tokenizer(continuation, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        lp = torch.log_softmax(lm.model(input_ids=torch.tensor([a + b])).logits[0].float(), dim=-1)
    return sum(float(lp[len(a) - 1 + i, t]) for i, t in enumerate(b))


def test_label_scores_match_a_plain_forward(smol):
    sc = LabelScorer(smol)
    conts = [" True", " False", " jsonl", " yaml file"]  # one- and multi-token continuations
    ctx1 = "Input: a, b, a\nOutput: True\n\nInput: x, y\nOutput:"
    ctx2 = "Input: a, b, a\nOutput: True\n\nInput: N/A\nOutput:"  # shares a prefix with ctx1
    s1 = sc.score(ctx1, conts)
    run1 = sc.tokens_run
    s2 = sc.score(ctx2, conts)
    assert sc.tokens_run - run1 < len(sc.encode_context(ctx2))  # the shared prefix was not run again
    for ctx, s in ((ctx1, s1), (ctx2, s2)):
        ref = [_naive_logprob(smol, ctx, c) for c in conts]
        np.testing.assert_allclose(s, ref, atol=2e-4)
    p = sc.distribution(ctx1, conts)
    assert p.sum() == pytest.approx(1.0) and np.argmax(p) == np.argmax(s1)


def test_contextual_calibration_removes_a_planted_label_bias(scorer):
    res = {q: contextual_calibration(scorer, BIASED + f"Review: {q}\nSentiment:", CF, LABELS) for q in QUERIES}
    p_cf = res["nice"].p_cf
    assert p_cf[0] > 0.65  # content-free inputs: the planted bias toward " positive"
    # the correction itself: the content-free distribution maps to uniform
    np.testing.assert_allclose(calibrate_probs(p_cf, p_cf), [0.5, 0.5], atol=1e-12)
    for _q, r in res.items():
        np.testing.assert_allclose(r.q, np.exp(r.p / p_cf) / np.exp(r.p / p_cf).sum(), atol=1e-12)  # softmax(Wp)
        assert r.pred == int(np.argmax(r.p / p_cf))
    # uncalibrated: every review is "positive"; calibrated: the bias is gone and the answers are right
    assert [r.pred_uncalibrated for r in res.values()] == [0, 0, 0]
    assert {q: r.pred for q, r in res.items()} == QUERIES
    mean_p = np.mean([r.p[0] for r in res.values()])
    mean_q = np.mean([r.q[0] for r in res.values()])
    assert abs(mean_q - 0.5) < abs(mean_p - 0.5)


def test_dc_pmi_prefers_the_label_rare_in_the_domain_premise(scorer):
    premise = BIASED + "Sentiment:"  # a domain premise where " positive" is common and " negative" rare
    dom = scorer.score(premise, LABELS)
    assert dom[0] > dom[1] + 1.0
    for q, _right in QUERIES.items():
        r = dc_pmi(scorer, BIASED + f"Review: {q}\nSentiment:", premise, LABELS)
        np.testing.assert_allclose(r.scores, scorer.score(BIASED + f"Review: {q}\nSentiment:", LABELS) - dom)
        assert r.pred == int(np.argmax(r.scores))
        # the rare label gains log p(pos|premise) - log p(neg|premise) over the plain scores
        assert (r.scores[1] - r.scores[0]) - (r.logp[1] - r.logp[0]) == pytest.approx(dom[0] - dom[1])
    flips = [q for q in QUERIES if dc_pmi(scorer, BIASED + f"Review: {q}\nSentiment:", premise, LABELS).pred == 1]
    assert "awful movie" in flips and "terrible" in flips  # plain scoring says "positive" for both


def test_demo_selection_follows_its_definition(scorer):
    demos = ["Review: great film\nSentiment: positive\n\n", "Review: dull plot\nSentiment: negative\n\n",
             "Review: I loved it\nSentiment: positive\n\n"]
    query = "Review: awful movie\nSentiment:"
    cfs = ("N/A", "")

    def build(order, cf):
        return "".join(demos[i] for i in order) + (query if cf is None else f"Review: {cf}\nSentiment:")

    assert candidate_orders(3, 24) [0] == (0, 1, 2) and len(candidate_orders(3, 24)) == 6
    assert len(set(candidate_orders(8, 5, seed=1))) == 5
    full = demo_select(scorer, build, 3, LABELS, cfs, query, num_orders=24, top_k=6)
    fair = [entropy(np.mean([scorer.distribution(build(o, c), LABELS) for c in cfs], axis=0)) for o in full.orders]
    assert full.fairness == pytest.approx(fair)
    p0 = scorer.distribution(query, LABELS)  # zero-shot reference
    infl = [kl(scorer.distribution(build(o, None), LABELS), p0) for o in full.orders]
    assert full.chosen == int(np.argmax(infl))  # top_k = all: the most influential order overall
    one = demo_select(scorer, build, 3, LABELS, cfs, query, num_orders=24, top_k=1)
    assert one.chosen == int(np.argmax(fair))  # top_k = 1: the fairest order
    two = demo_select(scorer, build, 3, LABELS, cfs, query, num_orders=24, top_k=2)
    kept = sorted(range(6), key=lambda i: -fair[i])[:2]
    assert sorted(two.candidates) == sorted(kept) and two.chosen == max(kept, key=lambda i: infl[i])
    assert two.pred == int(np.argmax(scorer.distribution(build(two.order, None), LABELS)))


def test_baseline_methods_on_classification_files(smol, tmp_path):
    eng = Engine(smol, add_special_tokens=True)
    out = tmp_path / "cls.jsonl"
    opts = BaselineOptions(demo_orders=3, demo_top_k=2)
    recs = run_methods(eng, FIXTURES, out, methods=["base", "cc", "dcpmi", "demo"],
                       tasks=["classifier_duplication", "classifier_format"], limit=2, options=opts, progress=False)
    samples = {s.key: s for name, ss in load_dir(FIXTURES, ["classifier_duplication", "classifier_format"],
                                                 check_sha256=False).items() for s in ss[:2]}
    assert len(recs) == 4 * 4
    base = {}
    for r in recs:
        s = samples[(r["task"], r["uid"])]
        for k in ("task", "uid", "label", "answer_base", "answer_calibrated", "correct_base", "correct_calibrated",
                  "initial_proxy", "best_proxy", "steps", "gated", "seconds", "history", "method", "variant"):
            assert k in r
        assert r["correct_base"] == score(s, r["answer_base"])
        assert r["correct_calibrated"] == score(s, r["answer_calibrated"])
        base.setdefault(s.key, r["answer_base"])
        assert r["answer_base"] == base[s.key]  # decoded once, shared by every method
        if r["method"] != "base":
            assert r["answer_calibrated"] in C.labels_for(s)
            assert r["labels"] == list(C.labels_for(s))
        if r["method"] == "cc":
            p, pcf = np.array(r["probs"]), np.array(r["probs_content_free"])
            assert r["answer_calibrated"] == r["labels"][int(np.argmax(p / pcf))]
        if r["method"] == "dcpmi":
            assert r["answer_calibrated"] == r["labels"][int(np.argmax(np.array(r["logp"]) - r["logp_domain"]))]
        if r["method"] == "demo":
            assert sorted(r["order"]) == list(range(s.spec.demos)) and r["orders_evaluated"] == 3
            assert math.isfinite(r["influence"]) and len(r["candidates"]) == 2
    # the label-scoring passes of the three baselines agree on the uncalibrated argmax
    for key in samples:
        sb = {r["answer_scored_base"] for r in recs if (r["task"], r["uid"]) == key and r["method"] != "base"}
        assert len(sb) == 1


def test_demo_can_decode_with_the_chosen_order(smol, tmp_path):
    eng = Engine(smol, add_special_tokens=True)
    opts = BaselineOptions(demo_orders=2, demo_top_k=1, demo_predict="generate")
    (r,) = run_methods(eng, FIXTURES, tmp_path / "demo.jsonl", methods=["demo"], tasks=["classifier_duplication"],
                       limit=1, options=opts, progress=False)
    s = load_dir(FIXTURES, ["classifier_duplication"], check_sha256=False)["classifier_duplication"][0]
    assert r["answer_calibrated"] == r["answer_generated"] and r["correct_calibrated"] == score(
        s, r["answer_generated"]
    )
    assert r["config"]["demo_predict"] == "generate" and r["answer_scored"] in ("True", "False")
