"""What a checkpoint stores, read from its headers without loading it: whether every weight is a bf16 value, which
is what `--dtype auto` decides from on CUDA (sicl_fast.models.loading.resolve_dtype).

    bf16_checkpoint(path, kind) -> (bool, why)      kind 'gguf' (a .gguf file) or 'dir' (a transformers folder)
    stored_tensors(path, kind) -> [StoredTensor]    each weight's stored type and shape, and where its bytes are

Headers: a safetensors file is an 8-byte length and a JSON header (each tensor's dtype, shape and byte range); a
sharded checkpoint lists its files in model.safetensors.index.json. A GGUF file's header holds key-value metadata
(general.alignment among them), then each tensor's name, shape, ggml type and offset into the aligned data section.
A folder with PyTorch .bin files is opened with torch.load(mmap=True): their dtypes without reading the weights.

The rule: every floating-point tensor stored as BF16, except small ones (1-D: norms, biases) stored wider, whose
values are read (a few KB) and must each be a bf16 value. Anything else is not a bf16 checkpoint: a float32 or
float16 matrix (its values are not bf16 in general; rounding it makes another model) or a quantised GGUF tensor
(dequantised as d * q (+ m) with an f16 scale d of 11 significant bits times a 4-8 bit integer: more than bf16's 8).
The registry's two GGUF models are such (SmolLM2-135M: 210 Q4_1 and one Q8_0 matrices; Gemma 3 270M: Q5_0, Q4_K,
Q6_K and Q8_0 ones), and so was the decision before this reader, which loaded every weight as float32 and found
their bf16 copies different (211 of SmolLM2's 272 tensors and 127 of Gemma 3's 236: the F32 norms are bf16 values).
"""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError

# GGUF metadata value types: struct formats of the fixed-size ones (8: string, 9: array)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml types by id (the ones whose values a numpy array holds; every other floating id is quantised)
_GGML_PLAIN = {0: ("F32", "<f4"), 1: ("F16", "<f2"), 28: ("F64", "<f8"), 30: ("BF16", None)}
_GGML_INTS = {24: "I8", 25: "I16", 26: "I32", 27: "I64"}
_SAFETENSORS_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": None}


@dataclass(frozen=True)
class StoredTensor:
    """One weight as its checkpoint stores it: name, type ('BF16', 'F32', 'Q4_K', ...), shape, floating (not an
    integer tensor), and (file, byte offset) of its values."""

    name: str
    type: str
    shape: tuple
    floating: bool
    file: Path
    offset: int

    @property
    def vector(self) -> bool:
        """At most one dimension above 1 (a norm's weight, a bias)."""
        return sum(n > 1 for n in self.shape) <= 1


def stored_tensors(path: Path, kind: str) -> list[StoredTensor]:
    """Every tensor of the checkpoint at `path` (kind 'gguf' or 'dir'), from its headers (module docstring)."""
    path = Path(path)
    if kind == "gguf":
        return _gguf_tensors(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if files:
        return [t for f in files for t in _safetensors_tensors(f)]
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(f"{path} holds no .safetensors or .bin weights")
    out = []
    for f in bins:
        for name, t in torch.load(f, map_location="cpu", mmap=True, weights_only=True).items():
            kind_name = str(t.dtype).replace("torch.", "")
            out.append(StoredTensor(name, kind_name, tuple(t.shape), t.is_floating_point(), f, -1))
    return out


def bf16_checkpoint(path: Path, kind: str) -> tuple[bool, str]:
    """(whether every weight of the checkpoint is a bf16 value, why), by the module docstring's rule: its headers,
    and the values of the small tensors stored wider than bf16."""
    tensors = [t for t in stored_tensors(path, kind) if t.floating]
    if not tensors:
        return False, "the checkpoint stores no floating-point weights"
    wide = [t for t in tensors if t.type != "BF16" and t.type.lower() != "bfloat16"]
    big = [t for t in wide if not t.vector]
    if big:
        counts: dict = {}
        for t in big:
            counts[t.type] = counts.get(t.type, 0) + 1
        listed = ", ".join(f"{kind_} ({n})" for kind_, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return False, f"the checkpoint stores matrices as {listed}: not bf16 values"
    for t in wide:
        if not _bf16_values(t):
            return False, f"the checkpoint stores {t.name} as {t.type}, whose values are not all bf16 values"
    note = f" ({len(wide)} vectors stored wider hold bf16 values)" if wide else ""
    return True, f"the checkpoint stores every weight as bf16{note}"


def _bf16_values(t: StoredTensor) -> bool:
    """Are the values of a (small) tensor stored wider than bf16 all bf16 values? Read from the file."""
    n = int(np.prod(t.shape)) if t.shape else 1
    if t.offset < 0:  # a .bin checkpoint: the memory-mapped tensor itself
        values = torch.load(t.file, map_location="cpu", mmap=True, weights_only=True)[t.name].float()
    else:
        fmt = {**_SAFETENSORS_PLAIN, **{name: f for name, f in _GGML_PLAIN.values()}}.get(t.type)
        if fmt is None:
            return False
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            raw = f.read(n * np.dtype(fmt).itemsize)
        values = torch.from_numpy(np.frombuffer(raw, dtype=fmt).astype(np.float64))
    return bool(torch.equal(values.double(), values.to(torch.bfloat16).double()))


def _safetensors_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, from its JSON header."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None
    base = 8 + n
    return [StoredTensor(name, info["dtype"], tuple(info["shape"]), info["dtype"] in _SAFETENSORS_PLAIN
                         or info["dtype"].startswith("F8"), file, base + info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"]


def _gguf_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of a GGUF file (version 2 or 3), from its header; the metadata is walked, not decoded, except
    general.alignment."""
    try:
        with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _walk_gguf(mm, file)
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(f"{file}: not a readable GGUF file ({exc})") from None


def _walk_gguf(mm, file: Path) -> list[StoredTensor]:
    if mm[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} (2 or 3 read)")
    pos, alignment = 24, 32

    def string(at: int) -> tuple[bytes, int]:
        (k,) = struct.unpack_from("<Q", mm, at)
        return mm[at + 8:at + 8 + k], at + 8 + k

    def skip(vtype: int, at: int) -> int:
        if vtype in _GGUF_SCALARS:
            return at + struct.calcsize(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return string(at)[1]
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", mm, at)
            at += 12
            if etype in _GGUF_SCALARS:
                return at + count * struct.calcsize(_GGUF_SCALARS[etype])
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise ValueError(f"unknown GGUF value type {vtype}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        pos += 4
        if key == b"general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", mm, pos)
        pos = skip(vtype, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        gtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name.decode(), gtype, tuple(reversed(dims)), offset))
    data = (pos + alignment - 1) // alignment * alignment
    return [StoredTensor(name, _ggml_name(gtype), shape, gtype not in _GGML_INTS, file, data + offset)
            for name, gtype, shape, offset in infos]


def _ggml_name(gtype: int) -> str:
    """A ggml type's name ('F32', 'Q4_K', ...): the gguf package's, where it is installed."""
    if gtype in _GGML_PLAIN:
        return _GGML_PLAIN[gtype][0]
    if gtype in _GGML_INTS:
        return _GGML_INTS[gtype]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(gtype).name
    except (ImportError, ValueError):
        return f"ggml type {gtype}"


__all__ = ["StoredTensor", "bf16_checkpoint", "stored_tensors"]
