"""Result files: JSONL, one whole record a line, resumable.

A record is written with a single write() of a complete line and flushed, so a crash can leave at most one
partial last line; on reopening, that partial line is cut off and the ids already done are skipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from .errors import SiclError


class ResultWriter:
    """Append-only JSONL with resume. `key(record)` gives the identity used to skip finished work."""

    def __init__(self, path: str | os.PathLike, key: Callable[[dict], object] = lambda r: r["id"]) -> None:
        self.path = Path(path)
        self.key = key
        self.done: set = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._recover()
        self._fh = self.path.open("a", encoding="utf-8")

    def _recover(self) -> None:
        data = self.path.read_bytes()
        good = 0  # byte length of the complete, parseable prefix
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            self.done.add(self.key(rec))
            good += len(line)
        if good != len(data):
            with self.path.open("r+b") as fh:  # drop a partial last line left by a crash
                fh.truncate(good)

    def __contains__(self, key) -> bool:
        return key in self.done

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.done.add(self.key(record))

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(path: str | os.PathLike) -> list[dict]:
    """All complete records of a JSONL results file."""
    path = Path(path)
    if not path.is_file():
        raise SiclError(f"results file not found: {path}")
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SiclError(f"{path}:{lineno}: invalid JSON record: {exc}") from None
    return out


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temp file and rename: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def proxy_record(prompt, out) -> dict:
    """The proxy of a prompt's own embeddings (`ProxyOut` of one row) as one JSON record: the `proxy` command's
    lines and the server's POST /v1/proxy reply."""
    return {"id": prompt.id, "proxy": float(out.f[0]), "C": float(out.C[0]), "R": float(out.R[0]),
            "G": float(out.G[0]), "num_demos": prompt.num_demos, "token_spans": [list(s) for s in prompt.token_spans]}


__all__ = ["ResultWriter", "read_records", "write_json_atomic", "proxy_record"]
