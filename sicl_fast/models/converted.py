"""The converted-model cache: a GGUF file de-quantized once into an ordinary transformers folder, checked on every
load, moved aside and rebuilt when it is damaged, written whole or not at all, safe for processes converting at
once.

    cache_dir()                             SICL_FAST_CACHE (an absolute path; unset, empty or blank: the
                                            default), default ~/.cache/sicl_fast
        sources.json                        the sha256 of each source GGUF, remembered against (path, size, mtime)
        <ASSEMBLED file>.gguf               a GGUF assembled from packages (gemma3-270m's four chunks)
        converted/<stem>-<key>/             config.json, model.safetensors, tokenizer files, MANIFEST
        converted/.<key>.lock               the conversion lock of one source (flock); .<file>.lock: an assembly's
        converted/.tmp-<key>-XXXX/          a conversion being written (renamed into place when whole)
        converted/.bad/<entry>-<time>-<pid>/  entries found damaged, moved aside (`sicl-fast cache clear` frees them)
        plans/<key>.json                    the run plans engines made after their loads, recalled by resumes before
                                            theirs (sicl_fast.run.planned, the newest 64; .<key>.<pid>.tmp: one being
                                            written)

key: a digest of the source's content and CACHE_VERSION, not of its path, so every checkout, virtual environment
and copy of one file shares one entry. MANIFEST records, for every file written, its size, its sha256 and a
sample digest, and for every tensor of the model its tensor_sums. A load checks sizes and sample digests (files
under FULL_BELOW bytes whole; larger ones the first and last SAMPLE_HEAD bytes and SAMPLE_BLOCK bytes of every
SAMPLE_STRIDE, so any damage of SAMPLE_STRIDE bytes or more in a row, and any change of size, is found in ~1/16 of
the reading), then the sums of every tensor as loaded: any change to any weight's bytes is found (~0.1 s for
SmolLM2's 538 MB: the tensors are in memory by then). `verify(entry, full=True)` (`sicl-fast cache verify`) checks
every byte against the sha256. An entry whose manifest has no tensor sums (written by a version before them) is
checked in full once and gets them.

Concurrency: a conversion holds the source's lock; a process that waited for it finds the winner's entry, checks
it and uses it. Temporary folders are removed whatever happens (and, under the lock, any left by a killed run).

Ownership: the cache's folder may hold other things (SICL_FAST_CACHE can name any folder). `entries()` (and so
`cache list`, `verify` and `clear`) sees only what the cache writes, recognised by its names above (a key is 16
hex digits) and, for sources.json, by its content; nothing else in the folder is listed or ever deleted.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable, Iterator, Mapping

import torch

from ..errors import SiclError, SiclWarning, first_line
from ..formats.inputs import describe_missing, env_path, json_value

CACHE_VERSION = 3  # bump when the conversion changes (v2: own SentencePiece-BPE tokenizer builder; v3: content key)
MANIFEST = ".sicl_fast_manifest.json"
SOURCES = "sources.json"
FULL_BELOW = 16 << 20  # files smaller than this are hashed whole on every load (config, tokenizer, small models)
SAMPLE_HEAD = 64 << 10  # the safetensors header and the first tensors, and the file's end
SAMPLE_BLOCK = 4 << 10
SAMPLE_STRIDE = 64 << 10

CACHE_ENV = "SICL_FAST_CACHE"
# GGUF files the cache assembles from packages (sicl_fast.models.loading), by short name: besides sources.json the
# only files it writes at the top of its folder
ASSEMBLED = {"gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}
# the names of what the cache writes (module docstring): nothing else is listed or deleted
_KEY = r"[0-9a-f]{16}"
ENTRY_NAME = re.compile(rf".+-{_KEY}")  # converted/<stem>-<key> (and an older version's, without a manifest)
UNFINISHED_NAME = re.compile(rf"\.tmp-{_KEY}-.+")  # converted/.tmp-<key>-XXXX
MOVED_NAME = re.compile(rf".+-{_KEY}-\d{{8}}-\d{{6}}-\d+")  # converted/.bad/<entry>-<date>-<time>-<pid>
PLANS = "plans"
PLAN_NAME = re.compile(rf"{_KEY}\.json|\.{_KEY}\.\d+\.tmp")  # plans/<key>.json, plans/.<key>.<pid>.tmp (being written)

T = TypeVar("T")


def cache_dir() -> Path:
    """The cache's folder: SICL_FAST_CACHE made absolute, or ~/.cache/sicl_fast when it is unset, empty or blank (an
    empty value never means the current folder: sicl_fast.formats.inputs.env_path)."""
    return env_path(CACHE_ENV) or Path.home() / ".cache" / "sicl_fast"


def converted_dir() -> Path:
    return cache_dir() / "converted"


def _bad_dir() -> Path:
    return converted_dir() / ".bad"


def check_cache_dir() -> Path:
    """cache_dir(), refused (SiclError) when it or its converted/ is there but is not a folder: a file, a dangling
    link, a link loop. A folder that does not exist yet is an empty cache. `cache list|verify|clear|path` call it;
    a model load does not (a cache it cannot use costs only speed, with a warning)."""
    for d in (cache_dir(), converted_dir()):
        if d.is_symlink() and not d.exists():
            problem = describe_missing(d)
        elif d.exists() and not d.is_dir():
            problem = "is a file, not a folder"
        else:
            continue
        named = f" (from {CACHE_ENV})" if env_path(CACHE_ENV) is not None else ""
        raise SiclError(f"model cache {d}{named}: {problem}; point {CACHE_ENV} at a folder (or unset it for "
                        "~/.cache/sicl_fast)")
    return cache_dir()


# ------------------------------------------------------------------------------------------------ digests


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sample_digest(path: Path) -> str:
    """The load-time digest of a file: its sha256 when smaller than FULL_BELOW, else a digest of its first and last
    SAMPLE_HEAD bytes and SAMPLE_BLOCK bytes at every SAMPLE_STRIDE between (module docstring)."""
    size = path.stat().st_size
    if size < max(FULL_BELOW, 2 * SAMPLE_HEAD):
        return file_sha256(path)
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as fh:
        fd = fh.fileno()
        h.update(os.pread(fd, SAMPLE_HEAD, 0))
        for off in range(SAMPLE_HEAD, size - SAMPLE_HEAD, SAMPLE_STRIDE):
            h.update(os.pread(fd, SAMPLE_BLOCK, off))
        h.update(os.pread(fd, SAMPLE_HEAD, size - SAMPLE_HEAD))
    return "sample:" + h.hexdigest()


def tensor_sums(t: torch.Tensor) -> list[int]:
    """Two checksums of a tensor's bytes, read as int64 words w[i] (and its last nbytes % 8 bytes as words of one
    byte): [sum of w[i], sum of i * w[i]], both modulo 2**64 (int64 sums wrap). Any change to one word changes the
    first; two words swapped change the second. Computed as a [m, 1024] matrix's row and column sums (i = 1024 r +
    c): whole-tensor int64 reductions at memory speed, with no temporary the size of the tensor."""
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    n8 = b.numel() // 8
    words = b[:n8 * 8].view(torch.int64)
    k = 1024
    m = n8 // k
    block = words[:m * k].view(m, k)
    tail = torch.cat([words[m * k:], b[n8 * 8:].to(torch.int64)])
    first = block.sum() + tail.sum()
    second = (block.sum(1) * torch.arange(m)).sum() * k + (block.sum(0) * torch.arange(k)).sum() \
        + (tail * torch.arange(m * k, m * k + tail.numel())).sum()
    return [int(first), int(second)]


def _read_json(path: Path) -> dict:
    try:
        obj = json_value(path.read_bytes(), str(path))
    except (OSError, SiclError):  # missing, or damaged (nesting too deep for the parser among it): remade
        return {}
    return obj if isinstance(obj, dict) else {}


def _write_json_atomic(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def source_digest(path: Path) -> str:
    """sha256 of a source file, computed once and remembered in sources.json against its resolved path, size and
    mtime (a changed file is hashed again). A cache that cannot be written only costs the next call a rehash."""
    st = path.stat()
    memo_path = cache_dir() / SOURCES
    memo = _read_json(memo_path)
    key = str(path.resolve())
    rec = memo.get(key)
    if isinstance(rec, dict) and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns \
            and isinstance(rec.get("sha256"), str):
        return rec["sha256"]
    digest = file_sha256(path)
    memo = _read_json(memo_path)  # another process may have added its own since
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(memo_path, memo)
    return digest


def content_key(source: Path) -> str:
    """The cache key of a source file: its content and CACHE_VERSION."""
    return hashlib.sha256(f"{source_digest(source)}|{CACHE_VERSION}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ entries


def find_entry(key: str) -> Path | None:
    """The entry of a key (whatever the source file was called when it was converted), or None."""
    d = converted_dir()
    found = sorted(p for p in d.glob(f"*-{key}") if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else []
    return found[0] if found else None


def _write_manifest(folder: Path, source: Path, sums: dict[str, list[int]]) -> None:
    files = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            files[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": file_sha256(f),
                                                       "sample": sample_digest(f)}
    manifest = {"version": CACHE_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "source": {"name": source.name, "sha256": source_digest(source), "size": source.stat().st_size},
                "files": files, "tensors": sums}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def manifest(entry: Path) -> dict | None:
    """An entry's manifest, or None when it has none or it cannot be read."""
    m = _read_json(entry / MANIFEST)
    return m if isinstance(m.get("files"), dict) else None


