"""Result files: JSONL, one whole record a line, resumable, one writer at a time.

A record is written with a single write() of a complete line and flushed, so a crash can leave at most one
partial last line. On reopening a regular file, every line that is a complete JSON object with a key is kept
(the first of several with one key: two runs that once shared the file left duplicates); every other line (a
torn write, a hand edit) is moved to FILE.bad, and a warning says how many. That repair comes after the resume's
check (the writer's `check`): a resume refused leaves the file as it was. The file is locked (flock) while a
writer has it open, so a second run on the same --out stops with one line instead of duplicating the work.

An output that is not a regular file (`-` for stdout, a pipe, /dev/stdout) is streamed: it is never read back,
so it cannot resume.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import stat
import sys
import warnings
from pathlib import Path
from collections.abc import Callable, Iterable

from ..errors import ResultsFileError, SiclError, SiclWarning
from .inputs import describe_missing, json_value, open_input

STDOUT = "-"

# the writers opened by this process, newest last: the CLI reports their counts when a run is interrupted
OPENED: list[ResultWriter] = []


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), flag: str = "--out") -> None:
    """Refuse an --out that cannot work, before any model is loaded: a directory, one of the `inputs` (same path
    or same file), or a place that cannot be created or written. Raises ResultsFileError naming `flag`."""
    if str(path) == STDOUT:
        return
    p = Path(path)
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # Path.resolve below would raise a RuntimeError
            how = describe_missing(p) if p.is_symlink() else "has a symbolic link loop in its path"
            raise ResultsFileError(f"{flag} {p}: {how}") from None
    if p.is_dir():
        example = p / ("results.jsonl" if flag == "--out" else "report.md")
        raise ResultsFileError(f"{flag} {p}: is a directory; give a file name (e.g. {example})")
    for src in inputs:
        if same_file(p, src):
            raise ResultsFileError(f"{flag} {p}: is the input file {src}; the results need a file of their own")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ResultsFileError(f"{flag} {p}: cannot write to it (permission denied)")
        return
    why = _cannot_create(p)
    if why is not None:
        raise ResultsFileError(f"{flag} {p}: {why}")


def same_file(path: str | os.PathLike, other: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same path once resolved (a file not made yet included), or the same file
    (a hard link)."""
    path, other = Path(path), Path(other)
    try:
        if path.resolve() == other.resolve():
            return True
    except (OSError, RuntimeError):  # a link loop on the way (RuntimeError): no file, so none the other is
        return False
    return path.exists() and other.exists() and os.path.samefile(path, other)


def _cannot_create(path: Path) -> str | None:
    """Why `path` (not there yet) cannot be made, or None: its nearest existing parent is a dangling link or a link
    loop, not a folder, or one this process may not write to."""
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if parent.is_symlink() and not parent.exists():
        return f"{parent} {describe_missing(parent)}"
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it in {parent} (permission denied)"
    return None


