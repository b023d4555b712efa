"""The 13 ICLEval task files: what each one is and how it is rendered, spanned, decoded and scored (SPEC 1, 3, 4, 6).

Everything is keyed by the **file** (its name without ".json", e.g. "classifier_order"), never by the
(task, task_type) pair, because ("format_convert", "transfer") occurs in two files (SPEC 2).

Values that depend on the subset (max_gen_len, cut string, span delimiters, prompt ending) are stored as a
mapping task_type -> value, with the key "*" for "every other task_type".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

from .errors import ICLEvalError

# Per-task_type value: either one value for the whole file or {task_type or "*": value}.
PerType = object | Mapping[str, object]

# String Completion's response is cut at the earliest of these (SPEC 6.4, NL).
NL_END_CHARS: tuple[str, ...] = (" ", ",", ".", "!", ":", ")", '"', "'", "\n")

# Paper task names, in the paper's order (SPEC 1). Dict. Search has two files.
PAPER_TASKS: tuple[str, ...] = (
    "String Completion",
    "Dict. Search",
    "Format Check",
    "Format Cloning",
    "Format Conversion",
    "Order Check",
    "Order Adjustment",
    "Duplication Check",
    "De-Duplication",
    "Count & Navigation",
    "Relation Analysis",
    "List Mapping",
)


@dataclass(frozen=True)
class TaskSpec:
    """One task file.

    name:        file name without ".json" (the key used everywhere)
    paper_task:  one of PAPER_TASKS
    kind:        "gen" or "cls"
    n:           samples in the released file
    subsets:     ((task, task_type, count), ...) of the released file; also the allowed pairs
    demos:       demonstrations per sample (None: String Completion, where it is the sample's `count`)
    render_rule: "R-CAT", "R-EXM", "R-DICT" or "R-CONTENT" (SPEC 3)
    span_rule:   "S-DELIM", "S-LINE", "S-DICT" or "S-HASH" (SPEC 4)
    delims:      S-DELIM's (D, T) per task_type (None for the other rules)
    ending:      what the rendered prompt ends with, per task_type (None: String Completion's hash prefix)
    block_marker: the word that starts each demonstration block, for the expected span count ("Input:"/"Question:");
                 None where the count comes from elsewhere (lines, dict entries, `count`)
    max_gen_len: new tokens to generate, per task_type
    cut:         the scorer's cut string(s), per task_type; a tuple for NL's end characters
    scorer:      "EXACT", "BOOL", "NL", "SET" or "FMT" (SPEC 6.4)
    label_type:  the JSON type of `label`: str, or bool for the two boolean classifiers
    fields:      file-specific required fields and their types (beyond uid, task, task_type, prompt, label)
    sha256:      of the released file (ICLEval 761e1dd)
    """

    name: str
    paper_task: str
    kind: str
    n: int
    subsets: tuple[tuple[str, str, int], ...]
    demos: int | None
    render_rule: str
    span_rule: str
    delims: PerType
    ending: PerType
    block_marker: str | None
    max_gen_len: PerType
    cut: PerType
    scorer: str
    label_type: type
    fields: tuple[tuple[str, type], ...]
    sha256: str

    @property
    def file_name(self) -> str:
        return self.name + ".json"

    def allows(self, task: str, task_type: str) -> bool:
        return any(t == task and tt == task_type for t, tt, _ in self.subsets)

    def max_gen_len_for(self, task_type: str) -> int:
        return _per_type(self, "max_gen_len", task_type)

    def cut_for(self, task_type: str) -> tuple[str, ...]:
        """The cut string(s) as a tuple: one string for every scorer except NL, which has several end characters."""
        cut = _per_type(self, "cut", task_type)
        return cut if isinstance(cut, tuple) else (cut,)

    def delims_for(self, task_type: str) -> tuple[str, str]:
        return _per_type(self, "delims", task_type)

    def ending_for(self, task_type: str) -> str | None:
        return _per_type(self, "ending", task_type)


def _per_type(spec: TaskSpec, attr: str, task_type: str):
    """Look a per-task_type value up; a missing task_type is an error (it would silently pick a wrong value)."""
    value = getattr(spec, attr)
    if not isinstance(value, Mapping):
        return value
    if task_type in value:
        return value[task_type]
    if "*" in value:
        return value["*"]
    raise ICLEvalError(f"{spec.file_name}: field 'task_type': {task_type!r} has no {attr} (known: {sorted(value)})")


def _subsets(task: str, types: tuple[str, ...], count: int) -> tuple[tuple[str, str, int], ...]:
    return tuple((task, tt, count) for tt in types)


_IO = ("Output:", "\n\n")  # the single-line S-DELIM of most files
_EX = (("examples", str),)

_SPECS: tuple[TaskSpec, ...] = (
    TaskSpec(
        name="copy_natural_language_string", paper_task="String Completion", kind="gen", n=100,
        subsets=(("natural_language", "hash_string_copying", 100),), demos=None,
        render_rule="R-CONTENT", span_rule="S-HASH", delims=None, ending=None, block_marker=None,
        max_gen_len=12, cut=NL_END_CHARS, scorer="NL", label_type=str,
        fields=(("content", str), ("count", int)),
        sha256="cc48ea0014be8ad318895b09a276db0598f38093160ef35968cf04ecd260644b",
    ),
    TaskSpec(
        name="copy_dict_search_string", paper_task="Dict. Search", kind="gen", n=100,
        subsets=(("dict_search", "hash_string", 100),), demos=20,
        render_rule="R-DICT", span_rule="S-DICT", delims=None, ending=" :", block_marker=None,
        max_gen_len=75, cut="\n", scorer="EXACT", label_type=str,
        fields=(("dict", dict),),
        sha256="e53e40b0429e419145884a17ba255b4874fea385d017420eab0eba94fb3b8206",
    ),
    TaskSpec(
        name="copy_dict_search_number", paper_task="Dict. Search", kind="gen", n=90,
        subsets=_subsets("dict_search", ("number-all_similar", "number-half_similar", "number-non_similar"), 30),
        demos=10, render_rule="R-CAT", span_rule="S-LINE", delims=None, ending="\u26f1", block_marker=None,
        max_gen_len=10, cut="\n", scorer="EXACT", label_type=str, fields=_EX,
        sha256="af9fe028de984561b128a516898e677d5e1a22fd26d3f5f9a0a8e90509df31d2",
    ),
    TaskSpec(
        name="classifier_format", paper_task="Format Check", kind="cls", n=120,
        subsets=_subsets("format_convert", ("normal", "transfer"), 60), demos=6,
        render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output: ", block_marker="Input:",
        max_gen_len=5, cut="\n", scorer="EXACT", label_type=str, fields=_EX,
        sha256="988ae7b0b38966bd7c894c51cedbdf09df9d303fce146faed2d28ec58467e5c3",
    ),
    TaskSpec(
        name="generate_output_format", paper_task="Format Cloning", kind="gen", n=100,
        subsets=(("output_format", "output_format_01", 50), ("output_format", "output_format_02", 30),
                 ("output_format", "output_format_03", 20)),
        demos=5, render_rule="R-CAT", span_rule="S-DELIM",
        delims={"output_format_01": ("Response:", "\n\nQuestion:"), "output_format_02": ("Answer:", "\n\nQuestion:"),
                "output_format_03": ("Answer:", "\n\nQuestion:")},
        ending={"output_format_01": "Response: ", "output_format_02": "Answer:", "output_format_03": "Answer:"},
        block_marker="Question:", max_gen_len=196, cut="\nQuestion:", scorer="FMT", label_type=str, fields=_EX,
        sha256="e08873f1e86222f0045b2658a005716457bc02c458e7835893b308b6d2b2712f",
    ),
    TaskSpec(
        # all four subsets use "Output:\n" / "\n\nInput:", transfer included (SPEC 7.5); max_gen_len 256 (SPEC 7.4)
        name="generate_format_conversion", paper_task="Format Conversion", kind="gen", n=120,
        subsets=_subsets("format_convert", ("single", "multi", "transfer", "mix"), 30), demos=3,
        render_rule="R-CAT", span_rule="S-DELIM", delims=("Output:\n", "\n\nInput:"), ending="Output:\n",
        block_marker="Input:", max_gen_len=256, cut="\nInput:", scorer="EXACT", label_type=str, fields=_EX,
        sha256="6c89e78bd7c3620c2de2a985aa20bf43ed7a71049fb53d25350fdb72b3c9ccc8",
    ),
    TaskSpec(
        name="classifier_order", paper_task="Order Check", kind="cls", n=100,
        subsets=_subsets("check_order", ("character", "word"), 50), demos=8,
        render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output:", block_marker="Input:",
        max_gen_len=5, cut="\n", scorer="BOOL", label_type=bool, fields=_EX,
        sha256="aba52f9e2af2a6ee544c8fd08ca35e68803d02fb994e5fd2d98dc130f792f587",
    ),
    TaskSpec(
        # max_gen_len and cut depend on the granularity (task_type), not on task
        name="generate_order", paper_task="Order Adjustment", kind="gen", n=240,
        subsets=_subsets("keep_order", ("character", "word", "sentence"), 30)
        + _subsets("reversed_order", ("character", "word", "sentence"), 30)
        + _subsets("specify_order", ("character", "word"), 30),
        demos=5, render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output:", block_marker="Input:",
        max_gen_len={"character": 50, "word": 50, "sentence": 256},
        cut={"character": "\n", "word": "\n", "sentence": "\nInput:"}, scorer="EXACT", label_type=str, fields=_EX,
        sha256="2a7bcca014cd5683b428f742f0c8f912334afeb3cfd9aede5b1af701382a0bef",
    ),
    TaskSpec(
        name="classifier_duplication", paper_task="Duplication Check", kind="cls", n=300,
        subsets=_subsets("check_repeated_content", ("character", "word", "sentence"), 100), demos=8,
        render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output:", block_marker="Input:",
        max_gen_len=5, cut="\n", scorer="BOOL", label_type=bool, fields=_EX,
        sha256="2e2853297b6d3b536081e595fd2fd3ecb8d00aed96b3d0b0c8ced30df57fe161",
    ),
    TaskSpec(
        name="generate_duplication", paper_task="De-Duplication", kind="gen", n=300,
        subsets=_subsets("remove_repeated_content", ("character", "word"), 100)
        + (("find_repeated_content", "sentence", 100),),
        demos=5, render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output:", block_marker="Input:",
        max_gen_len={"character": 30, "word": 30, "sentence": 60}, cut="\n", scorer="EXACT", label_type=str,
        fields=_EX,
        sha256="e88ce9284eeb50715188e541aa3936646e137ae97128a364394596e50c855eee",
    ),
    TaskSpec(
        name="generate_count_or_navigation", paper_task="Count & Navigation", kind="gen", n=120,
        subsets=_subsets("count_or_navigation",
                         ("count-easy", "count-middle", "navigation-easy", "navigation-middle"), 30),
        demos=8, render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output: ", block_marker="Input:",
        max_gen_len=30, cut="\n", scorer="EXACT", label_type=str, fields=_EX,
        sha256="fdb73a399658915c3d21f9f50c90d60637e1246523435eeec0fc20caf78013d6",
    ),
    TaskSpec(
        # the data spells the demonstrations field "exmaples" (SPEC 7.2)
        name="generate_relation_analysis", paper_task="Relation Analysis", kind="gen", n=100,
        subsets=(("generate_statistic", "relation", 100),), demos=5,
        render_rule="R-EXM", span_rule="S-DELIM", delims=("Output:", "\n\nInput:"), ending="Output:",
        block_marker="Input:", max_gen_len=60, cut="\nInput:", scorer="SET", label_type=str,
        fields=(("exmaples", str),),
        sha256="a83b5c3f8845dc61ee921158465ab91db12f8059a14b19419d680010ca576b0e",
    ),
    TaskSpec(
        name="generate_list_number", paper_task="List Mapping", kind="gen", n=250,
        subsets=(("list_number", "list_number", 250),), demos=31,
        render_rule="R-CAT", span_rule="S-DELIM", delims=_IO, ending="Output:", block_marker="Input:",
        max_gen_len=50, cut="\n", scorer="EXACT", label_type=str, fields=_EX,
        sha256="4a99e3112ccc0dc15508ab3610245ef5652f229075cee43c230c61db2433c997",
    ),
)

TASKS: dict[str, TaskSpec] = {s.name: s for s in _SPECS}

# The 13 task files (names without ".json"), in the order of SPEC section 1.
TASK_FILES: tuple[str, ...] = tuple(TASKS)

# sha256 of each released file, keyed by file name with ".json" (as `sha256sum` prints them).
SHA256: dict[str, str] = {s.file_name: s.sha256 for s in _SPECS}


def task_name(name_or_path: str | Path) -> str:
    """'classifier_order', 'classifier_order.json' or a path to it -> 'classifier_order' (not checked)."""
    name = Path(name_or_path).name
    return name[: -len(".json")] if name.endswith(".json") else name


def get_task(name_or_path: str | Path) -> TaskSpec:
    """The TaskSpec of a task file; an unknown file name is an error (ICLEval has exactly these 13 files)."""
    name = task_name(name_or_path)
    spec = TASKS.get(name)
    if spec is None:
        raise ICLEvalError(
            f"{Path(name_or_path).name}: unknown ICLEval task file; expected one of "
            f"{', '.join(s.file_name for s in _SPECS)}"
        )
    return spec