def verify(entry: Path, full: bool = False) -> str | None:
    """What is wrong with an entry (a phrase completing "ENTRY ..."), or None when every file the manifest lists
    is there with its size and digest (the sample digest; with full, the sha256 of every byte)."""
    m = manifest(entry)
    if m is None:
        what = "is unreadable" if (entry / MANIFEST).exists() else "is missing"
        return f"has no usable manifest (it {what}: an unfinished conversion, or one by an older sicl_fast)"
    files = m["files"]
    if "config.json" not in files or not any(n.endswith(".safetensors") for n in files):
        return "has a manifest without config.json or weights"
    for name, rec in files.items():
        f = entry / name
        try:
            size = f.stat().st_size
        except OSError:
            return f"is missing {name}"
        if size != rec.get("size"):
            return f"has a {name} of {size} bytes where {rec.get('size')} were written (truncated or overwritten)"
        got = file_sha256(f) if full else sample_digest(f)
        if got != rec.get("sha256" if full else "sample"):
            return f"has a {name} that differs from what was written (checksum mismatch)"
    return None


def _open_checked(entry: Path, open_folder: Callable[[Path], T], tensors: Callable[[T], Mapping[str, torch.Tensor]],
                  upgrade: bool) -> tuple[T | None, str | None]:
    """(open_folder(entry), None) when the entry's files pass verify and its tensors as loaded match the manifest's
    tensor_sums, else (None, what is wrong). An entry without tensor sums (an older version's) is checked in full
    and, with upgrade (the key's lock held), gets them; without upgrade it is left to the caller that holds it."""
    m = manifest(entry)
    recorded = m.get("tensors") if m is not None else None
    if recorded is None and not upgrade:
        return None, "has no tensor checksums"
    problem = verify(entry, full=recorded is None)
    if problem is not None:
        return None, problem
    result = open_folder(entry)
    loaded = tensors(result)
    if recorded is None:
        with contextlib.suppress(OSError):  # not recorded: the next load checks in full again
            _write_json_atomic(entry / MANIFEST, {**m, "tensors": {n: tensor_sums(t) for n, t in loaded.items()}})
        return result, None
    if set(loaded) != set(recorded):
        return None, f"loads other tensors than were written ({len(loaded)} against {len(recorded)})"
    for name, t in loaded.items():
        if tensor_sums(t) != recorded[name]:
            return None, f"has a tensor {name} that differs from what was written (checksum mismatch)"
    return result, None


