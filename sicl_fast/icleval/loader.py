"""Loading ICLEval task files (SPEC 1-2): JSON array -> list of validated `Sample`s.

Files are read as UTF-8 with no whitespace or Unicode normalisation: spans are code-point offsets into text
built from these exact strings. The file name selects the task (dispatch is always by file, SPEC 2).
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from ..formats.inputs import json_value
from .errors import ICLEvalDataWarning, ICLEvalError, where
from .tasks import TASK_FILES, TASKS, TaskSpec, get_task, task_name


@dataclass(frozen=True)
class Sample:
    """One ICLEval sample. Its key is (task_file, uid): uids are unique within a file only.

    task_file: the file name without ".json" (e.g. "classifier_order")
    label:     str, or bool for classifier_order / classifier_duplication
    raw:       the sample's JSON object as loaded (all fields, file-specific ones included)
    """

    task_file: str
    uid: int
    task: str
    task_type: str
    prompt: str
    label: str | bool
    raw: dict[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def spec(self) -> TaskSpec:
        return TASKS[self.task_file]

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_file, self.uid)


_COMMON: tuple[tuple[str, type], ...] = (("task", str), ("task_type", str), ("prompt", str))


def _is(value: Any, typ: type) -> bool:
    """isinstance, except that a JSON bool is not an int (True would otherwise pass as a count of 1)."""
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def _type_name(typ: type) -> str:
    return {str: "a string", int: "an integer", bool: "a boolean", dict: "an object"}.get(typ, typ.__name__)


def sample_from_json(spec: TaskSpec, obj: Any, index: int) -> Sample:
    """Validate one JSON object of `spec`'s file and build its Sample. Errors name the file, uid and field."""
    name = spec.name
    if not isinstance(obj, dict):
        raise ICLEvalError(f"{where(name)}: item {index}: must be a JSON object, got {type(obj).__name__}")
    uid = obj.get("uid")
    if not _is(uid, int):
        detail = "missing" if "uid" not in obj else f"must be an integer, got {uid!r}"
        raise ICLEvalError(f"{where(name)}: item {index} (uid unknown): field 'uid': {detail}")

    required = _COMMON + (("label", spec.label_type),) + spec.fields
    for fld, typ in required:
        if fld not in obj:
            raise ICLEvalError(f"{where(name, uid, fld)}: missing")
        if not _is(obj[fld], typ):
            raise ICLEvalError(
                f"{where(name, uid, fld)}: must be {_type_name(typ)}, got {type(obj[fld]).__name__} {obj[fld]!r:.60}"
            )
    task, task_type = obj["task"], obj["task_type"]
    if not spec.allows(task, task_type):
        known = ", ".join(f"{t}/{tt}" for t, tt, _ in spec.subsets)
        raise ICLEvalError(
            f"{where(name, uid, 'task_type')}: ({task!r}, {task_type!r}) is not a subset of this file ({known})"
        )

    if spec.span_rule == "S-DICT":
        # R-DICT / S-DICT need str -> str entries, and the query key must be one of them (SPEC 2)
        d = obj["dict"]
        for k, v in d.items():
            if not isinstance(v, str):
                raise ICLEvalError(
                    f"{where(name, uid, 'dict')}: value of key {k!r} must be a string, got {type(v).__name__}"
                )
        if not d:
            raise ICLEvalError(f"{where(name, uid, 'dict')}: is empty")
        if obj["prompt"] not in d:
            raise ICLEvalError(f"{where(name, uid, 'prompt')}: the query key {obj['prompt']!r} is not a key of 'dict'")
        if d[obj["prompt"]] != obj["label"]:
            raise ICLEvalError(f"{where(name, uid, 'label')}: differs from dict[prompt]")

    return Sample(
        task_file=name, uid=uid, task=task, task_type=task_type,
        prompt=obj["prompt"], label=obj["label"], raw=obj,
    )


_WARNED: set[tuple[str, str]] = set()  # (file, sha256) whose difference from the release load_task said


def load_task(path: str | Path, check_sha256: bool = True) -> list[Sample]:
    """Load one task file. Its name must be one of the 13 ICLEval files (TASK_FILES, with ".json").

    check_sha256: compare the file's bytes with the released data; a mismatch is a warning
    (ICLEvalDataWarning), not an error, so that edited or re-exported files still load.
    """
    path = Path(path)
    spec = get_task(path)  # also refuses names that do not end in ".json"
    if path.is_dir():
        raise ICLEvalError(f"{spec.file_name}: {path} is a directory, not a task file")
    if not path.is_file():
        raise ICLEvalError(f"{spec.file_name}: file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ICLEvalError(f"{spec.file_name}: cannot read {path}: {exc.strerror or exc}") from None
    if check_sha256:
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.sha256 and (str(path.resolve()), digest) not in _WARNED:
            # once a file and content per process: a command loads its tasks when it checks its flags and again when
            # it runs them, and one file is not two warnings
            _WARNED.add((str(path.resolve()), digest))
            warnings.warn(
                f"{spec.file_name}: sha256 {digest} differs from the released ICLEval file ({spec.sha256}); "
                f"loading it anyway",
                ICLEvalDataWarning,
                stacklevel=2,
            )
    items = json_value(data, spec.file_name, ICLEvalError)
    if not isinstance(items, list):
        raise ICLEvalError(f"{spec.file_name}: must be a JSON array of samples, got {type(items).__name__}")
    samples = [sample_from_json(spec, obj, i) for i, obj in enumerate(items)]
    seen: set[int] = set()
    for s in samples:
        # the sample key is (file, uid): a repeated uid would make two samples indistinguishable
        if s.uid in seen:
            raise ICLEvalError(f"{where(spec.name, s.uid, 'uid')}: duplicate uid in this file")
        seen.add(s.uid)
    return samples


def load_dir(
    directory: str | Path, tasks: Iterable[str] | None = None, check_sha256: bool = True
) -> dict[str, list[Sample]]:
    """Load task files from a directory (e.g. ICLEval's data/tasks_data/), keyed by file name without ".json".

    tasks=None loads every ICLEval file present (any subset of the 13); any other *.json file there is an error,
    so a misnamed file is not silently skipped. With `tasks` (names with or without ".json"), exactly those are
    loaded and each must exist. The result follows TASK_FILES order.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ICLEvalError(f"not a directory: {directory}")
    if tasks is None:
        present = sorted(p.name for p in directory.glob("*.json"))
        unknown = [n for n in present if task_name(n) not in TASKS]
        if unknown:
            raise ICLEvalError(
                f"{unknown[0]}: unknown ICLEval task file in {directory} (unknown: {', '.join(unknown)}); move "
                "it out, or name the files to load (sicl-fast icleval --tasks; tasks=[...] in Python)"
            )
        names = [task_name(n) for n in present]
        if not names:
            raise ICLEvalError(f"no ICLEval task files in {directory} (expected some of {', '.join(TASK_FILES)})")
    else:
        names = [get_task(t).name for t in tasks]
        if not names:
            raise ICLEvalError("tasks=[] selects no task file")
    out: dict[str, list[Sample]] = {}
    for name in TASK_FILES:
        if name in names:
            out[name] = load_task(directory / f"{name}.json", check_sha256=check_sha256)
    return out
