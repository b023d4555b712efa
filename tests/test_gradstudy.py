"""The estimator study (sicl_fast.diagnostics.gradstudy): the zeroth-order estimate's cosine with the exact gradient
rises with N (a statistical check with a stated error probability), the N-prefix property it relies on, the summary, and
the CLI end to end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import synthetic_prompt
from sicl_fast import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.errors import SiclError
from sicl_fast.diagnostics.gradstudy import StudySettings, markdown, study_point, study_prompt, summarize
from sicl_fast.step.rng import directions
from test_grad import VOCAB, tiny_llama16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(smol):
    return tiny_llama16(smol.tokenizer, 1, "tiny-llama-study")


def test_first_n_directions_do_not_depend_on_n():
    """A run with N directions draws exactly the first N of a run with more (counter = direction * R * d + ...):
    the study measures every N from one set of forwards."""
    big = directions(7, 3, 64, 5, 16)
    for n in (1, 4, 17):
        assert torch.equal(directions(7, 3, n, 5, 16), big[:n])


def test_cosine_with_exact_gradient_rises_with_N(llama):
    """Forward estimator, mu = 0.01 (embedding-scale units), D = R d = 5 x 16 = 80 coordinates, S = 2048 seeds.

    Per seed the cosine lies in [-1, 1]. Hoeffding: the mean of S such values is off its expectation by t with
    probability <= exp(-S t^2 / 2). So under "the cosine does not rise" (E cos_64 <= E cos_4) an observed gap
    >= 0.24 has probability <= 2 exp(-S 0.12^2 / 2) = 1.2e-6: the check below cannot pass by chance. It fails by
    chance only if the gap comes out below 0.24 while its expectation is the measured ~0.45 (isotropic theory for
    a linear f: sqrt(N / (N + D)), 0.22 at N = 4 and 0.67 at N = 64): probability <= 2 exp(-S 0.105^2 / 2) < 3e-5.
    """
    p = synthetic_prompt(10, ((5, 6), (7, 8)), 3, VOCAB, seed=2)  # rows [3, 8) move: R = 5
    be = make_backend("hf", llama, grad=True)
    cfg = CalibrationConfig(mu=0.01, scale=None)
    cal = Calibrator(be, cfg.replace(scale=be.lm.embedding_scale))
    X0 = cal.initial_embeddings(p)
    S = 2048
    settings = StudySettings(Ns=(4, 64), mus=(0.01,), estimators=("forward",), seeds=S, points=(0,), chunk=256)
    point, g_star = study_point(cal, p, X0, X0, 0, settings)
    assert g_star.shape == (5, 16) and float(g_star.norm()) > 0
    cos = {r["N"]: r["cosine_mean"] for r in point["zo"]}
    assert all(r["seeds"] == S for r in point["zo"])
    gap = cos[64] - cos[4]
    print(f"cosine: N=4 {cos[4]:.4f}, N=64 {cos[64]:.4f}, gap {gap:.4f}")
    assert gap >= 0.24, cos
    assert 0 < cos[4] < cos[64] < 1


def test_summary_and_walk(llama):
    """study_prompt walks the exact-gradient calibration (the proxy at the points rises), measures every cell;
    summarize pools per (estimator, mu, N); the exact step (along the gradient, short) raises the proxy."""
    p = synthetic_prompt(12, ((5, 7), (9, 11)), 3, VOCAB, seed=3)
    be = make_backend("fast-fp32", llama, grad=True)
    settings = StudySettings(Ns=(2, 8), mus=(0.004, 0.016), seeds=3, points=(0, 3))
    seen = []
    rec = study_prompt(be, p, CalibrationConfig(eta=0.05), settings, on_point=seen.append)
    assert seen == [0, 3] and [pt["step"] for pt in rec["points"]] == [0, 3]
    assert rec["points"][1]["proxy"] > rec["points"][0]["proxy"]
    assert rec["rows"] == 11 - 3 and rec["d"] == 16 and rec["L"] == 12
    for pt in rec["points"]:
        assert len(pt["zo"]) == 2 * 2 * 2  # estimators x mus x Ns
        for r in pt["zo"]:
            assert -1 <= r["cosine_mean"] <= 1 and 0 <= r["clip_share"] <= 1 and r["seeds"] == 3
    rows = summarize([json.loads(json.dumps(rec))])  # as read back from the JSONL
    assert [(r["estimator"], r["mu"], r["N"]) for r in rows][:4] == [
        ("forward", 0.004, 2), ("forward", 0.004, 8), ("forward", 0.016, 2), ("forward", 0.016, 8)]
    assert all(r["n"] == 2 for r in rows)
    mean_cos = {(r["estimator"], r["mu"], r["N"]): r["cosine"] for r in rows}
    want = sum(pt["zo"][0]["cosine_mean"] for pt in rec["points"]) / 2
    assert math.isclose(mean_cos[("forward", 0.004, 2)], want, rel_tol=1e-12)
    assert all(r["gain_exact"] > 0 for r in rows)
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| forward | 0.004 | 2 | 2 |" in table


def test_settings_are_checked():
    with pytest.raises(SiclError, match="points must be increasing"):
        StudySettings(points=(5, 0))
    with pytest.raises(SiclError, match="estimators must be among"):
        StudySettings(estimators=("grad",))
    with pytest.raises(SiclError, match="gradstudy: mu 0 must be > 0"):
        StudySettings(mus=(0.004, 0.0))
    with pytest.raises(SiclError, match="mus must be finite numbers"):
        StudySettings(mus=(math.nan,))


def test_a_mu_too_small_to_perturb_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """CalibrationConfig's rule for mu, for every --study-mu (before: 1e-45 loaded the model, then failed as
    'embeddings contain NaN or inf')."""
    from sicl_fast.commands.cli import main

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before --study-mu was checked")

    monkeypatch.setattr("sicl_fast.engine.load", no_model)
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "q", "demos": [{"input": "a", "output": "b"}], "query": "c"}) + "\n")
    assert main(["gradstudy", str(reqs), "--out", str(tmp_path / "o.jsonl"), "--study-mu", "0.004", "1e-45"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("gradstudy: mu 1e-45 must be >= 1e-06 (in units of the embedding scale): a smaller "
                        "perturbation is lost to the float32 rounding of the embeddings (relative precision "
                        "1.2e-07)") and "\n" not in err, err


@pytest.mark.slow
def test_gradstudy_command(tmp_path, capsys):
    """On the embedded SmolLM2 with a tiny grid: records, resume, the table, the report files."""
    pytest.importorskip("matplotlib")
    from sicl_fast.commands.cli import main

    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "digits", "demos": [{"input": "one", "output": "1"},
                                                           {"input": "seven", "output": "7"}], "query": "five"}) + "\n")
    out, rep = tmp_path / "study.jsonl", tmp_path / "rep"
    args = ["gradstudy", str(reqs), "--out", str(out), "--study-N", "2", "4", "--study-mu", "0.004", "--seeds", "2",
            "--points", "0", "1", "--report", str(rep)]
    assert main(args) == 0
    table = capsys.readouterr().out
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["id"] == "digits" and len(recs[0]["points"]) == 2
    assert "| central | 0.004 | 4 | 2 |" in table
    assert (rep / "study.md").read_text().count("| forward |") == 2
    assert (rep / "plots" / "cosine_vs_N.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(args) == 0
    assert "nothing to do: all 1 requests are already in" in capsys.readouterr().err  # before the model loads
    assert out.read_text().count("\n") == 1
    assert main(["gradstudy", str(reqs), "--out", "-"]) == 2
    assert "give a regular file" in capsys.readouterr().err


def test_a_damaged_study_record_is_moved_aside_not_an_internal_error(tmp_path):
    """Issue 54 item 4: gradstudy's table read every record of --out as study_prompt writes it, so a hand-edited one
    (points a string, a cosine a string, an N a list, a point without its exact step) was an internal error of every
    later run; study_key, the results file's key, moves it aside and the prompt is studied again."""
    from sicl_fast.diagnostics.gradstudy import study_key
    from sicl_fast.formats.records import ResultWriter

    zo = {"estimator": "forward", "mu": 0.004, "N": 2, "seeds": 1, "cosine_mean": 0.1, "cosine_std": 0.0,
          "norm_ratio": 3.0, "clip_share": 0.0, "gain_mean": 1e-6, "gain_std": 0.0}
    good = {"id": "a", "L": 9, "rows": 4, "d": 16, "scale": 0.2,
            "points": [{"step": 0, "proxy": 0.1, "exact": {"gain": 2e-6, "clip_share": 0.0, "norm": 0.1}, "zo": [zo]}]}
    point = good["points"][0]
    bad = [{**good, "id": "b", "points": "x"}, {**good, "id": "c", "points": [{**point, "zo": [{**zo, "N": [2]}]}]},
           {**good, "id": "d", "points": [{k: v for k, v in point.items() if k != "exact"}]},
           {**good, "id": "e", "points": [{**point, "zo": [{**zo, "cosine_mean": "0.5"}]}]},
           {**good, "id": "f", "points": [{**point, "zo": [{**zo, "estimator": "backward"}]}]}]
    path = tmp_path / "study.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, *bad]))
    with pytest.warns(UserWarning, match=f"{len(bad)} unreadable line"), ResultWriter(path, key=study_key) as out:
        assert out.done == {"a"}
    assert summarize([json.loads(line) for line in path.read_text().splitlines()])[0]["N"] == 2