def _move_aside(entry: Path) -> tuple[Path | None, str | None]:
    """Move a damaged entry to converted/.bad/ (kept for inspection; `sicl-fast cache clear` frees it): (where it
    went, None), or (None, why it could not: .bad is a file, no permission), the entry left where it is."""
    bad = _bad_dir()
    dest = bad / f"{entry.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        bad.mkdir(parents=True, exist_ok=True)
        os.rename(entry, dest)
    except OSError as exc:
        return None, f"could not move it to {bad} ({exc.strerror or exc})"
    return dest, None


@contextlib.contextmanager
def _lock(key: str, wait: bool = True) -> Iterator[bool]:
    """Hold the conversion lock of a key; yields False when the cache cannot be written (or, without wait, when
    another process holds the lock)."""
    try:
        converted_dir().mkdir(parents=True, exist_ok=True)
        fh = open(converted_dir() / f".{key}.lock", "a+b")
    except OSError:
        yield False
        return
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            yield False
            return
        yield True


def warn_moved_aside(entry: Path, problem: str, dest: Path | None, source: Path, stacklevel: int = 2,
                     kept: str | None = None) -> None:
    """The one line a damaged entry gets when it is moved aside (to dest) and its source is converted again; or, when
    it could not be moved (dest None, kept: why), that it stays and the source is converted without caching."""
    done = (f"moved it to {dest} and converting {source.name} again" if dest is not None else
            f"{kept}: it stays in place, and {source.name} is converted again without caching it (remove it with "
            "`sicl-fast cache clear` to cache it again)")
    warnings.warn(f"model cache: {entry} {problem}; {done}", SiclWarning, stacklevel=stacklevel + 1)


