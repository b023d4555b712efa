"""Requests: both forms, rendering, and every validation error naming the id and field."""
import json

import pytest

from sicl_fast.errors import RequestError
from sicl_fast.formats.requests import DEFAULT_TEMPLATE, Request, parse_request, read_requests, render_structured

DEMOS = [{"input": "cat", "output": "animal"}, {"input": "rose", "output": "plant"}]


def test_structured_default_template_and_spans():
    req = parse_request({"id": "a", "demos": DEMOS, "query": "dog"})
    assert req.prompt == "Input: cat\nOutput: animal\n\nInput: rose\nOutput: plant\n\nInput: dog\nOutput:"
    assert [req.prompt[s:e] for s, e in req.output_spans] == ["animal", "plant"]
    assert req.demos_start == 0


def test_structured_instruction_and_custom_template():
    tpl = {"demo": "Q: {input} A: {output}.", "separator": "\n", "query": "Q: {query} A:"}
    req = render_structured("b", DEMOS, "dog", tpl, instruction="Classify.")
    assert req.prompt == "Classify.\n\nQ: cat A: animal.\nQ: rose A: plant.\nQ: dog A:"
    assert req.demos_start == len("Classify.\n\n")
    assert [req.prompt[s:e] for s, e in req.output_spans] == ["animal", "plant"]


def test_raw_form_roundtrip():
    p = "Say hi.\nx -> 1\ny -> 2\nz ->"
    req = parse_request({"id": 7, "prompt": p, "output_spans": [[13, 14], [20, 21]], "demos_start": 8})
    assert req.id == "7" and req.output_spans == ((13, 14), (20, 21)) and req.demos_start == 8


@pytest.mark.parametrize(
    "obj, field, words",
    [
        ({"id": "r", "prompt": "abcdef", "output_spans": [[2, 9]]}, "output_spans[0]", "outside the prompt"),
        ({"id": "r", "prompt": "abcdef", "output_spans": [[3, 3]]}, "output_spans[0]", "empty"),
        ({"id": "r", "prompt": "abcdef", "output_spans": [[1, 4], [3, 5]]}, "output_spans[1]", "overlaps"),
        ({"id": "r", "prompt": "abcdef", "output_spans": [[4, 5], [1, 2]]}, "output_spans[1]", "precedes"),
        ({"id": "r", "prompt": "abcdef", "output_spans": []}, "output_spans", "no demonstrations"),
        ({"id": "r", "prompt": "abcdef", "output_spans": [[1, 2]], "demos_start": 3}, "output_spans[0]", "demos_start"),
        ({"id": "r", "prompt": "abcdef", "output_spans": [[1, 2]], "demos_start": 99}, "demos_start", "integer"),
        ({"id": "r", "prompt": "", "output_spans": [[0, 1]]}, "prompt", "non-empty"),
        ({"id": "r", "prompt": "abc", "output_spans": [[0, 1]], "extra": 1}, "extra", "unknown field"),
        ({"id": "r", "demos": [], "query": "q"}, "demos", "no demonstrations"),
        ({"id": "r", "demos": [{"input": "a", "output": ""}], "query": "q"}, "demos[0].output", "empty"),
        ({"id": "r", "demos": [{"input": "a"}], "query": "q"}, "demos[0]", "output"),
        ({"id": "r", "demos": DEMOS}, "query", "missing"),
        ({"id": "r", "demos": DEMOS, "query": "q", "template": {"demo": "{input}"}}, "template.demo", "{output}"),
        ({"id": "r", "demos": DEMOS, "query": "q", "template": {"bogus": "x"}}, "template", "unknown keys"),
    ],
)
def test_validation_names_id_and_field(obj, field, words):
    with pytest.raises(RequestError) as exc:
        parse_request(obj)
    msg = str(exc.value)
    assert "'r'" in msg and f"'{field}'" in msg and words in msg


def test_missing_id_and_unknown_form():
    with pytest.raises(RequestError, match="field 'id'"):
        parse_request({"prompt": "abc", "output_spans": [[0, 1]]})
    with pytest.raises(RequestError, match="needs either"):
        parse_request({"id": "z", "text": "abc"})


def test_read_requests_reports_file_and_line(tmp_path):
    f = tmp_path / "r.jsonl"
    good = {"id": "a", "demos": DEMOS, "query": "x"}
    f.write_text(json.dumps(good) + "\n\n" + "{not json\n")
    with pytest.raises(RequestError, match=r"r.jsonl:3: invalid JSON"):
        list(read_requests(f))
    f.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(RequestError, match=r"r.jsonl:2: duplicate request id 'a'"):
        list(read_requests(f))
    with pytest.raises(RequestError, match="not found"):
        list(read_requests(tmp_path / "missing.jsonl"))


def test_request_is_validated_on_construction():
    with pytest.raises(RequestError):
        Request(id="c", prompt="abc", output_spans=((0, 5),))
    assert set(DEFAULT_TEMPLATE) == {"demo", "separator", "query", "instruction_separator"}
