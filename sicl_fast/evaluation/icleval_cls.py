"""ICLEval's classification subset, as the label-scoring baselines need it.

Order Check (classifier_order) and Duplication Check (classifier_duplication): labels True / False (JSON bools,
scored by BOOL); Format Check (classifier_format): table / csv / tuple / xml / yaml / jsonl (EXACT, case-sensitive).

Every query of these files has the form  "Input:" BODY "\\nOutput:" TAIL  (TAIL "" or " "). From a sample this
module builds, always through the icleval loader's Sample and `render`:
  * the scoring context: the rendered prompt with trailing spaces removed; a label is scored as the continuation
    " " + label (so "Output: " + "csv" is scored as "Output:" + " csv", the way the tokenizer splits it);
  * content-free queries (Zhao et al. 2021): BODY replaced by a content-free string ("N/A", "", "[MASK]"). When
    BODY is a block of "Name: value" lines (Order Check: "String1: ... / String2: ..."), each value is replaced and
    the field names are kept, as done for multi-input tasks; otherwise the whole BODY is replaced;
  * the DC-PMI domain premise: "delimiter" = the answer delimiter alone ("Output:"), or "demos" = the
    demonstrations followed by the delimiter (the prompt with the query input removed);
  * the demonstration blocks, and the sample with its demonstrations reordered (DEmO).
"""
from __future__ import annotations

import dataclasses
import re

from ..errors import SiclError
from ..icleval.loader import Sample
from ..icleval.render import render

CLASSIFICATION_LABELS: dict[str, tuple[str, ...]] = {
    "classifier_order": ("True", "False"),
    "classifier_duplication": ("True", "False"),
    "classifier_format": ("table", "csv", "tuple", "xml", "yaml", "jsonl"),
}
CONTENT_FREE_INPUTS: tuple[str, ...] = ("N/A", "", "[MASK]")  # Zhao et al. 2021
DCPMI_PREMISES = ("delimiter", "demos")

_INPUT = "Input:"
_DELIM = "\nOutput:"
_FIELD = re.compile(r"^([A-Za-z][A-Za-z0-9_]*):(.*)$")
# files whose query input is a template of named fields (kept in content-free queries)
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {"classifier_order": ("String1", "String2")}


def is_classification(task_file: str) -> bool:
    return task_file in CLASSIFICATION_LABELS


def labels_for(sample: Sample) -> tuple[str, ...]:
    """The label texts of the sample's file; the gold label must be one of them."""
    labels = CLASSIFICATION_LABELS.get(sample.task_file)
    if labels is None:
        raise SiclError(
            f"{sample.task_file}: not a classification file (expected one of {sorted(CLASSIFICATION_LABELS)})"
        )
    gold = label_text(sample)
    if gold not in labels:
        raise SiclError(f"{sample.task_file}: uid {sample.uid}: label {gold!r} is not one of {labels}")
    return labels


def label_text(sample: Sample) -> str:
    """The gold label as the model should write it ("True" for a JSON true)."""
    return str(sample.label) if isinstance(sample.label, bool) else sample.label


def continuations(labels) -> list[str]:
    """What is scored after the context: " " + label (sum of its tokens' log-probabilities)."""
    return [" " + lab for lab in labels]


def _split_query(sample: Sample) -> tuple[str, str]:
    """(BODY, TAIL) of the query "Input:" BODY "\\nOutput:" TAIL."""
    q = sample.prompt
    k = q.rfind(_DELIM)
    if not q.startswith(_INPUT) or k < 0 or q[k + len(_DELIM):].strip():
        raise SiclError(f"{sample.task_file}: uid {sample.uid}: query does not have the form 'Input: ...\\nOutput:'")
    return q[len(_INPUT):k], q[k + len(_DELIM):]