def _remove_unfinished(key: str) -> None:
    """Temporary folders of this key left by a killed conversion (only called with the key's lock held, so none
    of them is being written)."""
    for d in converted_dir().glob(f".tmp-{key}-*"):
        shutil.rmtree(d, ignore_errors=True)


def load_cached(source: Path, convert: Callable[[], T], save: Callable[[T, Path], None],
                open_folder: Callable[[Path], T], tensors: Callable[[T], Mapping[str, torch.Tensor]]) -> T:
    """What `convert()` makes of `source`, through the cache: open_folder(entry) when a verified entry exists, else
    convert() and save(result, folder) into a new entry (module docstring); tensors(result) are the weights whose
    tensor_sums the manifest records. A damaged entry is moved aside with one warning and rebuilt; a cache that
    cannot be written costs the next load its speed, with one warning."""
    key = content_key(source)
    entry = find_entry(key)
    if entry is not None:
        with contextlib.suppress(Exception):  # any failure is looked at again under the lock below
            result, problem = _open_checked(entry, open_folder, tensors, upgrade=False)
            if problem is None:
                return result
    with _lock(key) as locked:
        if not locked:
            warnings.warn(f"model cache: cannot write to {converted_dir()}; converting {source.name} without caching "
                          "it (every load converts again)", SiclWarning, stacklevel=3)
            return convert()
        _remove_unfinished(key)
        entry = find_entry(key)  # a process that held the lock before us may have made it
        if entry is not None:
            try:
                result, problem = _open_checked(entry, open_folder, tensors, upgrade=True)
            except Exception as exc:  # noqa: BLE001 - transformers raises many types on a bad folder
                problem = f"does not load ({first_line(exc)})"
            if problem is None:
                return result
            dest, kept = _move_aside(entry)
            warn_moved_aside(entry, problem, dest, source, stacklevel=3, kept=kept)
            if dest is None:  # the damaged entry holds its place: nothing can be published over it
                return convert()
        result = convert()
        sums = {name: tensor_sums(t) for name, t in tensors(result).items()}
        _publish(converted_dir() / f"{source.stem}-{key}", key, source, lambda folder: save(result, folder), sums)
        return result


