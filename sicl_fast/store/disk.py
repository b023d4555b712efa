"""DiskStore: calibrations on disk, shared by processes (server workers, Ray actors, reruns).

    DIR/entries/<k[:2]>/<key>.safetensors   tensors "rows" [n, d] float32 and "input_ids" [n] int64
    DIR/entries/<k[:2]>/<key>.json          the sidecar: format, key, meta (Calibration.meta), the sha256 and size
                                            of the safetensors file, and "sha256", the checksum of all those
    DIR/locks/<key>.lock                    flock'ed while a process reads, writes or computes that key
    DIR/corrupt/                            entries that failed their checks, moved aside with a time stamp

The folders are checked when a DiskStore opens and made with its first lookup, so a run refused before any lookup
leaves none behind.

Writes are atomic: each file is written to a temporary name in its folder (<key>.safetensors.XXXX.tmp,
<key>.json.XXXX.tmp), flushed to disk and renamed, the tensors first and the sidecar last, so a reader sees a whole
entry or none. A temporary left by a killed writer is removed by the next process that holds its key's lock: a
read of that key, or the sweep a DiskStore makes when it opens (of every key no one holds). Every access to a key
holds its lock (`lock(key)`): a second process asking for a key that another computes waits for it and then reads
it (single flight across processes; a waiter with a should_stop hook polls the lock and gives up when the hook
fires); nobody reads a sidecar and the tensors of two different writes. A read checks the sidecar's fields and their
types, both checksums, the format, the metadata's fields and their types (entry.meta_problem) and the shapes, then
what it would serve against what the lookup expects (entry.Expected: the prompt's token ids and rows, the model's
width, every number finite); an entry failing any check is reported once (a SiclWarning and the log, saying what was
done), moved to corrupt/ and treated as missing, so it is recomputed and never used. One that cannot be moved
(corrupt/ replaced by a file, no permission) is left in place, said so, read as missing and not overwritten by this
process, so that it stays for inspection.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import SiclWarning, require
from ..formats.inputs import json_value
from ..formats.records import check_out_dir
from .entry import Calibration, Expected, fields_problem, meta_problem
from .wait import wait

log = logging.getLogger("sicl_fast.store")

FORMAT = "sicl_fast.calibration.v2"  # v2: one checksum over the whole sidecar


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _take(fd: int, timeout: float | None) -> bool:
    """Take the exclusive flock of fd: blocking (timeout None), else one try and, when held elsewhere, a sleep of
    timeout seconds before saying False."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        time.sleep(timeout)
        return False


