"""sicl_fast.answering.export: safetensors and base64 round trips bit for bit, the vLLM form, `calibrate --export`, and
the handoff example (examples/handoff_transformers.py: transformers' generate on the exported embeddings, with our stop
rule) answering as the project does."""
from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from sicl_fast import Calibrator, Engine, SiclError  # noqa: E402
from sicl_fast.commands.cli import main  # noqa: E402
from sicl_fast.answering.export import (  # noqa: E402
    FORMAT, CalibratedEmbeddings, export_path, load, save, vllm_prompt_embeds)

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
    # issue 54 item 4: a file of int rows, float or 2-D ids loaded, to fail later in the reader's own code; a file
    # without the format said its path twice
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "model": "m", "id": "x", "row_start": "0", "row_end": "2"}
    for name, tensors, m in (
            ("int_rows", {"embeddings": torch.zeros(2, 4, dtype=torch.int32), "input_ids": torch.arange(3)}, meta),
            ("float_ids", {"embeddings": torch.zeros(2, 4), "input_ids": torch.zeros(3)}, meta),
            ("ids_2d", {"embeddings": torch.zeros(2, 4), "input_ids": torch.arange(3).view(1, 3)}, meta),
            ("no_format", {"embeddings": torch.zeros(2, 4), "input_ids": torch.arange(3)}, None)):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata=m)
        with pytest.raises(SiclError, match=rf"^\S*{name}.safetensors: unreadable embeddings file: (embeddings 'x': "
                                            r"rows must be bfloat16 or float32|not a sicl_fast embeddings file)"):
            load(tmp_path / f"{name}.safetensors")


def test_a_malformed_embeddings_object_is_one_error_whatever_breaks():
    """Issue 54, item 4 (a parser whose try let some failures out): from_json caught KeyError, TypeError and
    ValueError only, so an infinite row_end (OverflowError) or input ids past int64 (RuntimeError) escaped raw;
    a cheap fuzz of each field replaced by other JSON values gives an object or a SiclError, nothing else."""
    import random

    good = CalibratedEmbeddings(rows=torch.randn(3, 4), row_start=1, row_end=4, input_ids=torch.arange(5), model="m",
                                id="x").to_json()
    for bad in ({**good, "row_end": float("inf")}, {**good, "input_ids": [2 ** 70] * 5}):
        with pytest.raises(SiclError, match="malformed embeddings object"):
            CalibratedEmbeddings.from_json(bad)
    odd = [None, True, -1, 2 ** 64, 1.5, float("inf"), float("nan"), "x", [], [1], [2 ** 70], {}, [-3, 4], "AAAA"]
    rng = random.Random(54)
    for _ in range(200):
        obj = {**good, **{rng.choice(list(good)): rng.choice(odd) for _ in range(rng.randint(1, 2))}}
        try:
            CalibratedEmbeddings.from_json(obj)
        except SiclError:
            pass


def test_vllm_prompt_embeds_form(tiny_run):
    _, _, res = tiny_run
    text = vllm_prompt_embeds(res.embeddings)
    back = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    assert torch.equal(back, res.embeddings) and back.shape == res.embeddings.shape
    with pytest.raises(SiclError):
        vllm_prompt_embeds(res.embeddings[None])


