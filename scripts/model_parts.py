#!/usr/bin/env python3
"""Cut model files into parts small enough to carry to the GPU machine, and join them there.

The device tool copies the working tree plus at most 8 ignored paths, 64 MiB per call in all, so a GGUF model
(SmolLM2-135M: 94 MiB, Gemma 3 270M: 241 MiB) has to travel in several calls and be put back together on the
other side. docs/gpu_runbook.md has the whole sequence.

    split FILE OUTDIR [--part-mib 60]     parts OUTDIR/<name>.partNN + OUTDIR/<name>.manifest.json
    join MANIFEST PARTDIR DEST             check every part, join them, rename into DEST only when the whole
                                           file's sha256 matches (never a half-written or wrong DEST)
    stage MODEL OUTDIR [--part-mib 60]     find MODEL (smollm2, gemma3-270m, or a .gguf path) as sicl_fast loads
                                           it, split it into OUTDIR/call-NN/ folders (one per device call), put the
                                           gguf wheel into call-01, and print the carry plan

split and join use the standard library alone (join runs on the GPU machine before anything is installed there);
stage imports sicl_fast to ask it where the model is. Errors are one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # the device tool's limit for one call: working tree + carried paths
DEFAULT_PART_MIB = 60.0
MAX_CARRY_PATHS = 8
BLOCK = 1 << 20
FORMAT = "sicl_fast-model-parts/1"
MANIFEST_SUFFIX = ".manifest.json"
PLAN_FILE = "carry_plan.json"
REPO = Path(__file__).resolve().parents[1]
GPU_PYTHON = "3.12"  # the GPU machine image's python3: the wheel must install there
_SHA256 = re.compile(r"[0-9a-f]{64}")


class PartsError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------------- helpers


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    """Temp file beside `path`, then rename: a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1)
            fh.write("\n")
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _file_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp's temp files are 0600; parts and the joined model
    should read like any other file)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def part_sizes(size: int, max_bytes: int) -> list[int]:
    """Byte sizes of the parts of a `size`-byte file: as few parts as `max_bytes` allows, and those of equal size
    (the last may be smaller). Equal parts leave each device call the most room for the other carried files,
    at no cost in calls: 241 MiB at <= 60 MiB is 5 parts either way, but 5 x 48.3 MiB, not 4 x 60 + 1.4."""
    if max_bytes <= 0:
        raise PartsError("--part-mib must be > 0")
    n = max(1, math.ceil(size / max_bytes))
    each = math.ceil(size / n) if size else 0
    sizes = [each] * (n - 1) + [size - each * (n - 1)]
    return sizes


def part_name(file_name: str, index: int) -> str:
    return f"{file_name}.part{index:02d}"


# ---------------------------------------------------------------------------------------------------- split


def split_file(src: Path, outdir: Path, max_bytes: int) -> tuple[Path, dict]:
    """Cut `src` into parts in `outdir` and write its manifest last (so a split that stopped half-way has none).
    Returns (manifest path, manifest)."""
    if not src.is_file():
        raise PartsError(f"{src}: no such file")
    size = src.stat().st_size
    sizes = part_sizes(size, max_bytes)
    outdir.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    parts = []
    with src.open("rb") as fh:
        for i, want in enumerate(sizes):
            name = part_name(src.name, i)
            parts.append({"name": name, "size": want, "sha256": _copy_part(fh, want, outdir / name, whole)})
    manifest = {"format": FORMAT, "file": src.name, "size": size, "sha256": whole.hexdigest(),
                "part_bytes_max": max_bytes, "parts": parts}
    path = outdir / (src.name + MANIFEST_SUFFIX)
    write_json_atomic(path, manifest)
    return path, manifest


def _copy_part(fh, want: int, dest: Path, whole) -> str:
    """Copy the next `want` bytes of `fh` into `dest` (temp + rename); returns the part's sha256."""
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            left = want
            while left:
                block = fh.read(min(BLOCK, left))
                if not block:
                    raise PartsError(f"{fh.name} ended early (it changed while being split)")
                out.write(block)
                h.update(block)
                whole.update(block)
                left -= len(block)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, dest)
    except BaseException:
        _unlink(tmp)
        raise
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- join


