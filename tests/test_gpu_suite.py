"""bench/gpu_suite.py on the CPU: its smoke mode runs end to end in a subprocess, as the GPU run will, and writes
rows that compare like with like.

The smoke models are bf16, as on the GPU, so the rows' proxies of the same prompt agree only to bf16 rounding:
measured gaps to the naive row are up to 7 % (fast eager, Gemma 2 at 32 tokens; the smoke's random logits vary by
several nats, which bf16 rounds at ~0.03 each), against 1e-6 with --dtype float32. F0_RTOL = 0.1 allows that; the
prompts of two lengths of one model give proxies 20-40x apart, so a row that read another prompt's (or another
position's) log-probabilities would fail it."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
F0_RTOL = 0.1
# the smoke grid (gpu_suite.make_plan): models x lengths, N = 2
CELLS = [(m, L, 2) for m in ("smollm2-135m", "gemma-2-2b") for L in (32, 48)]
CPU_ROWS = ("naive", "hf", "fast eager")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(returncode, stdout + stderr, JSON, Markdown) of one smoke run; the environment passes through
    (TRITON_INTERPRET=1 from conftest on a machine without a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("the smoke check is the CPU run; on a GPU run bench/gpu_suite.py itself")
    tmp = tmp_path_factory.mktemp("gpu_suite")
    out, md = tmp / "suite.json", tmp / "suite.md"
    md.write_text("# earlier results\n")  # the section is appended, not written over
    cmd = [sys.executable, "bench/gpu_suite.py", "--smoke", "--out", str(out), "--results", str(md),
           "--budget-s", "600"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, data, md.read_text()


def test_exits_cleanly_without_errors(smoke):
    rc, log, data, _ = smoke
    assert rc == 0, log[-4000:]
    assert data is not None
    assert data["errors"] == [] and data["skipped"] == []
    assert data["meta"]["smoke"] is True and data["meta"]["device"] == "cpu"


def test_every_cpu_row_ran_and_the_cuda_rows_say_why_not(smoke):
    rows = smoke[2]["steps"]
    for model, L, N in CELLS:
        cell = {r["variant"]: r for r in rows if (r["model"], r["L"], r["N"]) == (model, L, N)}
        assert set(cell) == {"naive", "hf", "fast eager", "fast graphs", "anchor"}, (model, L)
        for v in CPU_ROWS:
            r = cell[v]
            assert r["status"] == "ok", (model, L, v, r.get("note"))
            assert positive(r["ms"]) and positive(r["first_s"]) and positive(r["f0"]), r
            assert r["peak_mib"] is None  # no memory column on the CPU
            assert positive(r["gflop"]) and positive(r["tflops"])  # the profile's FLOP count reached every row
        for v in ("fast graphs", "anchor"):
            assert cell[v]["status"] == "n/a" and cell[v]["note"] == "CUDA only"
        assert cell["naive"]["vs_naive"] == 1.0
        assert cell["fast eager"]["vs_naive"] == pytest.approx(cell["naive"]["ms"] / cell["fast eager"]["ms"])


def test_rows_of_a_cell_compute_the_same_proxy(smoke):
    rows = smoke[2]["steps"]
    f0 = {(r["model"], r["L"], r["variant"]): r["f0"] for r in rows if r["status"] == "ok"}
    for model, L, _ in CELLS:
        ref = f0[model, L, "naive"]
        for v in ("hf", "fast eager"):
            assert abs(f0[model, L, v] - ref) <= F0_RTOL * ref, (model, L, v, f0[model, L, v], ref)
    for model in ("smollm2-135m", "gemma-2-2b"):  # the check can tell two prompts apart
        a, b = sorted((f0[model, 32, "naive"], f0[model, 48, "naive"]))
        assert b > 2 * a * (1 + F0_RTOL), (model, a, b)


def test_whole_run_decode_first_call_and_packed(smoke):
    data = smoke[2]
    (w,) = data["whole_run"]
    assert w["status"] == "ok" and w["steps"] == 3 and w["tokens"] == 4  # every step and token ran
    assert positive(w["first_s"]) and positive(w["warm_s"])
    assert sorted(w["sync_every_s"]) == ["1", "2"] and all(positive(t) for t in w["sync_every_s"].values())
    (d,) = data["decode"]
    assert d["status"] == "ok" and d["tokens"] == 4 and d["tokens_new"] == 4
    assert positive(d["warm_ms_per_token"]) and positive(d["prefill_ms"]) and math.isfinite(d["new_ms_per_token"])
    first = {r["variant"]: r for r in data["first_call"]}
    assert first["fast eager"]["status"] == "ok" and positive(first["fast eager"]["seconds"])
    assert first["fast eager"]["L"] == 32 + 5 and first["fast graphs"]["status"] == "n/a"
    one, packed = data["packed"]
    assert (one["mode"], one["pack"], packed["pack"]) == ("one by one", 1, 2)
    for r in (one, packed):
        assert r["status"] == "ok" and r["done"] == 3 and not r["partial"] and r["all_steps_run"], r
        assert positive(r["prompts_per_s"])
    assert packed["vs_one_by_one"] == pytest.approx(packed["prompts_per_s"] / one["prompts_per_s"])


def test_targets_are_judged_from_the_rows(smoke):
    data = smoke[2]
    t = {r["target"]: r for r in data["targets"]}
    step = t["SmolLM2 L=32 N=2 whole step <= 2.5 ms"]
    ours = next(r for r in data["steps"] if (r["model"], r["L"], r["variant"]) == ("smollm2-135m", 32, "fast eager"))
    assert step["value"] == ours["ms"] and step["status"] == ("met" if ours["ms"] <= 2.5 else "missed")
    assert step["margin"] == pytest.approx(100 * (2.5 - ours["ms"]) / 2.5)
    gemma = t["Gemma-2-2B L=48 N=2 >= 1.5x naive"]
    assert gemma["status"] in ("met", "missed") and positive(gemma["value"])
    assert t["Llama-3.1-8B L=48 N=2 >= 1.2x anchor"]["status"] == "not measured"  # no Llama in the smoke run
    assert t["peak extra memory <= 1/10 of naive's"]["status"] == "not measured"  # no memory figures on the CPU


def test_markdown_section_names_device_versions_and_command(smoke):
    import transformers

    md, meta = smoke[3], smoke[2]["meta"]
    assert md.startswith("# earlier results\n")
    section = md.split("## GPU suite (bench/gpu_suite.py, smoke): CPU", 1)[1]
    assert f"torch {torch.__version__}" in section and f"transformers {transformers.__version__}" in section
    assert f"triton {meta['triton']}" in section and meta["triton"] != ""
    assert "python bench/gpu_suite.py --smoke --out " in section and "--budget-s 600" in section
    for heading in ("### One ascent step", "### Whole run", "### Decode", "### Packed throughput", "### Targets"):
        assert heading in section
    assert "| smollm2-135m | 48 | 8 | 2 | fast eager |" in section
