"""Input files (requests, results): what a path names, said plainly when it cannot be read, and streams read as
streams.

    with open_input(path, "requests file", hint) as fh:   binary lines
        ...

    env_path("SICL_FAST_CACHE")                           the folder a variable names, absolute; None when unset,
                                                          empty or blank

    json_value(line, "r.jsonl:3", RequestError)           the JSON value of a line or a file's bytes, or one line
                                                          naming what is wrong (the one JSON reader of input files)

A regular file is opened; a pipe (a FIFO, `/dev/stdin` on a pipe, a process substitution `<(cat f)`), a terminal
and `-` (standard input) are read once, as a stream; anything else is refused with what it is: a directory, a
socket, a device; a dangling symbolic link, a symbolic link loop, a missing file, one that cannot be read.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO
from collections.abc import Iterator

from ..errors import SiclError

STDIN = "-"


def _kind(mode: int) -> str | None:
    """What a file that is neither regular nor a stream is, in words (None for those two)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISCHR(mode):
        return "a character device"
    return None


def env_path(name: str) -> Path | None:
    """The path the environment variable `name` holds, ~ expanded and made absolute (links kept), or None when it is
    unset, empty or blank: `VAR=` or an unset shell variable expanded into it means "unset", never the current
    folder (which a cache would fill, and `cache clear` would clear)."""
    value = os.environ.get(name, "")
    if not value.strip():
        return None
    return Path(value).expanduser().absolute()


def describe_missing(path: Path) -> str:
    """Why `path` cannot be opened, for an OSError of os.stat: a dangling or looping link, or not found."""
    try:
        target = os.readlink(path)
    except OSError:
        return "not found"
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"is a symbolic link loop ({path} -> {target} -> ... never reaches a file)"
    return f"is a symbolic link to {target}, which does not exist (a dangling link)"


BOM = "\ufeff"  # what Notepad and PowerShell put before UTF-8 text: no part of the JSON


def json_value(data: bytes | str, where: str, error: type[Exception] = SiclError, what: str = "JSON"):
    """The JSON value of `data` (a line of a JSONL file, or a whole file), read as UTF-8 with a leading byte order
    mark dropped. Raises `error` "{where}: ..." when it is not: bytes that are not UTF-8, text that is not JSON (`what`
    names it: "invalid {what}: ..."), nesting too deep for the parser, a number too long to read (json raises a
    ValueError, not a JSONDecodeError, for an integer of more than 4300 digits). Every file reader of JSON takes it."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    try:
        return json.loads(data.removeprefix(BOM))
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid {what}: {exc}") from None
    except RecursionError:
        raise error(f"{where}: {what} nested too deeply") from None
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion ..."
        raise error(f"{where}: invalid {what}: {str(exc).split(';')[0]}") from None


def of_type(value, typ) -> bool:
    """Is the parsed JSON `value` of `typ` (a type or a tuple of them)? A bool is an int only where bool is named
    (JSON's true is no number): the one type check of what a JSON reader read."""
    typs = typ if isinstance(typ, tuple) else (typ,)
    return isinstance(value, typs) and (bool in typs or not isinstance(value, bool))


@contextlib.contextmanager
def open_input(path: str | os.PathLike, what: str, directory_hint: str = "",
               error: type[SiclError] = SiclError) -> Iterator[BinaryIO]:
    """Open an input for reading bytes (module docstring). Raises `error` "{what} {path}: ..." naming what the
    path is when it cannot be read; `directory_hint` follows the directory message."""
    if str(path) == STDIN:
        yield sys.stdin.buffer
        return
    p = Path(path)
    where = f"{what} {p}"
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise error(f"{what} not found: {p}" if not os.path.islink(p) else f"{where}: {describe_missing(p)}") \
            from None
    except OSError as exc:
        reason = describe_missing(p) if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise error(f"{where}: {reason}") from None
    kind = _kind(mode)
    if kind == "a character device" and _is_tty(p):
        kind = None  # a terminal: read what is typed, up to Ctrl-D
    if kind is not None:
        hint = f"; {directory_hint}" if kind == "a directory" and directory_hint else ""
        raise error(f"{where}: is {kind}, not a file{hint}")
    try:
        fh = p.open("rb")  # a FIFO waits here for its writer, as `cat` would
    except OSError as exc:
        raise error(f"{where}: cannot read it: {exc.strerror or exc}") from None
    with fh:
        yield fh


def _is_tty(p: Path) -> bool:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.isatty(fd)
    finally:
        os.close(fd)


__all__ = ["open_input", "describe_missing", "env_path", "json_value", "of_type", "STDIN"]