def folder_arg(text: str) -> str:
    """An argparse type for a folder flag (--store, --export, --report): an empty one (`--store=`, an unset
    variable) is refused, not read as the flag left out or as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("an empty folder name; give a folder")
    return text


def check_out_dir(directory: str | os.PathLike, flag: str, what: str, make: bool = True,
                  files: Iterable[str] = (), inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Create the output folder of `flag` (--export, --report) before any work; SiclError "{flag} DIR: ..." when
    it cannot be a writable folder: an empty name, a file, a dangling link or a link loop (the folder's or one on the
    way to it), no permission. `what`: what goes in it, for the message. make=False: the same checks without making
    it (its nearest existing parent a folder this process may write to): a command checks its flags first, then a
    resume, and makes its folders only once the resume is not refused (or with their first file: --export,
    --store). files, inputs: the files the command writes in it (report.md, ...) and those it reads or appends to (its
    results file): one of those would be replaced by the other, refused."""
    if not str(directory).strip():  # Path("") is the current folder, which would fill with the outputs
        raise SiclError(f"{flag}: an empty folder name; give a folder for {what}")
    path = Path(directory)
    if path.is_symlink() and not path.exists():
        raise SiclError(f"{flag} {path}: {describe_missing(path)}")
    if path.exists() and not path.is_dir():
        raise SiclError(f"{flag} {path}: is a file; give a folder for {what}")
    if not path.exists():
        why = _cannot_create(path)
        if why is not None:
            raise SiclError(f"{flag} {path}: {why}")
    for name in files:
        for src in inputs:
            if str(src) != STDOUT and same_file(path / name, src):
                raise SiclError(f"{flag} {path}: its {name} would replace {src}, a file this run reads; give {what} a "
                                "folder of their own")
    if not make:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SiclError(f"{flag} {path}: cannot create it: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SiclError(f"{flag} {path}: cannot write to it (permission denied)")
    return path


def _parse_line(line: bytes, key: Callable[[dict], object]):
    """The (key, record) of one complete line, or None when it is not a record."""
    try:
        rec = json.loads(line)
        k = key(rec)
        hash(k)
        return k, rec
    except (ValueError, RecursionError, KeyError, TypeError):  # not UTF-8 / JSON, too deep, not an object
        return None


class ResultWriter:
    """Append-only JSONL with resume. `key(record)` gives the identity used to skip finished work.

    settings: stamped into every record written, under "settings" (what the run's numbers depend on,
    sicl_fast.run.settings), beneath the settings a record brings of its own (the engine's part after a fallback:
    commands.work); check: called with the records the file holds once it is opened and read, before it is
    repaired and before anything is written (a resume's settings check, sicl_fast.run.settings.resume_check: it
    raises to refuse, and a refused resume leaves the file as it was, a torn last line included). repair=False:
    read and check only, the repair left to `repair()` (nothing_left: a run that goes on to load its model may still
    be refused, a request too long, and refused means untouched).
    written: records written by this writer; done: the keys in the file (resumed and written).
    """

    def __init__(self, path: str | os.PathLike, key: Callable[[dict], object] = lambda r: r["id"],
                 settings: dict | None = None, check: Callable[[list[dict]], None] | None = None,
                 repair: bool = True) -> None:
        self._repair_now = repair
        self._found: tuple | None = None  # what _read found, for a repair() later (repair=False)
        self.key = key
        self.settings = settings
        self.check = check
        self.records: list[dict] = []  # the records the file held when opened (kept for `check` only)
        self.done: set = set()
        self.written = 0
        self.resumed = 0
        self.moved_aside = 0
        self.streaming = str(path) == STDOUT
        self._binary = False
        self.path = Path("<stdout>") if self.streaming else Path(path)
        if self.streaming:
            self._fh = sys.stdout
        else:
            check_output(self.path)
            self._fh = self._open()
        OPENED.append(self)

    def _open(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            exists = self.path.exists()
            if exists and not stat.S_ISREG(os.stat(self.path).st_mode):
                self.streaming = True  # a pipe, a terminal, /dev/stdout: write only, never read back
                return self.path.open("w", encoding="utf-8")
            fh = self.path.open("a+b")
        except OSError as exc:
            raise ResultsFileError(f"--out {self.path}: cannot open it: {_os_reason(exc)}") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ResultsFileError(f"--out {self.path}: another run is writing to it (the file is locked); "
                                       "wait for it to finish or choose another --out") from None
            raise ResultsFileError(f"--out {self.path}: cannot lock it: {_os_reason(exc)}") from None
        try:  # read first, check, and only then repair: a refused resume leaves the file (and FILE.bad) untouched
            found = self._read(fh)
            if self.check is not None:
                self.check(self.records)
            if self._repair_now:
                self._repair(fh, *found)
            else:
                self._found = found
        except OSError as exc:
            fh.close()
            raise ResultsFileError(f"--out {self.path}: cannot repair it for resuming: {_os_reason(exc)}") from None
        except BaseException:
            fh.close()
            raise
        self.records = []
        self._binary = True
        return fh

    def _read(self, fh) -> tuple:
        """What the file holds, read without changing anything: (its bytes, the kept lines, the unreadable ones, the
        duplicates dropped, the copy of an interrupted repair restored, the path of that copy); the kept records in
        self.done (their keys) and self.records (for `check`)."""
        fh.seek(0)
        data = fh.read()
        keep: list[bytes] = []
        bad: list[bytes] = []
        duplicates = 0
        backup = self.path.with_name(self.path.name + ".resume-tmp")
        # a repair killed while it rewrote the file (_repair) left its copy of the kept records, and the file only a
        # part of them: the copy's records come first, and the file's lines that repeat them are not duplicates
        saved = backup.read_bytes() if backup.is_file() else b""
        if not saved.endswith(b"\n"):  # none, or killed while the copy was written: the file was not touched yet
            saved = b""  # (that partial copy is removed by _repair)
        restored = set()
        rest = b"" if saved.startswith(data) else data  # the file holds a part of the copy (a torn line at most)
        for line in saved.splitlines(keepends=True) + [b""] + rest.splitlines(keepends=True):
            if not line:
                restored = set(self.done)  # the copy's records: their repeats in the file are no duplicates
                continue
            if not line.strip():
                continue
            if not line.endswith(b"\n"):
                line += b"\n"  # a last line without its newline: kept if it is a whole record, else moved aside
            parsed = _parse_line(line, self.key)
            if parsed is None:
                bad.append(line)
            elif parsed[0] in self.done:
                duplicates += parsed[0] not in restored
            else:
                self.done.add(parsed[0])
                keep.append(line)
                if self.check is not None:
                    self.records.append(parsed[1])
        self.resumed = len(keep)
        return data, keep, bad, duplicates, saved, backup

    def _repair(self, fh, data: bytes, keep: list[bytes], bad: list[bytes], duplicates: int, saved: bytes,
                backup: Path) -> None:
        """Make the file hold the kept lines alone (_read's findings): unreadable lines moved to FILE.bad, duplicates
        dropped, an interrupted repair finished; a file that needs none of it is not written."""
        said = []  # said once the file is rewritten: a rewrite that fails (a full disk) moved nothing
        if not saved:
            backup.unlink(missing_ok=True)  # a copy cut short: the file was not touched yet
        else:
            said.append(f"{self.path}: an earlier resume was interrupted while it rewrote the file; its copy {backup} "
                        f"restored ({len(keep)} record(s) kept)")
        if not saved and not bad and not duplicates and sum(map(len, keep)) == len(data):
            return
        if bad:
            bad_path = self.path.with_name(self.path.name + ".bad")
            try:
                with bad_path.open("ab") as out:  # first put the unreadable lines safely aside
                    out.writelines(bad)
                    out.flush()
                    os.fsync(out.fileno())
            except OSError as exc:  # named: "cannot repair it: No such file or directory" read as --out's own
                raise ResultsFileError(f"--out {self.path}: cannot put its {len(bad)} unreadable line(s) aside in "
                                       f"{bad_path}: {_os_reason(exc)}; the file is left as it was") from None
            said.append(f"{self.path}: {len(bad)} unreadable line(s) moved to {bad_path}; {len(keep)} record(s) kept")
        if duplicates:
            said.append(f"{self.path}: {duplicates} duplicate record(s) dropped (same id as an earlier line)")
        # rewrite in place (the lock stays on this file); a copy of the kept lines exists until it is done (a kill
        # meanwhile: the next open restores it, above)
        _write_synced(backup, b"".join(keep))
        fh.seek(0)
        fh.truncate()
        fh.writelines(keep)
        fh.flush()
        os.fsync(fh.fileno())
        backup.unlink()
        self.moved_aside = len(bad)
        for message in said:
            warnings.warn(message, SiclWarning, stacklevel=4)

    def repair(self) -> None:
        """The repair a writer opened with repair=False left (its file's unreadable lines moved aside, duplicates
        dropped), as opening with repair=True makes it."""
        if self._found is not None:
            found, self._found = self._found, None
            try:
                self._repair(self._fh, *found)
            except OSError as exc:
                raise ResultsFileError(f"--out {self.path}: cannot repair it: {_os_reason(exc)}") from None

    def __contains__(self, key) -> bool:
        return key in self.done

    def write(self, record: dict) -> None:
        if self.settings is not None:  # a record's own settings (those its run changed: a fallback) on top
            record = {**record, "settings": {**self.settings, **record.get("settings", {})}}
        line = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            if self._binary:
                self._fh.write(line.encode("utf-8"))
                self._fh.flush()
                os.fsync(self._fh.fileno())
            else:
                self._fh.write(line)
                self._fh.flush()
        except BrokenPipeError:
            raise  # the reader of a streamed output went away (`--out - | head`): the CLI ends quietly
        except OSError as exc:
            raise ResultsFileError(f"--out {self.path}: cannot write: {_os_reason(exc)}") from None
        self.done.add(self.key(record))
        self.written += 1

    def close(self) -> None:
        if self._fh is not sys.stdout:
            try:
                self._fh.close()  # also releases the lock
            except OSError:
                pass

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_synced(path: Path, data: bytes) -> None:
    """Write a whole file and flush it to disk (the copy a rewrite relies on)."""
    with path.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def nothing_left(path: str | os.PathLike, keys: Iterable, key: Callable[[dict], object] = lambda r: r["id"],
                 check: Callable[[list[dict]], None] | None = None) -> bool:
    """Whether every one of `keys` is already in the results file `path` (a resumed run with nothing to do: the
    commands end before loading a model). False for a new file and for a streamed output. check: as ResultWriter's
    (a file of other settings is refused here, before any model loads)."""
    p = Path(path)
    if str(path) == STDOUT or not p.is_file():
        return False
    # repaired only when nothing is left: a run with work loads its model and may be refused yet (a request too
    # long for it), and a refused run leaves its file as it was; the writer it opens then repairs it
    with ResultWriter(p, key, check=check, repair=False) as out:
        done = all(k in out for k in keys)
        if done:
            out.repair()  # the finished run's records are read back (its table): a torn line moved aside first
    OPENED.remove(out)  # it wrote nothing: no part of an interrupted run's summary
    return done


def read_records(path: str | os.PathLike, allow_empty: bool = True) -> list[dict]:
    """All records (JSON objects, one a line) of a JSONL results file. Raises SiclError naming the line of any
    line that is not one; an empty file is an error unless `allow_empty`."""
    out = []
    with open_input(path, "results file") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rec = json_value(line, f"{path}:{lineno}", what="JSON record")
            if not isinstance(rec, dict):
                raise SiclError(f"{path}:{lineno}: a record must be a JSON object, got {type(rec).__name__}")
            out.append(rec)
    if not out and not allow_empty:
        raise SiclError(f"results file {path}: holds no records")
    return out


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temp file and rename: readers see the old file or the new one, never half of one. A symbolic link
    is written through (its target replaced, the link kept) and a file replaced keeps its permission bits; a file
    with other hard links is written in place (a new file would leave its other names with the old text)."""
    path = Path(os.path.realpath(path))
    if path.is_file() and path.stat().st_nlink > 1:
        path.write_text(text, encoding="utf-8")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    if path.exists():
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
    os.replace(tmp, path)


def proxy_record(prompt, out) -> dict:
    """The proxy of a prompt's own embeddings (`ProxyOut` of one row) as one JSON record: the `proxy` command's
    lines and the server's POST /v1/proxy reply."""
    return {"id": prompt.id, "proxy": float(out.f[0]), "C": float(out.C[0]), "R": float(out.R[0]),
            "G": float(out.G[0]), "num_demos": prompt.num_demos, "token_spans": [list(s) for s in prompt.token_spans]}


__all__ = ["ResultWriter", "nothing_left", "read_records", "write_text_atomic", "check_output", "STDOUT",
           "proxy_record", "folder_arg", "check_out_dir", "same_file"]