def read_manifest(path: Path) -> dict:
    """The manifest, checked enough that join can trust its names, sizes and hashes."""
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PartsError(f"manifest {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise PartsError(f"manifest {path}: unreadable ({exc})") from None
    try:
        ok = (m["format"] == FORMAT and isinstance(m["size"], int) and _SHA256.fullmatch(m["sha256"])
              and isinstance(m["parts"], list) and m["parts"] and _plain_name(m["file"]))
        for p in m["parts"]:
            ok = ok and _plain_name(p["name"]) and isinstance(p["size"], int) and p["size"] >= 0 \
                 and _SHA256.fullmatch(p["sha256"])
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise PartsError(f"manifest {path}: not a {FORMAT} manifest (made by `model_parts.py split`)")
    if sum(p["size"] for p in m["parts"]) != m["size"]:
        raise PartsError(f"manifest {path}: its parts add up to {sum(p['size'] for p in m['parts'])} bytes, "
                         f"not the stated {m['size']}")
    return m


def _plain_name(name) -> bool:
    """A bare file name: a manifest must not make join read or write outside PARTDIR."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def join_parts(manifest_path: Path, partdir: Path, dest: Path) -> str:
    """Join the parts into `dest`; returns what was done. Every part is checked (presence and size first, its
    sha256 while it is copied); `dest` appears only, whole, once the whole file's sha256 matches."""
    m = read_manifest(manifest_path)
    if dest.is_dir():
        raise PartsError(f"DEST {dest} is a directory; give the file's path (e.g. {dest / m['file']})")
    if dest.is_file() and dest.stat().st_size == m["size"] and sha256_file(dest) == m["sha256"]:
        return f"{dest}: already in place ({mib(m['size'])}, sha256 {m['sha256'][:12]}... matches); nothing done"
    missing = [p["name"] for p in m["parts"] if not (partdir / p["name"]).is_file()]
    if missing:
        raise PartsError(f"missing part{'s' if len(missing) > 1 else ''} in {partdir}: {', '.join(missing)} "
                         f"({len(missing)} of {len(m['parts'])}; carry them first)")
    for p in m["parts"]:
        got = (partdir / p["name"]).stat().st_size
        if got != p["size"]:
            raise PartsError(f"part {p['name']} has {got} bytes, the manifest says {p['size']} "
                             f"(cut short in transit, or from another split)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".joining")
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in m["parts"]:
                h = hashlib.sha256()
                with (partdir / p["name"]).open("rb") as fh:
                    for block in iter(lambda: fh.read(BLOCK), b""):
                        out.write(block)
                        h.update(block)
                        whole.update(block)
                if h.hexdigest() != p["sha256"]:
                    raise PartsError(f"part {p['name']} is corrupt: sha256 {h.hexdigest()[:12]}..., the manifest "
                                     f"says {p['sha256'][:12]}...; {dest} not written")
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != m["sha256"]:  # only if the manifest itself is inconsistent
            raise PartsError(f"joined file has sha256 {whole.hexdigest()[:12]}..., the manifest says "
                             f"{m['sha256'][:12]}...; {dest} not written")
        os.chmod(tmp, _file_mode())
        os.replace(tmp, dest)
    except BaseException:
        _unlink(tmp)
        raise
    return (f"joined {len(m['parts'])} parts from {partdir} into {dest} ({mib(m['size'])}), "
            f"sha256 {m['sha256'][:12]}... matches")


# ---------------------------------------------------------------------------------------------------- stage


def model_gguf(model: str) -> tuple[str, Path]:
    """(display name, GGUF path) of MODEL, found by sicl_fast's own lookup (models.loading.resolve), so the
    staged file is the one sicl_fast would load (gemma3-270m: its four chunk packages assembled once)."""
    sys.path.insert(0, str(REPO))  # a checkout without `pip install -e .` still finds sicl_fast
    try:
        from sicl_fast.errors import SiclError
        from sicl_fast.models.loading import resolve
    except ImportError as exc:
        raise PartsError(f"stage needs sicl_fast importable (run it with the project's .venv/bin/python): "
                         f"{exc}") from None
    try:
        name, path, kind = resolve(model)
    except SiclError as exc:
        raise PartsError(str(exc)) from None
    if kind != "gguf":
        raise PartsError(f"{model!r} resolves to the model directory {path}, not a GGUF file; stage splits GGUF "
                         f"files only")
    return name, path


def pinned_requirement(package: str) -> str:
    """'gguf==0.19.0': the project's own pin from pyproject.toml, so the wheel matches what tests were run with."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    for dep in deps:
        if re.match(rf"{re.escape(package)}\s*==", dep):
            return dep.replace(" ", "")
    raise PartsError(f"pyproject.toml pins no {package}==VERSION dependency")


def fetch_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies: the GPU image has numpy, pyyaml, requests and tqdm) that installs on
    the GPU machine's Python; returns its path."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", GPU_PYTHON, "-d", str(dest), requirement]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PartsError(f"pip download {requirement} failed: {exc} (pass --no-wheel to stage without it)") from None
    wheels = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob(f"{requirement.split('==')[0]}-*.whl"))
    if res.returncode != 0 or not wheels:
        last = (res.stderr.strip().splitlines() or ["no wheel saved"])[-1]
        raise PartsError(f"pip download {requirement} failed: {last} (pass --no-wheel to stage without it)")
    return wheels[-1]


def tree_bytes(repo: Path) -> int | None:
    """Bytes of what travels with every call: tracked files plus untracked files git does not ignore.
    None where git cannot tell (then the plan cannot check the 64 MiB limit)."""
    try:
        res = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                             capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    total = 0
    for rel in res.stdout.decode("utf-8", "surrogateescape").split("\0"):
        if rel:
            try:
                total += (repo / rel).lstat().st_size
            except FileNotFoundError:  # tracked but deleted in the working tree: does not travel
                pass
    return total


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def carry_name(path: Path, repo: Path) -> str | None:
    """`path` relative to the repository root when it lies inside the repository and git ignores it (what the
    device tool's `carry` takes); None otherwise."""
    try:
        rel = path.resolve().relative_to(repo)
    except ValueError:
        return None
    res = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(rel)], capture_output=True)
    return str(rel) if res.returncode == 0 else None


def in_repo(path: Path, repo: Path) -> bool:
    try:
        path.resolve().relative_to(repo)
        return True
    except ValueError:
        return False


def prepare_outdir(outdir: Path) -> None:
    """OUTDIR empty, or a folder an earlier stage made (its call-NN folders are then replaced)."""
    if outdir.exists() and not outdir.is_dir():
        raise PartsError(f"OUTDIR {outdir} is a file")
    if outdir.is_dir() and any(outdir.iterdir()):
        if not (outdir / PLAN_FILE).is_file():
            raise PartsError(f"OUTDIR {outdir} is not empty and was not made by stage; give an empty folder")
        for old in outdir.glob("call-*"):
            shutil.rmtree(old)
        (outdir / PLAN_FILE).unlink()
    outdir.mkdir(parents=True, exist_ok=True)


def plan_calls(sizes: list[int], first_extra: int, last_extra: int, tree: int | None) -> list[int]:
    """Bytes each call carries in all (tree + its part + the wheel and manifest in call 1 + --also in the last);
    raises when one would pass the device tool's limit, with the --part-mib that would fit."""
    totals = []
    for i, size in enumerate(sizes):
        extra = (first_extra if i == 0 else 0) + (last_extra if i == len(sizes) - 1 else 0)
        totals.append((tree or 0) + size + extra)
    worst = max(range(len(sizes)), key=lambda i: totals[i])
    if totals[worst] >= CARRY_LIMIT:
        room = CARRY_LIMIT - (tree or 0) - first_extra - last_extra - MIB  # 1 MiB of slack for the tree growing
        hint = f"try --part-mib {max(room, 0) // MIB}" if room > MIB else "carry less beside the parts"
        raise PartsError(f"call {worst + 1} would carry {mib(totals[worst])} (tree {mib(tree or 0)}, part "
                         f"{mib(sizes[worst])}, other files {mib(totals[worst] - (tree or 0) - sizes[worst])}), "
                         f"over the 64 MiB limit; {hint}")
    return totals


def stage(model: str, outdir: Path, part_mib: float, also: list[Path], wheel: bool) -> dict:
    """Split MODEL's GGUF into OUTDIR/call-NN/, one folder per device call, and return the plan (also written to
    OUTDIR/carry_plan.json and printed by main)."""
    name, gguf = model_gguf(model)
    for a in also:
        if not a.exists():
            raise PartsError(f"--also {a}: no such file or folder")
        if carry_name(a, REPO) is None:
            raise PartsError(f"--also {a}: not an ignored path inside {REPO}, so it cannot be carried")
    if in_repo(outdir, REPO) and carry_name(outdir, REPO) is None:
        raise PartsError(f"OUTDIR {outdir} is inside the repository but git does not ignore it: it would travel "
                         f"with every call; use an ignored folder such as runs/gpu_carry/{model}")
    max_bytes = int(part_mib * MIB)
    sizes = part_sizes(gguf.stat().st_size, max_bytes)
    tree = tree_bytes(REPO)
    prepare_outdir(outdir)
    first = outdir / "call-01"
    first.mkdir()
    whl = fetch_wheel(pinned_requirement("gguf"), first) if wheel else None
    manifest_guess = 400 + 120 * len(sizes)  # the manifest is written after the split; its size is about this
    first_extra = (whl.stat().st_size if whl else 0) + manifest_guess
    last_extra = sum(path_bytes(a) for a in also)
    plan_calls(sizes, first_extra, last_extra, tree)  # refuse before copying anything large
    manifest_path, manifest = split_file(gguf, outdir, max_bytes)
    calls = []
    for i, part in enumerate(manifest["parts"]):
        folder = outdir / f"call-{i + 1:02d}"
        folder.mkdir(exist_ok=True)
        os.replace(outdir / part["name"], folder / part["name"])
        files = [part["name"]]
        if i == 0:
            os.replace(manifest_path, folder / manifest_path.name)
            files = [manifest_path.name] + files + ([whl.name] if whl else [])
        calls.append({"folder": folder, "files": files})
    totals = plan_calls([p["size"] for p in manifest["parts"]],
                        (whl.stat().st_size if whl else 0) + (first / manifest_path.name).stat().st_size,
                        last_extra, tree)
    plan = {
        "model": model, "name": name, "source": str(gguf), "file": manifest["file"], "size": manifest["size"],
        "sha256": manifest["sha256"], "manifest": manifest_path.name, "tree_bytes": tree,
        "wheel": ({"file": whl.name, "size": whl.stat().st_size, "sha256": sha256_file(whl)} if whl else None),
        "calls": [],
    }
    for i, (c, total) in enumerate(zip(calls, totals)):
        carry = [carry_name(c["folder"], REPO) or str(c["folder"].resolve())]
        if i == len(calls) - 1:
            carry += [carry_name(a, REPO) for a in also]
        plan["calls"].append({"carry": carry, "files": c["files"], "bytes": total})
    write_json_atomic(outdir / PLAN_FILE, plan)
    return plan


def render_plan(plan: dict, outdir: Path) -> str:
    """The plan as a person reads it: per call what to carry, its size against the limit, and what the call's
    command starts with on the GPU machine."""
    lines = [f"staged {plan['name']} ({plan['model']}): {plan['source']}",
             f"  {plan['file']}: {mib(plan['size'])}, sha256 {plan['sha256']}",
             f"  {len(plan['calls'])} parts in {outdir}/call-NN/, manifest {plan['manifest']} in call-01"]
    if plan["wheel"]:
        w = plan["wheel"]
        lines.append(f"  wheel {w['file']}: {w['size']} bytes ({mib(w['size'])}), sha256 {w['sha256'][:12]}..., "
                     f"in call-01")
    tree = plan["tree_bytes"]
    lines.append(f"  working tree (travels with every call): "
                 f"{mib(tree) if tree is not None else 'unknown (git failed): check it yourself'}")
    outside = not in_repo(outdir, REPO)
    if outside:
        lines.append(f"  NOTE: {outdir} is outside {REPO}: the device tool carries only ignored paths inside the "
                     f"repository; stage into e.g. runs/gpu_carry/{plan['model']} to carry these")
    lines.append("carry plan (one device call each, back to back: the machine is given back after ~30 s idle):")
    for i, c in enumerate(plan["calls"]):
        lines.append(f"  call {i + 1}: carry {json.dumps(c['carry'])}  {mib(c['bytes'])} of 64 MiB "
                     f"({mib(CARRY_LIMIT - c['bytes'])} spare): {', '.join(c['files'])}")
        lines.append(f"          first: mkdir -p /tmp/models && cp {c['carry'][0]}/* /tmp/models/")
    man = f"/tmp/models/{plan['manifest']}"
    dest = f"/tmp/models/{plan['file']}"
    lines.append(f"  then, in the last call: python3 scripts/model_parts.py join {man} /tmp/models {dest}; with "
                 f"SICL_FAST_MODELS=/tmp/models sicl_fast loads it as --model {plan['model']}"
                 + (" (and as the default model)" if plan["model"] == "smollm2" else ""))
    if plan["wheel"]:
        lines.append(f"  and (call 1) install the wheel: python3 -m pip install -q --no-index --no-deps --target "
                     f"/tmp/site /tmp/models/{plan['wheel']['file']}; export PYTHONPATH=/tmp/site in every call")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit 2, like every other error here."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="model_parts.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    s = sub.add_parser("split", help="cut FILE into parts with a manifest")
    s.add_argument("file", type=Path)
    s.add_argument("outdir", type=Path)
    s.add_argument("--part-mib", type=_positive_float, default=DEFAULT_PART_MIB,
                   help=f"largest part in MiB (default {DEFAULT_PART_MIB:g}: one part plus the working tree and a "
                        f"little more fit in one 64 MiB call); parts are made equal in size")
    j = sub.add_parser("join", help="check the parts and join them into DEST")
    j.add_argument("manifest", type=Path)
    j.add_argument("partdir", type=Path)
    j.add_argument("dest", type=Path)
    st = sub.add_parser("stage", help="split a model's GGUF into per-call folders and print the carry plan")
    st.add_argument("model", help="smollm2, gemma3-270m, or a .gguf path (resolved by sicl_fast)")
    st.add_argument("outdir", type=Path, help="an ignored folder inside the repository, e.g. runs/gpu_carry/smollm2")
    st.add_argument("--part-mib", type=_positive_float, default=DEFAULT_PART_MIB,
                    help=f"largest part in MiB (default {DEFAULT_PART_MIB:g})")
    st.add_argument("--also", type=Path, action="append", default=[], metavar="PATH",
                    help="an ignored path inside the repository to carry with the last part (e.g. the ICLEval "
                         "data copied to runs/icleval_data); counted in the plan")
    st.add_argument("--no-wheel", dest="wheel", action="store_false",
                    help="do not download the gguf wheel into call-01")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "split":
            path, m = split_file(args.file, args.outdir, int(args.part_mib * MIB))
            print(f"split {args.file} ({mib(m['size'])}) into {len(m['parts'])} parts of at most "
                  f"{mib(max(p['size'] for p in m['parts']))} in {args.outdir}; manifest {path}")
        elif args.cmd == "join":
            print(join_parts(args.manifest, args.partdir, args.dest))
        else:
            if len(args.also) + 1 > MAX_CARRY_PATHS:
                raise PartsError(f"a call carries at most {MAX_CARRY_PATHS} paths: give fewer --also")
            plan = stage(args.model, args.outdir, args.part_mib, args.also, args.wheel)
            print(render_plan(plan, args.outdir))
    except PartsError as exc:
        print(f"model_parts.py {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a permission: still one line
        print(f"model_parts.py {args.cmd}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = {"join": "DEST untouched", "split": "no manifest written", "stage": "re-run stage"}[args.cmd]
        print(f"model_parts.py {args.cmd}: interrupted; {kept}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
