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
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from ..errors import ModelLoadError, first_line

T = TypeVar("T")


class Damaged(ValueError):
    """A check of a header failed (the message says which): the file is not what its format says."""


MAX_HEADER = 100_000_000  # the most bytes a safetensors header may take (the safetensors library's own limit)
_GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_JSON_NAMES = {str: "a string", list: "a list", dict: "an object"}

# GGUF metadata value types: struct formats of the fixed-size ones (8: string, 9: array)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml types by id (the ones whose values a numpy array holds; every other floating id is quantised)
_GGML_PLAIN = {0: ("F32", "<f4"), 1: ("F16", "<f2"), 28: ("F64", "<f8"), 30: ("BF16", None)}
_GGML_INTS = {24: "I8", 25: "I16", 26: "I32", 27: "I64"}
_SAFETENSORS_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": None}
_ITEMSIZE = {"F32": 4, "F16": 2, "F64": 8, "BF16": 2}  # the bytes a value of the floating safetensors dtypes takes


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
    """Every tensor of the checkpoint at `path` (kind 'gguf' or 'dir'), from its headers (module docstring). A damaged
    file of any kind (a header that is not what its format says, a length past the file's end, an index without its
    weight map, a .bin that is not one) is a one-line ModelLoadError naming the file."""
    path = Path(path)
    if kind == "gguf":
        return _parsed(path, "GGUF file", _gguf_tensors)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = _parsed(index, "safetensors index", _index_files)
    else:
        files = sorted(path.glob("*.safetensors"))
    if files:
        return [t for f in files for t in _parsed(f, "safetensors file", _safetensors_tensors)]
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(f"{path} holds no .safetensors or .bin weights")
    return [t for f in bins for t in _parsed(f, "PyTorch .bin file", _bin_tensors)]


def _parsed(file: Path, what: str, parse: Callable[[Path], T]) -> T:
    """parse(file), where whatever a damaged or hostile file makes the parse raise (the checks' Damaged, or any other
    exception: a parse is one try, so none escapes) becomes a one-line ModelLoadError naming the file."""
    try:
        return parse(file)
    except ModelLoadError:
        raise
    except Damaged as exc:
        raise ModelLoadError(f"{file}: not a readable {what}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the file's bytes decide what breaks; the message says what did
        raise ModelLoadError(f"{file}: not a readable {what} ({first_line(exc)})") from None


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
        if not _parsed(t.file, f"checkpoint file (the values of {t.name})", lambda _, t=t: _bf16_values(t)):
            return False, f"the checkpoint stores {t.name} as {t.type}, whose values are not all bf16 values"
    note = f" ({len(wide)} vectors stored wider hold bf16 values)" if wide else ""
    return True, f"the checkpoint stores every weight as bf16{note}"


def _bf16_values(t: StoredTensor) -> bool:
    """Are the values of a (small) tensor stored wider than bf16 all bf16 values? Read from the file."""
    n = math.prod(t.shape)  # exact: a hostile shape must not wrap around as an int64 product would
    if t.offset < 0:  # a .bin checkpoint: the memory-mapped tensor itself
        values = torch.load(t.file, map_location="cpu", mmap=True, weights_only=True)[t.name].float()
    else:
        fmt = {**_SAFETENSORS_PLAIN, **{name: f for name, f in _GGML_PLAIN.values()}}.get(t.type)
        if fmt is None:
            return False
        size = n * np.dtype(fmt).itemsize
        if t.offset + size > t.file.stat().st_size:  # checked before the read: a hostile shape is not allocated
            raise Damaged(f"{t.name}'s {size} bytes at offset {t.offset} run past the file's end")
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            raw = f.read(size)
        values = torch.from_numpy(np.frombuffer(raw, dtype=fmt).astype(np.float64))
    return bool(torch.equal(values.double(), values.to(torch.bfloat16).double()))


def _index_files(index: Path) -> list[Path]:
    """The files a sharded checkpoint's model.safetensors.index.json lists in its weight map (names in its folder)."""
    weight_map = _field(json.loads(index.read_text()), "weight_map", dict, "the index")
    names = set(weight_map.values())
    bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n or Path(n).name != n)
    if bad:
        raise Damaged(f"its weight_map names {bad[0]}, not a file name in its folder")
    return sorted(index.parent / n for n in names)


