"""sicl_fast.export: safetensors and base64 round trips bit for bit, the vLLM form, and the handoff example:
transformers' model.generate(inputs_embeds=...) on exported embeddings decodes what our generator decodes."""
from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from sicl_fast import Calibrator, Engine, SiclError  # noqa: E402
from sicl_fast.export import CalibratedEmbeddings, load, save, vllm_prompt_embeds  # noqa: E402

REQ = {"id": "e1", "instruction": "Write each number word as a digit.",
       "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"}, {"input": "two", "output": "2"}],
       "query": "five"}


def example_module():
    path = Path(__file__).resolve().parents[1] / "examples" / "handoff_transformers.py"
    spec = importlib.util.spec_from_file_location("handoff_transformers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(tiny_llama, one_thread):
    eng = Engine(tiny_llama)
    prompt = eng.prepare(REQ)
    res = eng.calibrate(prompt, max_steps=3, tau=0.0, seed=7)
    return eng, prompt, res


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", ["demos", "all"])
def test_round_trips_bit_for_bit(tiny_run, tmp_path, dtype, rows):
    eng, prompt, res = tiny_run
    emb = CalibratedEmbeddings.from_result(prompt, res.embeddings, eng.lm.name, rows=rows, dtype=dtype)
    a, b = (prompt.demo_start, prompt.demo_end) if rows == "demos" else (0, prompt.length)
    want = res.embeddings[a:b].to(getattr(torch, dtype))
    assert (emb.row_start, emb.row_end, emb.dtype) == (a, b, dtype) and torch.equal(emb.rows, want)
    for back in (CalibratedEmbeddings.from_json(emb.to_json()), load(save(tmp_path / "e.safetensors", emb))):
        assert torch.equal(back.rows, want) and back.rows.dtype == want.dtype
        assert torch.equal(back.input_ids, prompt.input_ids)
        assert (back.row_start, back.row_end, back.model, back.id) == (a, b, "tiny-llama", "e1")
    assert not list(tmp_path.glob("*.tmp"))


def test_full_matrix_fills_the_other_rows(tiny_run):
    eng, prompt, res = tiny_run
    emb = CalibratedEmbeddings.from_result(prompt, res.embeddings, eng.lm.name)
    X = emb.full(eng.lm.model.get_input_embeddings())
    X0 = eng.backend.embed(prompt)
    a, b = prompt.demo_start, prompt.demo_end
    assert torch.equal(X[a:b], res.embeddings[a:b]) and torch.equal(X[:a], X0[:a]) and torch.equal(X[b:], X0[b:])
    with pytest.raises(SiclError, match="input embedding layer"):
        emb.full()


def test_bad_inputs_are_clear_errors(tiny_run, tmp_path):
    eng, prompt, res = tiny_run
    good = CalibratedEmbeddings.from_result(prompt, res.embeddings, "m").to_json()
    for bad in ({**good, "data": "!!"}, {**good, "shape": [3, 5]}, {**good, "dtype": "int8"}, {"dtype": "float32"}):
        with pytest.raises(SiclError, match="malformed embeddings"):
            CalibratedEmbeddings.from_json(bad)
    with pytest.raises(SiclError, match="do not fit the row range"):
        CalibratedEmbeddings.from_json({**good, "row_end": good["row_end"] + 1})
    with pytest.raises(SiclError, match="not found"):
        load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(SiclError, match="junk.safetensors"):
        load(tmp_path / "junk.safetensors")
    with pytest.raises(SiclError, match="rows must be one of"):
        CalibratedEmbeddings.from_result(prompt, res.embeddings, "m", rows="query")


def test_vllm_prompt_embeds_form(tiny_run):
    _, _, res = tiny_run
    text = vllm_prompt_embeds(res.embeddings)
    back = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    assert torch.equal(back, res.embeddings) and back.shape == res.embeddings.shape
    with pytest.raises(SiclError):
        vllm_prompt_embeds(res.embeddings[None])


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["all", "demos"])
def test_transformers_generate_on_exported_embeddings_matches_our_generator(smol, tmp_path, rows):
    """The tested handoff example, on the real SmolLM2. 'demos' rows need the projection off (kappa <= 0): a
    whole-prompt projection also rescales the rows outside [a, b)."""
    eng = Engine(smol)
    prompt = eng.prepare(REQ, reserve=8)
    cfg = eng.config(max_steps=3, tau=0.0, N=4, kappa=0.2 if rows == "all" else 0.0)
    res = Calibrator(eng.backend, cfg).run(prompt)
    assert res.steps == 3
    path = CalibratedEmbeddings.from_result(prompt, res.embeddings, smol.name, rows=rows).save(tmp_path / "q.safetensors")
    ours = eng.generate(prompt, res.embeddings, max_new_tokens=8, stop_strings=())
    theirs = example_module().generate_from_export(smol.model, load(path), 8, sorted(smol.eos_token_ids))
    if ours.stop_reason == "eos":
        assert theirs[-1] in smol.eos_token_ids
        theirs = theirs[:-1]
    assert theirs == ours.token_ids and len(ours.token_ids) >= 1
