"""A correct fast tokenizer for SentencePiece-BPE GGUF files (Gemma 3, Llama 2, Mistral v0.1 and the like).

transformers builds the tokenizer of a GGUF file from the file's metadata, and for Gemma it gets it wrong: it
makes a Unigram model out of the ``tokenizer.ggml.scores``, but in a SentencePiece *BPE* vocabulary those scores
are merge priorities (minus the merge rank), not log-probabilities, so the Unigram model always prefers single
characters ('h', 'i', '▁', 't', ...), and no BOS is added. This module builds the tokenizer the model was trained
with instead:

* the vocabulary is ``tokenizer.ggml.tokens`` with its ids;
* the BPE merges are ``tokenizer.ggml.merges`` when the file has them, otherwise derived the way SentencePiece's
  BPE encoder applies them: a pair (a, b) of normal pieces merges when a+b is a normal piece, and pairs with the
  higher-scored a+b merge first;
* byte fallback (``<0xNN>`` pieces) for characters outside the vocabulary;
* spaces become '▁'; when ``tokenizer.ggml.add_space_prefix`` is true (llama.cpp's default; Gemma's files say
  false) a '▁' is also put in front of each stretch of text between added tokens, as llama.cpp does;
  there is no pre-tokenizer, as in SentencePiece and llama.cpp: the BPE runs over each whole stretch of text
  between added tokens;
* control (and unknown) pieces are special added tokens, user-defined pieces (Gemma's '\\n', runs of spaces and
  tabs, HTML tags) are non-special added tokens, matched before the BPE as SentencePiece does;
* BOS / EOS are added according to ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``; bos, eos, unk, pad (and
  mask and sep when the file names them) come from the ``tokenizer.ggml.*_token_id`` keys.

Supported ``tokenizer.ggml.model`` values: ``"llama"`` (llama.cpp's name for SentencePiece BPE, used for Gemma,
Gemma 2, Gemma 3, Llama 1/2, Mistral v0.1, ...). Anything else (``"gpt2"`` byte-level BPE, ``"t5"`` Unigram,
``"bert"``, ...) raises :class:`UnsupportedGGUFTokenizer`; transformers' own GGUF conversion handles most of those.

The metadata is read with a small reader of the GGUF key/value section (stopping before the tensor table): the
``gguf`` package's ``GGUFReader`` builds a numpy view per array element and takes 15-35 s on a 262k-entry
vocabulary, this takes well under a second (the tests check it against ``GGUFReader``). The type numbers below
are those of ``gguf.GGUFValueType`` and ``gguf.TokenType``.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

SUPPORTED_TOKENIZER_MODELS = ("llama",)

# GGUF metadata value types (gguf.GGUFValueType) with a fixed width, as numpy dtype codes (without byte order)
_SCALAR_DTYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "u1", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

SPIECE_UNDERLINE = "▁"


class UnsupportedGGUFTokenizer(ModelLoadError):
    """The GGUF file's tokenizer is not one this module can build."""


# --------------------------------------------------------------------------------------------------- reading


