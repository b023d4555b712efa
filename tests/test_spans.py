"""Character spans -> token spans on the real SmolLM2 tokenizer, the prefix, and span/context errors."""
import pytest

from sicl_fast.errors import ContextLengthError, RequestError
from sicl_fast.formats.requests import Request, parse_request
from sicl_fast.formats.spans import token_spans_from_offsets, tokenize

pytestmark = pytest.mark.slow


def decode_span(tok, prompt, span):
    return tok.decode(prompt.input_ids[span[0]:span[1]].tolist())


def test_structured_spans_cover_outputs(smol):
    tok = smol.tokenizer
    req = parse_request({"id": "s", "instruction": "Map words.",
                         "demos": [{"input": "cat", "output": "animal kingdom"}, {"input": "rose", "output": "plant"}],
                         "query": "dog"})
    p = tokenize(req, tok)
    texts = [decode_span(tok, p, s) for s in p.token_spans]
    assert "animal kingdom" in texts[0] and "plant" in texts[1]
    assert "Input" not in "".join(texts)  # no token leaks from the demo inputs
    # the instruction is the fixed prefix: the first perturbed row is the first token of "Input: cat"
    assert tok.decode(p.input_ids[: p.demo_start].tolist()) == "Map words.\n\n"
    assert p.demo_end == p.token_spans[-1][1] < p.length
    assert p.positions.tolist() == [t for s, e in p.token_spans for t in range(s, e)]
    assert p.offsets.tolist()[-1] == p.positions.numel()


def test_span_at_position_zero_loses_its_first_token(smol):
    req = Request(id="z", prompt="hello world\nInput: a\nOutput: b", output_spans=((0, 11), (29, 30)))
    p = tokenize(req, smol.tokenizer)
    assert p.token_spans[0][0] == 1
    one = Request(id="z1", prompt="hello world", output_spans=((0, 5),))
    with pytest.raises(RequestError, match="first token only"):
        tokenize(one, smol.tokenizer)


def test_spans_sharing_a_token_are_rejected(smol):
    # "abcdef" is one or few tokens; two spans inside the same token must fail with the span index
    req = Request(id="shared", prompt="xx abcdefgh yy", output_spans=((3, 5), (5, 7)))
    with pytest.raises(RequestError, match=r"'shared'.*output_spans\[1\].*shares token"):
        tokenize(req, smol.tokenizer)


def test_context_length_error_names_request(smol):
    req = Request(id="long", prompt="word " * 50, output_spans=((0, 4),))
    with pytest.raises(ContextLengthError, match=r"'long'.*exceed the model's context of 20"):
        tokenize(req, smol.tokenizer, max_context=20)
    with pytest.raises(ContextLengthError, match="plus 30 tokens to generate"):
        tokenize(req, smol.tokenizer, max_context=60, reserve=30)


def test_special_tokens_join_the_prefix():
    # offsets of a BOS-led encoding: BOS (0, 0) then "ab" "cd" "ef"
    offs = [(0, 0), (0, 2), (2, 4), (4, 6)]
    special = [True, False, False, False]
    assert token_spans_from_offsets(offs, ((2, 4), (4, 6)), special) == [(2, 3), (3, 4)]
    with pytest.raises(RequestError, match="covers no token"):
        token_spans_from_offsets(offs, ((6, 6),), special)