def write_requests(path: Path, reqs: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return str(path)


def test_calibrate_export_writes_each_records_embeddings(tiny_dir, tmp_path, one_thread):
    """`calibrate --export DIR` on a tiny model: one file per record (every row, float32) whose rows are the
    embeddings the API's calibration gives, bit for bit; ids that are not plain file names get files of their own;
    a resumed run writes the new records' files only."""
    reqs = [REQ, {**REQ, "id": "a/b", "query": "nine"}, {**REQ, "id": "a_b", "query": "two"}]
    knobs = ["--model", tiny_dir, "--max-steps", "3", "--N", "2", "--tau", "0", "--seed", "7"]
    emb_dir, out = tmp_path / "emb", tmp_path / "out.jsonl"
    assert main(["calibrate", write_requests(tmp_path / "r.jsonl", reqs[:2]), "--out", str(out),
                 "--export", str(emb_dir), *knobs]) == 0
    first = export_path(emb_dir.resolve(), "e1")
    assert first.name == "e1.safetensors" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert main(["calibrate", write_requests(tmp_path / "r.jsonl", reqs), "--out", str(out),
                 "--export", str(emb_dir), *knobs]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["e1", "a/b", "a_b"] and first.stat().st_mtime_ns == stamp
    paths = [Path(r["embeddings"]) for r in recs]
    assert paths == [export_path(emb_dir.resolve(), r["id"]) for r in recs] and len(set(paths)) == 3
    assert sorted(emb_dir.iterdir()) == sorted(paths)
    eng = Engine(model=tiny_dir)
    for r, path in zip(recs, paths):
        emb = load(path)
        prompt = eng.prepare(next(q for q in reqs if q["id"] == r["id"]))
        res = eng.calibrate(prompt, max_steps=3, N=2, tau=0.0, seed=7)
        assert (emb.id, emb.model, emb.row_start, emb.row_end, emb.dtype) == (r["id"], "tiny-llama", 0, prompt.length,
                                                                              "float32")
        assert r["steps"] == res.steps == 3 and torch.equal(emb.rows, res.embeddings)
        assert torch.equal(emb.input_ids, prompt.input_ids)


def test_handoff_example_prints_the_answer_alone(tiny_dir, tmp_path, one_thread):
    """examples/handoff_transformers.py run as a user runs it (a new process) prints its answer and nothing else: no
    transformers warning the user cannot act on (the tokenizer's clean_up_tokenization_spaces, which transformers
    ignores for BPE: SmolLM2's converted folder, and this tiny model's copy of its tokenizer, have it), no loading
    bar."""
    import subprocess
    import sys

    eng = Engine(model=tiny_dir)
    prompt = eng.prepare(REQ)
    path = CalibratedEmbeddings.from_result(prompt, eng.backend.embed(prompt), eng.lm.name).save(
        tmp_path / "e1.safetensors")
    example = Path(__file__).resolve().parents[1] / "examples" / "handoff_transformers.py"
    run = subprocess.run([sys.executable, str(example), tiny_dir, str(path), "--max-new-tokens", "2", "--stop", "!"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and run.stderr == "" and len(run.stdout.splitlines()) == 1, (run.stdout, run.stderr)


def test_calibrate_export_to_a_file_is_one_line(tmp_path, capsys):
    """Checked before any model is loaded (the model named here does not exist); nothing is written."""
    (tmp_path / "taken").write_text("x")
    reqs = write_requests(tmp_path / "r.jsonl", [REQ])
    assert main(["calibrate", reqs, "--out", str(tmp_path / "o.jsonl"), "--export", str(tmp_path / "taken"),
                 "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--export" in err[0] and "is a file" in err[0]
    assert not (tmp_path / "o.jsonl").exists()
    # issue 54 item 4: an --export file that is --out (or the requests file) replaced it with the embeddings, exit 0
    for out, inp in ((tmp_path / "emb" / f"{REQ['id']}.safetensors", reqs),
                     (tmp_path / "o.jsonl", str(tmp_path / f"{REQ['id']}.safetensors"))):
        if inp != reqs:
            Path(inp).write_text(Path(reqs).read_text())
        assert main(["calibrate", str(inp), "--out", str(out), "--export", str(out.parent if inp == reqs else tmp_path),
                     "--model", str(tmp_path / "no-model")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"its {REQ['id']}.safetensors would replace " in err[0], err
    assert not (tmp_path / "emb").exists() and not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_handoff_example_answers_as_the_project(smol, tmp_path, capsys):
    """The tested handoff: `calibrate --generate --export` on the real SmolLM2, then examples/handoff_transformers.py
    (transformers and safetensors only) on the converted model folder prints each record's answer_calibrated.
    A file of the demonstration rows only (the projection off: kappa 0, so the other rows are the model's own)
    decodes to what our generator decodes, 8 tokens without a stop string."""
    ex = example_module()
    assert main(["cache", "path"]) == 0  # the embedded model's converted transformers folder
    folder = capsys.readouterr().out.strip()
    reqs = write_requests(tmp_path / "r.jsonl", [REQ, {**REQ, "id": "e2", "query": "nine"}])
    out, emb_dir = tmp_path / "out.jsonl", tmp_path / "emb"
    assert main(["calibrate", reqs, "--out", str(out), "--generate", "--export", str(emb_dir), "--max-steps", "3",
                 "--N", "4", "--tau", "0", "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    for rec in map(json.loads, out.read_text().splitlines()):
        assert rec["steps"] == 3 and rec["answer_calibrated"]
        assert ex.main([str(folder), rec["embeddings"], "--max-new-tokens", "8"]) == 0
        assert capsys.readouterr().out == rec["answer_calibrated"] + "\n"

    eng = Engine(smol)
    prompt = eng.prepare(REQ, reserve=8)
    res = Calibrator(eng.backend, eng.config(max_steps=3, tau=0.0, N=4, kappa=0.0)).run(prompt)
    assert res.steps == 3 and res.best_step > 0  # calibrated rows, not X0
    path = CalibratedEmbeddings.from_result(prompt, res.embeddings, smol.name, rows="demos").save(
        tmp_path / "d.safetensors"
    )
    ours = eng.generate(prompt, res.embeddings, max_new_tokens=8, stop_strings=())
    assert ex.answer(smol.model, smol.tokenizer, str(path), 8, stops=[]) == ours.answer != ""