def read_gguf_metadata(path: str | os.PathLike, prefixes: tuple[str, ...] = ("general.", "tokenizer.")) -> dict:
    """The GGUF key/value metadata whose keys start with one of `prefixes` (plus `<arch>.context_length`).

    Numeric arrays come back as numpy arrays, string arrays as lists of str, scalars as Python values.
    """
    path = Path(path)
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        (version,) = struct.unpack_from("<I", mm, 4)
        bo = "<"
        if version & 0xFFFF == 0:  # a big-endian file, as gguf's own reader detects it
            bo = ">"
            (version,) = struct.unpack_from(">I", mm, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
        _tensor_count, kv_count = struct.unpack_from(bo + "QQ", mm, 8)
        pos = 24
        out: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_str(mm, pos, bo)
            (vtype,) = struct.unpack_from(bo + "I", mm, pos)
            pos += 4
            keep = key.startswith(prefixes) or key.endswith(".context_length")
            value, pos = _read_value(mm, pos, vtype, bo, keep)
            if keep:
                out[key] = value
    return out


def _read_str(mm, pos: int, bo: str, keep: bool = True) -> tuple[str | None, int]:
    (n,) = struct.unpack_from(bo + "Q", mm, pos)
    pos += 8
    if not keep:
        return None, pos + n
    return mm[pos : pos + n].decode("utf-8", errors="replace"), pos + n


def _read_value(mm, pos: int, vtype: int, bo: str, keep: bool) -> tuple[Any, int]:
    if vtype in _SCALAR_DTYPES:
        dt = np.dtype(bo + _SCALAR_DTYPES[vtype])
        value = np.frombuffer(mm, dtype=dt, count=1, offset=pos)[0].item() if keep else None
        if keep and vtype == _BOOL:
            value = bool(value)
        return value, pos + dt.itemsize
    if vtype == _STRING:
        return _read_str(mm, pos, bo, keep)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from(bo + "IQ", mm, pos)
        pos += 12
        if etype in _SCALAR_DTYPES:
            dt = np.dtype(bo + _SCALAR_DTYPES[etype])
            arr = np.frombuffer(mm, dtype=dt, count=count, offset=pos).copy() if keep else None
            if keep and etype == _BOOL:
                arr = arr.astype(bool)
            return arr, pos + dt.itemsize * count
        items = []
        for _ in range(count):
            if etype == _STRING:
                item, pos = _read_str(mm, pos, bo, keep)
            else:
                item, pos = _read_value(mm, pos, etype, bo, keep)
            if keep:
                items.append(item)
        return (items if keep else None), pos
    raise ModelLoadError(f"unknown GGUF metadata value type {vtype} at byte {pos}")


# -------------------------------------------------------------------------------------------------- building


def _derive_merges(tokens: list[str], scores: np.ndarray, mergeable: np.ndarray) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from the vocabulary: (a, b) with a, b and a+b all mergeable pieces.

    Ordered by the score of a+b, highest first (SentencePiece merges the best-scored pair first); the
    several ways of splitting one piece are ordered by the scores of their parts, as transformers'
    SentencePieceExtractor does.
    """
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if mergeable[i]:
            index.setdefault(t, i)
    get = index.get
    merged, left, right = [], [], []
    for i, tok in enumerate(tokens):
        if len(tok) < 2 or not mergeable[i]:
            continue
        for k in range(1, len(tok)):
            a = get(tok[:k])
            if a is not None:
                b = get(tok[k:])
                if b is not None:
                    merged.append(i)
                    left.append(a)
                    right.append(b)
    if not merged:
        return []
    m, a, b = np.array(merged), np.array(left), np.array(right)
    s = np.asarray(scores, np.float64)
    # np.lexsort sorts by the last key first: the merged piece's score (high first), then its id (so the
    # splits of one piece stay together), then the scores of the left and right parts (high first)
    order = np.lexsort((-s[b], -s[a], m, -s[m]))
    return [(tokens[a[j]], tokens[b[j]]) for j in order.tolist()]


def _gguf_merges(raw: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = []
    for m in raw:
        parts = m.split(" ")
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
            continue
        for k in range(1, len(m) - 1):  # a piece with a space in it: take the split whose halves are both pieces
            if m[k] == " " and m[:k] in vocab and m[k + 1 :] in vocab:
                merges.append((m[:k], m[k + 1 :]))
                break
    return merges


def build_backend_tokenizer(meta: dict):
    """The `tokenizers.Tokenizer` and the special-token kwargs for a SentencePiece-BPE GGUF's metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedGGUFTokenizer(
            f"GGUF tokenizer model {model!r} is not supported here (only SentencePiece BPE, "
            f"tokenizer.ggml.model in {SUPPORTED_TOKENIZER_MODELS}); use transformers' own GGUF tokenizer "
            "conversion (AutoTokenizer.from_pretrained(dir, gguf_file=name)) for it"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedGGUFTokenizer("the GGUF file has no tokenizer.ggml.tokens")
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
    types = meta.get("tokenizer.ggml.token_type")
    types = np.full(n, _NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(scores) != n or len(types) != n:
        raise ModelLoadError(f"GGUF tokenizer arrays disagree: {n} tokens, {len(scores)} scores, {len(types)} types")
    if "tokenizer.ggml.merges" not in meta and not np.any(scores != scores[0]):
        raise UnsupportedGGUFTokenizer("the GGUF file has neither BPE merges nor token scores to derive them from")

    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for SPM
    tokens = list(tokens)
    if not add_prefix:
        # llama.cpp's converter stores user-defined pieces with real spaces ('  ' for SentencePiece's '▁▁'): put
        # the '▁' back, so that they match the normalized text as in SentencePiece (and read as in transformers)
        taken = set(tokens)
        for i in np.nonzero(types == _USER_DEFINED)[0]:
            t = tokens[i]
            if " " in t and t.replace(" ", SPIECE_UNDERLINE) not in taken:
                tokens[i] = t.replace(" ", SPIECE_UNDERLINE)
                taken.add(tokens[i])

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id
    mergeable = (types == _NORMAL) | (types == 0)
    if "tokenizer.ggml.merges" in meta:
        merges = _gguf_merges(meta["tokenizer.ggml.merges"], vocab)
    else:
        merges = _derive_merges(tokens, scores, mergeable)

    def tok_at(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < n else None

    unk = tok_at("unknown_token_id")
    if unk is None and "<unk>" in vocab:
        unk = "<unk>"
    has_bytes = bool(np.any(types == _BYTE))
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=has_bytes,
                            dropout=None))

    if add_prefix:
        # a '▁' in front of every stretch of text between added tokens, then spaces as '▁': llama.cpp's SPM
        # tokenizer (and transformers' legacy Llama one) does the same. The user-defined pieces are matched on
        # the raw text, before this.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE),
                                                   normalizers.Replace(" ", SPIECE_UNDERLINE)])
    else:
        # spaces as '▁' and nothing else; the user-defined pieces are matched on this normalized text
        backend.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    backend.pre_tokenizer = None  # SentencePiece's BPE runs over the whole text, as llama.cpp's does
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(dec)

    special_ids = [i for i in range(n) if types[i] in (_CONTROL, _UNKNOWN)]
    named = {k: tok_at(f"{k}_token_id") for k in ("bos", "eos", "padding", "mask", "seperator")}  # sic
    named["unknown"] = unk
    for t in named.values():  # a named token that the file did not type as control is special all the same
        if t is not None and vocab.get(t) is not None and vocab[t] not in special_ids:
            special_ids.append(vocab[t])
    special_ids = [i for i in sorted(set(special_ids)) if vocab.get(tokens[i]) == i]  # not a duplicate's later id
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    taken_ids = set(special_ids)
    user = [int(i) for i in np.nonzero(types == _USER_DEFINED)[0] if vocab.get(tokens[i]) == i and i not in taken_ids]
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=not add_prefix) for i in user])
    moved = [i for i in special_ids + user if backend.token_to_id(tokens[i]) != i]
    if moved:  # adding a token that the vocabulary holds keeps its id; anything else is a bug here
        raise ModelLoadError(f"added tokens changed ids, e.g. {tokens[moved[0]]!r} (id {moved[0]})")

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for SPM
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = named["bos"], named["eos"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = ([(bos, vocab[bos])] if add_bos else []) + ([(eos, vocab[eos])] if add_eos and eos != bos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    kwargs = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": named["padding"],
              "mask_token": named["mask"], "sep_token": named["seperator"],
              "add_bos_token": add_bos, "add_eos_token": add_eos}
    return backend, {k: v for k, v in kwargs.items() if v is not None}


def tokenizer_from_gguf(path: str | os.PathLike, model_max_length: int | None = None):
    """A `transformers.PreTrainedTokenizerFast` for the SentencePiece-BPE tokenizer stored in a GGUF file.

    Supports ``tokenizer.ggml.model == "llama"`` (SentencePiece BPE: Gemma 1/2/3, Llama 1/2, Mistral v0.1, ...);
    raises :class:`UnsupportedGGUFTokenizer` (a ModelLoadError) for any other tokenizer model. See the module
    docstring for what is built. `model_max_length` defaults to the file's ``<arch>.context_length``.
    The result encodes with offsets, adds BOS (and EOS) as the file says, marks every control token special,
    and survives ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    from transformers import PreTrainedTokenizerFast

    meta = read_gguf_metadata(path)
    backend, kwargs = build_backend_tokenizer(meta)
    if model_max_length is None:
        arch = meta.get("general.architecture")
        model_max_length = meta.get(f"{arch}.context_length") if arch else None
    if model_max_length is not None:
        kwargs["model_max_length"] = int(model_max_length)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **kwargs)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok.chat_template = template
    return tok


__all__ = ["tokenizer_from_gguf", "read_gguf_metadata", "build_backend_tokenizer", "UnsupportedGGUFTokenizer",
           "SUPPORTED_TOKENIZER_MODELS"]