def _identity(path: Path) -> tuple | None:
    """What tells one file at `path` from another written there later: inode, size, modification time (None: no
    file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class CorruptEntry(Exception):
    """An entry failed a check (the message says which)."""


# every field of a sidecar and its JSON type; "sha256" is the checksum of all the others (canonical JSON)
SIDECAR = {"format": str, "key": str, "meta": dict, "tensors_sha256": str, "tensors_bytes": int, "sha256": str}


def sidecar_sha256(side: dict) -> str:
    """The checksum of a sidecar: every field but "sha256" itself."""
    return _sha256(_canonical({k: v for k, v in side.items() if k != "sha256"}))


def check_sidecar(side, key: str) -> None:
    """Raise CorruptEntry unless `side` (parsed JSON) is the sidecar of `key`: an object with exactly the fields of
    SIDECAR, each of its type, whose checksum matches, in this format, and whose metadata has exactly the fields of an
    entry, each of its type (entry.meta_problem)."""
    why = fields_problem(side, SIDECAR, "the sidecar")
    if why is not None:
        raise CorruptEntry(why)
    if sidecar_sha256(side) != side["sha256"]:
        raise CorruptEntry("the sidecar's checksum does not match")
    why = meta_problem(side["meta"])
    if why is not None:
        raise CorruptEntry(why)
    if side["format"] != FORMAT or side["key"] != key or side["meta"]["key"] != key:
        raise CorruptEntry("wrong format or key in the sidecar")


class DiskStore:
    def __init__(self, directory: str | os.PathLike) -> None:
        require("safetensors")
        # the --export / --report folder check: an empty name (not the current folder), a file, a dangling link, a
        # link loop, no permission, said plainly
        root = os.path.expanduser(os.fspath(directory))
        check_out_dir(root, "store", "the calibrations", make=False)  # the name as given: "" is no folder
        self.root = Path(root)
        for sub in ("entries", "locks", "corrupt"):
            check_out_dir(self.root / sub, "store", "the calibrations", make=False)
        self._made = False  # the folders are made with the first lock (_make): a run refused before any lookup (a
        #                     request too long, found once the engine that opened the store tokenizes it) makes none
        self.corrupted = 0
        # key -> the identity of a corrupt entry's sidecar that could not be moved aside (_move_aside): reported once,
        # then read as missing and never overwritten while it is there
        self._left: dict[str, tuple] = {}
        self._sweep()

    def _make(self) -> None:
        """Make the store's folders (once): DIR, entries/ and locks/, checked as when it opened, and corrupt/ where it
        is missing (one replaced by a file since the store opened is _move_aside's to report, not a refusal)."""
        if not self._made:
            for path in (self.root, self.root / "entries", self.root / "locks"):
                check_out_dir(path, "store", "the calibrations")
            with contextlib.suppress(OSError):
                if not os.path.lexists(self.root / "corrupt"):
                    (self.root / "corrupt").mkdir()
            self._made = True

    def paths(self, key: str) -> tuple[Path, Path]:
        d = self.root / "entries" / key[:2]
        return d / f"{key}.safetensors", d / f"{key}.json"

    @contextlib.contextmanager
    def lock(self, key: str, should_stop: Callable[[], str | None] | None = None):
        """Hold the key's lock (flock, exclusive; waits for another holder, in this process or another). With
        should_stop (the waiter's calibration hook), the wait tries the lock every POLL_S seconds and raises
        GaveUp(reason) when should_stop fires first (sicl_fast.store.wait)."""
        self._make()
        with open(self.root / "locks" / f"{key}.lock", "a+b") as fh:
            wait(functools.partial(_take, fh.fileno()), should_stop)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _temporaries(self, key: str = "*") -> list[Path]:
        """The temporary files of `key`'s writes (of every key with "*"): <key>.safetensors.XXXX.tmp and
        <key>.json.XXXX.tmp (_write_atomic's names)."""
        return [p for suffix in ("safetensors", "json")
                for p in self.root.glob(f"entries/{key[:2] if key != '*' else '*'}/{key}.{suffix}.*.tmp")]

    def _remove_temporaries(self, key: str) -> None:
        """Remove what a writer of `key` killed mid-write left (call with lock(key) held: no one else writes it)."""
        for p in self._temporaries(key):
            with contextlib.suppress(OSError):
                p.unlink()

    def _sweep(self) -> None:
        """Remove the temporaries of every key whose lock no one holds (a killed writer's): the keys of this run may
        never come up again, so waiting for a read of each would leave the others for ever."""
        for key in sorted({p.name.split(".", 1)[0] for p in self._temporaries()}):
            try:
                fh = open(self.root / "locks" / f"{key}.lock", "a+b")
            except OSError:
                continue
            with fh:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held: a live writer, its temporary is not stale
                self._remove_temporaries(key)

    def read(self, key: str, expect: Expected | None = None) -> Calibration | None:
        """The entry (call with lock(key) held), or None when there is none or it was corrupt (moved aside). The
        temporaries a killed writer of this key left are removed first (the lock says no one writes them). expect:
        what the key's lookup expects (its prompt's ids and rows, the model's width): an entry that is not that is
        corrupt too, whatever its checksums say."""
        self._remove_temporaries(key)
        tensors, sidecar = self.paths(key)
        if not sidecar.exists() or self._left_in_place(key):
            return None
        try:
            cal = self._load(key, tensors, sidecar)
            why = expect.problem(cal) if expect is not None else None
            if why is not None:
                raise CorruptEntry(f"it holds {why}")
            return cal
        except CorruptEntry as exc:
            self._move_aside(key, str(exc))
            return None

    def _load(self, key: str, tensors: Path, sidecar: Path) -> Calibration:
        from safetensors.torch import load as load_tensors

        try:
            side = json_value(sidecar.read_bytes(), "sidecar", CorruptEntry)  # not JSON, not UTF-8, too deep
        except OSError as exc:
            raise CorruptEntry(f"unreadable sidecar ({type(exc).__name__})") from None
        check_sidecar(side, key)
        try:
            data = tensors.read_bytes()
        except FileNotFoundError:
            raise CorruptEntry("the tensors file is missing") from None
        except OSError as exc:
            raise CorruptEntry(f"unreadable tensors file ({exc.strerror or exc})") from None
        if len(data) != side["tensors_bytes"] or _sha256(data) != side["tensors_sha256"]:
            raise CorruptEntry(f"the tensors file's checksum does not match ({len(data)} bytes, "
                               f"{side['tensors_bytes']} written)")
        try:
            t = load_tensors(data)
            cal = Calibration.from_parts(side["meta"], t["rows"], t["input_ids"])
            n = len(cal.history)
        except Exception as exc:  # noqa: BLE001 - a file that passed its checksum but not its parse
            raise CorruptEntry(f"unreadable entry ({type(exc).__name__}: {exc})") from None
        if (cal.rows.dim() != 2 or cal.rows.dtype != torch.float32 or cal.input_ids.dtype != torch.int64
                or cal.rows.shape[0] != cal.input_ids.numel() or n != cal.steps):
            raise CorruptEntry("tensor shapes or dtypes disagree with the sidecar")
        return cal

    def _move_aside(self, key: str, why: str) -> None:
        """Move a corrupt entry to corrupt/, its sidecar first (once it is gone no reader takes the entry), and say
        once what was done. A sidecar that cannot be moved (corrupt/ gone or not a folder, no permission) leaves the
        entry whole where it is: it is recomputed, and kept from being overwritten (_left) so that it stays for
        inspection; a tensors file that cannot follow its moved sidecar is replaced by the recomputed entry."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        corrupt = self.root / "corrupt"
        tensors, sidecar = self.paths(key)
        moved, failed = 0, None
        for path in (sidecar, tensors):
            if not path.exists():
                continue
            try:
                if not os.path.lexists(corrupt):  # made with its first entry; one replaced by a file is not a folder
                    corrupt.mkdir()
                os.replace(path, corrupt / f"{path.stem}.{stamp}.{os.getpid()}{path.suffix}")
                moved += 1
            except OSError as exc:
                failed = exc.strerror or str(exc)
                break
        self.corrupted += 1
        if failed is None:
            done = f"moved to {corrupt} and recomputed"
        elif not moved:
            self._left[key] = _identity(sidecar)
            done = (f"could not be moved to {corrupt} ({failed}): left in place for inspection and recomputed, and "
                    "this key is not stored again until it is removed")
        else:
            done = (f"its sidecar moved to {corrupt}; its tensors file could not be ({failed}) and is replaced by the "
                    "recomputed entry")
        msg = f"store {self.root}: entry {key} is corrupt ({why}); {done}"
        log.warning(msg)
        warnings.warn(msg, SiclWarning, stacklevel=4)

    def _left_in_place(self, key: str) -> bool:
        """Is the entry of `key` the corrupt one _move_aside could not move (already reported)? Another file since
        (removed, or written by another process) is read as any."""
        if key not in self._left:
            return False
        if self._left[key] == _identity(self.paths(key)[1]):
            return True
        del self._left[key]
        return False

    def write(self, cal: Calibration) -> None:
        """Write an entry (call with lock(cal.key) held): tensors, then the sidecar, each atomically."""
        from safetensors.torch import save as save_tensors

        if self._left_in_place(cal.key):  # a corrupt entry that could not be moved aside is not overwritten
            return
        tensors, sidecar = self.paths(cal.key)
        data = save_tensors({"rows": cal.rows.contiguous(), "input_ids": cal.input_ids.contiguous()},
                            metadata={"format": FORMAT, "key": cal.key})
        side = {"format": FORMAT, "key": cal.key, "meta": cal.meta(), "tensors_sha256": _sha256(data),
                "tensors_bytes": len(data)}
        side["sha256"] = sidecar_sha256(side)
        try:
            tensors.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(tensors, data)
            _write_atomic(sidecar, json.dumps(side, indent=1).encode())
        except OSError as exc:
            # a full or read-only disk, a shard folder that is a file: costs only the next run its reuse
            log.warning("store %s: cannot write entry %s: %s", self.root, cal.key, exc.strerror or exc)


__all__ = ["DiskStore", "FORMAT"]