def _publish(target: Path, key: str, source: Path, write: Callable[[Path], None], sums: dict[str, list[int]]) -> None:
    """Write an entry into a temporary folder, add its manifest and rename it into place (whole or not at all);
    the temporary folder is removed in every case."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=converted_dir()))
        write(tmp)
        _write_manifest(tmp, source, sums)
        os.rename(tmp, target)
    except Exception as exc:  # noqa: BLE001 - a full disk or a save error: the converted model is still returned
        warnings.warn(f"model cache: could not store {source.name} converted in {converted_dir()} "
                      f"({first_line(exc)}); the next load converts it again", SiclWarning, stacklevel=4)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename


# ------------------------------------------------------------------------------------------------ for users


@dataclass(frozen=True)
class Entry:
    """One thing the cache wrote: path, bytes on disk, the source it was made from (None: unknown), its state:
    'converted', 'no manifest' (an older version's or unfinished), 'unfinished' (a killed conversion's or
    assembly's temporary), 'moved aside' (found damaged), 'source' (a GGUF assembled from packages); and lock, the
    key whose lock guards it (None: none), which `clear` takes without waiting."""

    path: Path
    size: int
    source: str | None
    state: str
    lock: str | None = None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _own(path: Path, name: re.Pattern, folder: bool = True) -> bool:
    """Is `path` something the cache wrote: a real folder (or file) with one of its names (module docstring)? A
    link is never the cache's: it makes none."""
    kind = path.is_dir() if folder else path.is_file()
    return kind and not path.is_symlink() and name.fullmatch(path.name) is not None


def _converted_entries() -> Iterator[Entry]:
    d = converted_dir()
    if not d.is_dir():
        return
    for p in sorted(d.iterdir()):
        if _own(p, UNFINISHED_NAME):
            yield Entry(p, _size(p), None, "unfinished", key_of_entry(p))
        elif _own(p, ENTRY_NAME):
            m = manifest(p)
            yield Entry(p, _size(p), m["source"].get("name") if m else None, "converted" if m else "no manifest",
                        key_of_entry(p))
    bad = _bad_dir()
    if bad.is_dir() and not bad.is_symlink():
        yield from (Entry(p, _size(p), None, "moved aside") for p in sorted(bad.iterdir()) if _own(p, MOVED_NAME))


def plans_dir() -> Path:
    """The folder of the remembered run plans (sicl_fast.run.planned), in the cache's folder."""
    return cache_dir() / PLANS


def _plan_entries() -> Iterator[Entry]:
    folder = plans_dir()
    if folder.is_dir() and not folder.is_symlink():
        yield from (Entry(p, _size(p), None, "plan") for p in sorted(folder.iterdir()) if _own(p, PLAN_NAME, False))


def _source_entries() -> Iterator[Entry]:
    root = cache_dir()
    for name in ASSEMBLED.values():
        p = root / name
        if _own(p, re.compile(re.escape(name)), folder=False):
            yield Entry(p, _size(p), p.name, "source", name)
        part = re.compile(rf"\.{re.escape(name)}\..+\.part")  # a killed assembly's temporary
        if root.is_dir():
            yield from (Entry(t, _size(t), name, "unfinished", name) for t in sorted(root.iterdir())
                        if _own(t, part, folder=False))


def entries() -> list[Entry]:
    """Everything the cache wrote (module docstring: nothing else in its folder), converted entries first.
    Raises SiclError when the cache's folder is not one (check_cache_dir)."""
    check_cache_dir()
    return [*_converted_entries(), *_source_entries(), *_plan_entries()]


def key_of_entry(entry: Path) -> str:
    """The key in an entry's name (<stem>-<key>) or a temporary folder's (.tmp-<key>-XXXX)."""
    if entry.name.startswith(".tmp-"):
        return entry.name[len(".tmp-"):].split("-", 1)[0]
    return entry.name.rsplit("-", 1)[-1]


def _is_memo(path: Path) -> bool:
    """Is `path` the cache's sources.json: a file holding a JSON object of {"size", "mtime_ns", "sha256"} records
    (what source_digest writes), not a file of the same name that someone else put there?"""
    if not path.is_file() or path.is_symlink():
        return False
    memo = _read_json(path)
    return bool(memo) and all(isinstance(r, dict) and {"size", "mtime_ns", "sha256"} <= r.keys()
                              for r in memo.values())


@contextlib.contextmanager
def assembling(name: str) -> Iterator[bool]:
    """Hold the lock of the source file `name` the cache assembles (ASSEMBLED; yields False when the cache cannot
    be written): one assembly at a time, `clear` leaves it alone meanwhile, and the temporaries of a killed
    assembly (.NAME.*.part) are removed first."""
    with _lock(name) as locked:
        if locked:
            part = re.compile(rf"\.{re.escape(name)}\..+\.part")
            for t in cache_dir().iterdir():
                if _own(t, part, folder=False):
                    t.unlink(missing_ok=True)
        yield locked


def verify_entries(only: Path | None = None, full: bool = True
                   ) -> list[tuple[Path, str | None, Path | None, str | None]]:
    """Check every converted entry (or the one at `only`) and move the damaged ones aside: (entry, problem or
    None, where it went or None, why a damaged one could not be moved or None). Entries without a manifest (made by
    an older version) are reported, not moved: nothing loads them."""
    results = []
    for e in entries():
        if e.state not in ("converted", "no manifest") or (only is not None and e.path != only):
            continue
        problem = verify(e.path, full=full)
        dest = kept = None
        if problem is not None and e.state == "converted":
            with _lock(key_of_entry(e.path)) as locked:
                if not locked:
                    kept = f"could not move it: the cache in {converted_dir()} cannot be written"
                elif e.path.exists() and verify(e.path, full=full) is not None:
                    dest, kept = _move_aside(e.path)
        results.append((e.path, problem, dest, kept))
    return results


def clear(only: Path | None = None) -> tuple[list[Path], int, list[Path]]:
    """Remove everything the cache wrote (entries(); or only the entry `only`), and its sources.json when it is
    the cache's own (_is_memo): (removed, bytes freed, skipped because a conversion or assembly holds their lock).
    Nothing else in the folder is touched."""
    removed, skipped, freed = [], [], 0
    for e in entries():
        if only is not None and e.path != only:
            continue
        with contextlib.ExitStack() as held:
            if e.lock is not None and not held.enter_context(_lock(e.lock, wait=False)):
                skipped.append(e.path)
                continue
            if e.path.is_dir():
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                e.path.unlink(missing_ok=True)
        removed.append(e.path)
        freed += e.size
    memo = cache_dir() / SOURCES
    if only is None and _is_memo(memo):
        memo.unlink(missing_ok=True)
    if only is None:
        with contextlib.suppress(OSError):  # plans/ empty now, unless it holds something else (kept, with it)
            plans_dir().rmdir()
    return removed, freed, skipped


__all__ = ["cache_dir", "converted_dir", "content_key", "source_digest", "find_entry", "verify", "load_cached",
           "entries", "Entry", "verify_entries", "warn_moved_aside", "clear", "check_cache_dir", "assembling",
           "ASSEMBLED", "CACHE_ENV", "plans_dir", "file_sha256", "sample_digest", "tensor_sums", "CACHE_VERSION",
           "MANIFEST"]