def content_free_query(sample: Sample, cf: str) -> str:
    """The sample's query with its input replaced by the content-free string `cf`."""
    body, tail = _split_query(sample)
    fields = TEMPLATE_FIELDS.get(sample.task_file)
    lines = body.lstrip(" ").split("\n")
    matches = [_FIELD.match(x) for x in lines[1:]]
    if fields and lines[0] == "" and tuple(m.group(1) if m else None for m in matches) == fields:
        # the template's named fields: keep the names, blank every value
        new_body = " \n" + "\n".join(f"{name}:{' ' + cf if cf else ''}" for name in fields)
    else:
        new_body = " " + cf
    return _INPUT + new_body + _DELIM + tail


def with_query(sample: Sample, query: str) -> Sample:
    return dataclasses.replace(sample, prompt=query, raw={**sample.raw, "prompt": query})


def scoring_context(sample: Sample) -> str:
    """The rendered prompt with trailing spaces removed (the label continuation brings its own space)."""
    return render(sample).prompt.rstrip(" ")


def content_free_contexts(sample: Sample, cf_inputs=CONTENT_FREE_INPUTS) -> list[str]:
    return [scoring_context(with_query(sample, content_free_query(sample, cf))) for cf in cf_inputs]


def delimiter(sample: Sample) -> str:
    """The answer delimiter the query ends with ("Output:")."""
    return _DELIM.lstrip("\n")


def examples_text(sample: Sample) -> str:
    return sample.raw["exmaples"] if sample.spec.render_rule == "R-EXM" else sample.raw["examples"]


def dcpmi_premise(sample: Sample, mode: str = "delimiter") -> str:
    """The domain premise of DC-PMI: "delimiter" -> "Output:"; "demos" -> demonstrations + "Output:"."""
    _split_query(sample)  # validates the query form
    if mode == "delimiter":
        return delimiter(sample)
    if mode == "demos":
        return examples_text(sample) + delimiter(sample)
    raise SiclError(f"unknown DC-PMI premise {mode!r}; choose one of {DCPMI_PREMISES}")


def zero_shot_context(sample: Sample) -> str:
    """The query alone, no demonstrations (DEmO's reference distribution)."""
    return sample.prompt.rstrip(" ")


def demo_blocks(sample: Sample) -> list[str]:
    """The demonstrations as blocks ("Input: ...\\nOutput: y\\n\\n"), in prompt order; they join to `examples`."""
    ex = examples_text(sample)
    marker = sample.spec.block_marker
    if not marker or not ex.startswith(marker):
        raise SiclError(f"{sample.task_file}: uid {sample.uid}: demonstrations do not start with {marker!r}")
    starts = [0]
    pos = ex.find("\n\n" + marker)
    while pos >= 0:
        starts.append(pos + 2)
        pos = ex.find("\n\n" + marker, pos + 2)
    blocks = [ex[a:b] for a, b in zip(starts, starts[1:] + [len(ex)])]
    if "".join(blocks) != ex or not all(b.endswith("\n\n") for b in blocks):
        raise SiclError(f"{sample.task_file}: uid {sample.uid}: cannot split the demonstrations into blocks")
    return blocks


def reordered(sample: Sample, order) -> Sample:
    """The sample with its demonstration blocks in `order` (a permutation of range(#blocks))."""
    blocks = demo_blocks(sample)
    if sorted(order) != list(range(len(blocks))):
        raise SiclError(f"order {list(order)} is not a permutation of {len(blocks)} demonstrations")
    key = "exmaples" if sample.spec.render_rule == "R-EXM" else "examples"
    return dataclasses.replace(sample, raw={**sample.raw, key: "".join(blocks[i] for i in order)})


__all__ = [
    "CLASSIFICATION_LABELS", "CONTENT_FREE_INPUTS", "DCPMI_PREMISES", "is_classification", "labels_for",
    "label_text", "continuations", "content_free_query", "with_query", "scoring_context", "content_free_contexts",
    "delimiter", "dcpmi_premise", "zero_shot_context", "demo_blocks", "reordered", "examples_text",
]
