"""scripts/model_parts.py through its real command line: split, join, and join's refusals (a corrupt, a missing
and a short part), each leaving no DEST and no temp file behind. Standard library only; about a second."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_parts.py"
MIB = 1 << 20


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def refused(res: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2, one line on stderr naming `words`, no traceback."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def split(tmp_path):
    """A random 3.3 MiB file split with --part-mib 1: (original, parts folder, manifest path, manifest)."""
    src = tmp_path / "model.gguf"
    src.write_bytes(random.Random(0).randbytes(3 * MIB + 300_001))  # not a multiple of the part size
    parts = tmp_path / "parts"
    res = cli("split", src, parts, "--part-mib", 1)
    assert res.returncode == 0, res.stderr
    manifest = parts / "model.gguf.manifest.json"
    return src, parts, manifest, json.loads(manifest.read_text())


def test_split_then_join_gives_the_same_bytes(split, tmp_path):
    src, parts, manifest, m = split
    sizes = [p["size"] for p in m["parts"]]
    assert len(sizes) == 4 and max(sizes) <= MIB and sum(sizes) == src.stat().st_size == m["size"]
    assert max(sizes) - min(sizes) <= 3  # equal parts (the last one a few bytes short at most)
    assert sorted(f.name for f in parts.iterdir()) == sorted([manifest.name] + [p["name"] for p in m["parts"]])
    dest = tmp_path / "out" / "model.gguf"  # join makes the missing folder
    res = cli("join", manifest, parts, dest)
    assert res.returncode == 0, res.stderr
    assert dest.read_bytes() == src.read_bytes()
    assert "joined 4 parts" in res.stdout and m["sha256"][:12] in res.stdout
    again = cli("join", manifest, parts, dest)  # a second call (a retried device call) does nothing
    assert again.returncode == 0 and "already in place" in again.stdout


def test_a_corrupt_part_is_named_and_nothing_is_left(split, tmp_path):
    _, parts, manifest, m = split
    bad = parts / m["parts"][2]["name"]
    data = bytearray(bad.read_bytes())
    data[12345] ^= 0xFF  # same size, one byte changed: only the hash can tell
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    res = cli("join", manifest, parts, out / "model.gguf")
    refused(res, bad.name, "corrupt", "sha256")
    assert list(out.iterdir()) == []  # neither DEST nor the temp file it was being written to


def test_a_missing_part_is_named(split, tmp_path):
    _, parts, manifest, m = split
    (parts / m["parts"][1]["name"]).unlink()
    dest = tmp_path / "joined" / "model.gguf"  # not the fixture's source, which sits at tmp_path/model.gguf
    refused(cli("join", manifest, parts, dest), "missing part", m["parts"][1]["name"])
    assert not dest.exists()


def test_a_short_part_is_named(split, tmp_path):
    _, parts, manifest, m = split
    short = parts / m["parts"][3]["name"]
    short.write_bytes(short.read_bytes()[:-10])
    dest = tmp_path / "joined" / "model.gguf"  # not the fixture's source, which sits at tmp_path/model.gguf
    refused(cli("join", manifest, parts, dest), short.name, "bytes")
    assert not dest.exists()


def test_bad_manifest_and_bad_flags_are_one_line_errors(tmp_path):
    junk = tmp_path / "junk.manifest.json"
    junk.write_text('{"parts": [{"name": "../../etc/passwd"}]}')
    refused(cli("join", junk, tmp_path, tmp_path / "x"), "not a", "manifest")
    refused(cli("join", tmp_path / "none.json", tmp_path, tmp_path / "x"), "no such file")
    refused(cli("split", tmp_path / "none.gguf", tmp_path / "p"), "no such file")
    refused(cli("split", junk, tmp_path / "p", "--part-mib", "0"), "--part-mib")
