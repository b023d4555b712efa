"""Handoff of calibrated embeddings to other front ends: a safetensors file, the server's base64 JSON, vLLM.

A `CalibratedEmbeddings` holds the calibrated rows [row_start, row_end) of one prompt's input embeddings with
the prompt's token ids and the model's name. Rows outside the range are the model's own embeddings of the
token ids, with one exception: with projection_scope "prompt" (the default) a cosine projection rescales the
whole matrix, prefix and query rows included, so when `projections > 0` take every row (rows "all") to
reproduce the calibrated answer exactly.

    safetensors file   tensors "embeddings" [row_end - row_start, d] (float32 or bfloat16) and
                       "input_ids" [L] int64; metadata (strings): format, model, id, row_start, row_end
    JSON (the server)  {"dtype", "shape", "row_start", "row_end", "byteorder": "little", "data": base64,
                        "input_ids": [...], "model", "id"}
    vLLM               `vllm_prompt_embeds(x)`: a whole [L, d] matrix as base64 of torch.save's bytes, the form
                       vLLM's Completions API takes in "prompt_embeds" (see README, "Handing the embeddings over")

`sicl-fast calibrate --export DIR` writes each record's embeddings (every row, float32) to a safetensors file in DIR
(`export_path`) and puts its path in the record, under "embeddings" (`ExportingWriter`).
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..errors import SiclError
from ..formats.records import check_out_dir

FORMAT = "sicl_fast.calibrated_embeddings.v1"
# wire dtype -> (torch dtype, little-endian numpy dtype of the same width the bytes are read as)
WIRE_DTYPES: dict[str, tuple[torch.dtype, str]] = {"float32": (torch.float32, "<f4"),
                                                   "bfloat16": (torch.bfloat16, "<i2")}
ROW_CHOICES = ("demos", "all")


@dataclass
class CalibratedEmbeddings:
    """rows: [row_end - row_start, d] float32 or bfloat16; input_ids: [L] int64 (the whole prompt)."""

    rows: torch.Tensor
    row_start: int
    row_end: int
    input_ids: torch.Tensor
    model: str
    id: str

    def __post_init__(self) -> None:
        wire = {t for t, _ in WIRE_DTYPES.values()}
        if self.rows.dtype not in wire or self.input_ids.dim() != 1 or self.input_ids.dtype != torch.int64:
            # a file written by another program: int rows or float ids would fail later, in someone else's code
            raise SiclError(f"embeddings {self.id!r}: rows must be {' or '.join(sorted(WIRE_DTYPES))} (got "
                            f"{str(self.rows.dtype).replace('torch.', '')}) and input_ids one row of int64 token ids "
                            f"(got {str(self.input_ids.dtype).replace('torch.', '')} of shape "
                            f"{tuple(self.input_ids.shape)})")
        L = int(self.input_ids.numel())
        if self.rows.dim() != 2 or not 0 <= self.row_start <= self.row_end <= L \
                or self.rows.shape[0] != self.row_end - self.row_start:
            raise SiclError(f"embeddings {self.id!r}: rows of shape {tuple(self.rows.shape)} do not fit the row range "
                            f"[{self.row_start}, {self.row_end}) of a {L}-token prompt")

    @classmethod
    def from_result(cls, prompt, embeddings: torch.Tensor, model: str, rows: str = "demos",
                    dtype: str = "float32") -> CalibratedEmbeddings:
        """From a Prompt and its calibrated embeddings [L, d]. rows: 'demos' (the perturbed rows [a, b)) or 'all'."""
        if rows not in ROW_CHOICES:
            raise SiclError(f"rows must be one of {ROW_CHOICES}, got {rows!r}")
        if dtype not in WIRE_DTYPES:
            raise SiclError(f"dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
        a, b = (prompt.demo_start, prompt.demo_end) if rows == "demos" else (0, prompt.length)
        return cls(rows=embeddings[a:b].to(WIRE_DTYPES[dtype][0]).contiguous(), row_start=a, row_end=b,
                   input_ids=prompt.input_ids.clone(), model=model, id=prompt.id)

    @property
    def dtype(self) -> str:
        return str(self.rows.dtype).replace("torch.", "")

    def full(self, embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The whole [L, d] prompt matrix: embed(input_ids) [L, d] (the model's input embedding layer) with the
        calibrated rows put in place. `embed` may be None when the rows already cover the whole prompt."""
        L = int(self.input_ids.numel())
        if self.row_start == 0 and self.row_end == L:
            return self.rows.clone()
        if embed is None:
            raise SiclError(f"embeddings {self.id!r}: rows [{self.row_start}, {self.row_end}) of {L}: pass the model's "
                            "input embedding layer to fill in the other rows")
        with torch.no_grad():
            X = embed(self.input_ids).to(self.rows.dtype).clone()
        X[self.row_start:self.row_end] = self.rows
        return X

    # --- JSON (base64) ---
    def to_json(self) -> dict[str, Any]:
        torch_dtype, np_dtype = WIRE_DTYPES[self.dtype]
        raw = self.rows.cpu().contiguous()
        arr = (raw.view(torch.int16) if torch_dtype == torch.bfloat16 else raw).numpy().astype(np_dtype, copy=False)
        return {"dtype": self.dtype, "shape": list(self.rows.shape), "row_start": self.row_start,
                "row_end": self.row_end, "byteorder": "little", "data": base64.b64encode(arr.tobytes()).decode("ascii"),
                "input_ids": self.input_ids.tolist(), "model": self.model, "id": self.id}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CalibratedEmbeddings:
        """Inverse of to_json; bit-exact. Raises SiclError on a malformed object."""
        try:
            torch_dtype, np_dtype = WIRE_DTYPES[obj["dtype"]]
            shape = [int(n) for n in obj["shape"]]
            raw = base64.b64decode(obj["data"], validate=True)
            arr = np.frombuffer(raw, dtype=np_dtype)
            if len(shape) != 2 or arr.size != shape[0] * shape[1]:
                raise ValueError(f"{len(raw)} bytes do not hold shape {shape} of {obj['dtype']}")
            t = torch.from_numpy(arr.astype(np_dtype[1:], copy=True)).reshape(shape)
            rows = t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t
            return cls(rows=rows, row_start=int(obj["row_start"]), row_end=int(obj["row_end"]),
                       input_ids=torch.tensor(obj["input_ids"], dtype=torch.int64), model=str(obj["model"]),
                       id=str(obj["id"]))
        except Exception as exc:  # noqa: BLE001 - whatever the object's values break (an inf row_end: OverflowError)
            raise SiclError(f"malformed embeddings object: {exc}") from None

    # --- safetensors ---
    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (through a temp file and a rename: never half a file)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        meta = {"format": FORMAT, "model": self.model, "id": self.id, "row_start": str(self.row_start),
                "row_end": str(self.row_end)}
        save_file({"embeddings": self.rows.cpu().contiguous(), "input_ids": self.input_ids.cpu().contiguous()},
                  str(tmp), metadata=meta)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibratedEmbeddings:
        from safetensors import SafetensorError
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise SiclError(f"embeddings file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise SiclError(f"not a sicl_fast embeddings file (format {meta.get('format')!r})")
                return cls(rows=fh.get_tensor("embeddings"), row_start=int(meta["row_start"]),
                           row_end=int(meta["row_end"]), input_ids=fh.get_tensor("input_ids"), model=meta["model"],
                           id=meta["id"])
        except (SafetensorError, KeyError, ValueError) as exc:
            raise SiclError(f"{path}: unreadable embeddings file: {exc}") from None


def save(path: str | os.PathLike, emb: CalibratedEmbeddings) -> Path:
    return emb.save(path)


def load(path: str | os.PathLike) -> CalibratedEmbeddings:
    return CalibratedEmbeddings.load(path)


def export_path(directory: str | os.PathLike, rid: str) -> Path:
    """The file of request `rid` in `directory`: DIR/<id>.safetensors when the id is a plain file name, else its
    safe characters and a hash of the id, so two ids never share a file."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", rid)[:100]
    if name != rid or name.startswith("."):
        name = f"{name}-{hashlib.sha256(rid.encode('utf-8')).hexdigest()[:12]}"
    return Path(directory) / f"{name}.safetensors"


def check_export_dir(directory: str | os.PathLike, ids: Iterable[str] = (),
                     inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Check the --export folder before any model is loaded (SiclError when it cannot be a writable folder, or when
    the file of one of the request `ids` would replace one of `inputs`: the results file, the requests file); it is
    made with its first file (CalibratedEmbeddings.save), so a run refused before then leaves none behind."""
    return check_out_dir(directory, "--export", "the embeddings files", make=False,
                         files=[export_path(directory, rid).name for rid in ids], inputs=inputs)


class ExportingWriter:
    """Wraps a results writer: a record whose "embeddings" is a CalibratedEmbeddings has them saved to
    export_path(directory, id) first (a whole file, then the record), and the record written holds the path."""

    def __init__(self, out, directory: str | os.PathLike) -> None:
        self.out = out
        self.directory = Path(directory).resolve()

    def write(self, record: dict) -> None:
        emb = record.get("embeddings")
        if isinstance(emb, CalibratedEmbeddings):
            record = {**record, "embeddings": str(emb.save(export_path(self.directory, emb.id)))}
        self.out.write(record)


def vllm_prompt_embeds(x: torch.Tensor) -> str:
    """A whole prompt matrix [L, d] as vLLM's Completions API takes it in "prompt_embeds": base64 of the bytes
    torch.save writes for the tensor."""
    if x.dim() != 2:
        raise SiclError(f"prompt embeddings must be [L, d], got shape {tuple(x.shape)}")
    buf = io.BytesIO()
    torch.save(x.detach().cpu().contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


__all__ = ["CalibratedEmbeddings", "FORMAT", "WIRE_DTYPES", "ROW_CHOICES", "save", "load", "vllm_prompt_embeds",
           "export_path", "check_export_dir", "ExportingWriter"]