def _safetensors_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, from its JSON header, each field checked (module docstring)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Damaged(f"{size} bytes, fewer than the header's 8-byte length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):  # checked before the read: a hostile length is not allocated
            raise Damaged(f"a header length of {n} bytes in a file of {size} (at most {MAX_HEADER})")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise Damaged(f"the header is a JSON {type(header).__name__}, not an object")
    data = size - 8 - n  # the bytes after the header: every tensor's range lies in them
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r}"
        dtype = _field(info, "dtype", str, where)
        shape = _field(info, "shape", list, where)
        offsets = _field(info, "data_offsets", list, where)
        if not all(_count(x) for x in shape):
            raise Damaged(f"{where}: shape {shape} is not a list of sizes")
        if len(offsets) != 2 or not all(_count(x) for x in offsets) or not offsets[0] <= offsets[1] <= data:
            raise Damaged(f"{where}: data_offsets {offsets} is not a byte range within the {data} bytes of data")
        width = _ITEMSIZE.get(dtype)
        if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
            raise Damaged(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its shape {shape} of "
                          f"{dtype} {math.prod(shape) * width}")
        floating = dtype in _SAFETENSORS_PLAIN or dtype.startswith("F8")
        out.append(StoredTensor(name, dtype, tuple(shape), floating, file, 8 + n + offsets[0]))
    return out


def _field(obj, name: str, typ: type, where: str):
    """obj[name] of JSON type `typ` (obj a JSON object), else Damaged saying which."""
    if not isinstance(obj, dict):
        raise Damaged(f"{where} is a JSON {type(obj).__name__}, not an object")
    if name not in obj:
        raise Damaged(f"{where} has no {name!r}")
    if not isinstance(obj[name], typ):
        raise Damaged(f"{where}: {name!r} is a JSON {type(obj[name]).__name__}, not {_JSON_NAMES[typ]}")
    return obj[name]


def _count(x) -> bool:
    """A size or an offset: an int >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _bin_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of a PyTorch .bin file, memory-mapped (their dtypes and shapes; no values read)."""
    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise Damaged(f"it holds a {type(state).__name__}, not a dict of tensors")
    return [StoredTensor(name, str(t.dtype).replace("torch.", ""), tuple(t.shape), t.is_floating_point(), file, -1)
            for name, t in state.items() if isinstance(t, torch.Tensor)]


def _gguf_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of a GGUF file (version 2 or 3), from its header; the metadata is walked, not decoded, except
    general.alignment. Every count and length is checked against the bytes left before it is used."""
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _walk_gguf(mm, file)


def _walk_gguf(mm, file: Path) -> list[StoredTensor]:
    if mm[:4] != b"GGUF":
        raise Damaged("no GGUF magic")
    size = len(mm)
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version < 2:
        raise Damaged(f"GGUF version {version} (2 or 3 read)")
    pos, alignment = 24, 32

    def fits(count: int, each: int, at: int, what: str) -> None:
        """count items of at least `each` bytes from `at` lie within the file: checked before a loop or a read."""
        if count * each > size - at:
            raise Damaged(f"{count} {what} at byte {at} would run past the file's end ({size} bytes)")

    def string(at: int) -> tuple[bytes, int]:
        (k,) = struct.unpack_from("<Q", mm, at)
        fits(k, 1, at + 8, "bytes of a string")
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
                fits(count, struct.calcsize(_GGUF_SCALARS[etype]), at, "array values")
                return at + count * struct.calcsize(_GGUF_SCALARS[etype])
            fits(count, 8, at, "array values")  # a string or an array takes 8 bytes at least
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise Damaged(f"unknown GGUF value type {vtype}")

    fits(n_kv, 12, pos, "metadata entries")  # a key's length and a value type at least
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        pos += 4
        if key == b"general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", mm, pos)
            if alignment == 0:
                raise Damaged("general.alignment 0")
        pos = skip(vtype, pos)
    fits(n_tensors, 24, pos, "tensor entries")  # a name's length, a dimension count, a type and an offset at least
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        if n_dims > _GGUF_MAX_DIMS:
            raise Damaged(f"tensor {name[:64]!r} has {n_dims} dimensions (at most {_GGUF_MAX_DIMS})")
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        gtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name.decode(), gtype, tuple(reversed(dims)), offset))
    data = (pos + alignment - 1) // alignment * alignment
    for name, _, _, offset in infos:
        if offset > size - data:
            raise Damaged(f"tensor {name!r}'s offset {offset} lies past the file's end")
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
