"""scripts/setup.sh skips a set-up that is current (its stamp) and redoes one that is not, on a copy of the files it
hashes with a stand-in .venv (the install itself is never run here: a redo fails at once on the missing activate)."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CURRENT = "setup current"


def sources_hash(root: Path) -> str:
    """The stamp's hash: pyproject.toml, setup.py, scripts/setup.sh, then csrc/ files in byte order of their paths."""
    files = [root / "pyproject.toml", root / "setup.py", root / "scripts" / "setup.sh"]
    files += sorted((p for p in (root / "csrc").rglob("*") if p.is_file()), key=lambda p: str(p.relative_to(root)))
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


@pytest.fixture
def checkout(tmp_path):
    """The hashed files, a stand-in .venv/bin/python, a built extension and the stamp of an install with Ray."""
    for name in ("pyproject.toml", "setup.py", "scripts/setup.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    (tmp_path / "sicl_fast" / "ops").mkdir(parents=True)
    (tmp_path / "sicl_fast" / "ops" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / ".venv" / "sicl-setup.stamp").write_text(
        f"sources {sources_hash(tmp_path)}\ngemma3 0\nray 1\nextension built\n")
    return tmp_path


def setup(root: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=root, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(root), **env})


def test_current_setup_is_skipped(checkout):
    for env in ({}, {"SICL_RAY": "1"}):  # what the last install had, or less
        run = setup(checkout, **env)
        assert run.returncode == 0 and CURRENT in run.stdout, run.stderr


@pytest.mark.parametrize("change", ["csrc", "pyproject", "option", "extension gone", "extension at its old path",
                                    "force", "no stamp"])
def test_stale_setup_is_redone(checkout, change):
    env = {}
    if change == "csrc":
        next(p for p in (checkout / "csrc").rglob("*") if p.is_file()).write_text("// changed\n")
    elif change == "pyproject":
        with (checkout / "pyproject.toml").open("a") as fh:
            fh.write("\n# changed\n")
    elif change == "option":
        env = {"SICL_GEMMA3": "1"}  # the last install did not have the Gemma 3 packages
    elif change == "extension gone":
        next((checkout / "sicl_fast" / "ops").glob("_C.*.so")).unlink()
    elif change == "extension at its old path":  # built before it moved to sicl_fast.ops (issue #54): not current
        built = next((checkout / "sicl_fast" / "ops").glob("_C.*.so"))
        built.rename(checkout / "sicl_fast" / built.name)
    elif change == "force":
        env = {"SICL_SETUP_FORCE": "1"}
    else:
        (checkout / ".venv" / "sicl-setup.stamp").unlink()
    run = setup(checkout, **env)
    assert CURRENT not in run.stdout and run.returncode != 0  # it went on to install (and failed at activate)
    assert run.stdout.startswith("setting up .venv:") and "a few minutes" in run.stdout  # not minutes of silence
    assert not (checkout / ".venv" / "sicl-setup.stamp").exists()  # a redo that fails leaves no stamp
