"""bench/gpu_check.py's CPU form (--dry-run): every step of the prepared device check runs on tiny shapes in one
process, writes its figures to the folder as it goes, and the table lists each target of the GPU verification issue
with 'n/a (cpu)' where its figure needs the GPU."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """(exit status, {step: figures}, check.md) of one dry run."""
    if torch.cuda.is_available():
        pytest.skip("the dry run is the CPU form; on a GPU run bench/gpu_check.py itself")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("gpu_check")
    rc = mod.main(["--dry-run", "--out", str(out)])
    return rc, json.loads((out / "check.json").read_text()), (out / "check.md").read_text(), out, mod


def test_every_step_runs_and_writes_its_figures(check):
    rc, res, _, out, mod = check
    assert rc == 0 and list(res) == list(mod.STEPS)
    assert all(res[s]["_status"] == "ok" for s in mod.STEPS), {s: res[s]["_status"] for s in mod.STEPS}
    for step in mod.STEPS:  # each step's own file, written as it went
        assert json.loads((out / f"{step}.json").read_text()).items() <= res[step].items()
    assert res["kernels"]["parity_passed"] >= 6 and res["kernels"]["parity_failed"] == []
    s = res["smollm2"]
    assert s["step_ms"] > 0 and s["refresh_ms"] > 0 and 0 < s["kernels"] < 300
    assert s["plan"]["diff_matmul"] == "bf16" and s["decode"]["status"] == "ok"
    for step in ("llama", "gemma2"):
        assert res[step]["default_ms"] > 0 and res[step]["plain_bf16_ms"] > 0
    assert res["llama"]["buckets_run"] == len(res["llama"]["lengths"]) == 3
    assert res["length_mix"]["repeated"]["ratio"] == 1.0 and res["length_mix"]["buckets"]["ratio"] > 0


def test_the_table_has_each_target_beside_its_figure(check):
    _, res, md, _, mod = check
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| target")]
    assert len(rows) == len(mod.targets(res, cuda=False)) == 11
    assert all(ln.endswith("| n/a (cpu) |") for ln in rows)
    assert "| SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised) |" in md
    assert "| peak memory over 12 buckets at Llama shape within the device | - | n/a (cpu) |" in md
    got = {t: st for t, _, st in mod.targets({**res, "smollm2": dict(res["smollm2"], step_ms=2.0, anchor_ms=3.2)},
                                             cuda=True)}
    assert got["SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised)"] == "met"
    assert got["SmolLM2 step faster than torch.compile of the plain forward (3.2 ms on the H200)"] == "met"
    assert got["peak memory over 12 buckets at Llama shape within the device"] == "not measured"
