"""Greedy decoding from embeddings: equals transformers' greedy generate from ids; stop rules."""
import pytest

from conftest import synthetic_prompt
from sicl_fast.backends import make_backend
from sicl_fast.errors import NumericalError, SiclError
from sicl_fast.backends.generate import cut_at_stops, greedy_generate


def hf_greedy_ids(lm, ids, n):
    out = lm.model.generate(ids.unsqueeze(0), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0, min_new_tokens=n)
    return out[0, ids.numel():].tolist()


def test_matches_transformers_greedy_from_ids(tiny_llama):
    p = synthetic_prompt(25, [(5, 9)], a=2, vocab=tiny_llama.config.vocab_size, seed=7)
    hf = make_backend("hf", tiny_llama)
    eos_free = set()
    orig = type(tiny_llama).eos_token_ids
    try:
        type(tiny_llama).eos_token_ids = property(lambda self: eos_free)  # decode the full length
        gen = greedy_generate(tiny_llama, hf.embed(p), max_new_tokens=6)
    finally:
        type(tiny_llama).eos_token_ids = orig
    assert gen.token_ids == hf_greedy_ids(tiny_llama, p.input_ids, 6)
    assert gen.stop_reason == "max_new_tokens" and len(gen.token_ids) == 6


@pytest.mark.slow
def test_real_model_answers_and_stops_on_newline(smol):
    from sicl_fast import Engine

    eng = Engine(smol)
    p = eng.prepare({"id": "g", "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"},
                                          {"input": "three", "output": "3"}], "query": "five"})
    g = eng.generate(p, max_new_tokens=10)
    assert g.answer == "5" and g.stop_reason == "stop_string" and "\n" in g.text
    g2 = eng.generate(p, max_new_tokens=1, stop_strings=())
    assert len(g2.token_ids) == 1 and g2.stop_reason == "max_new_tokens"
    g3 = eng.generate(p, max_new_tokens=10, stop_strings=(), stop_fn=lambda t: "5" in t)
    assert g3.stop_reason == "stop_string" and g3.answer.startswith("5")


def test_cut_at_stops():
    assert cut_at_stops("  True\n\nInput: x", ["\n"]) == "True"
    assert cut_at_stops(" a, b\nInput:", ["\nInput:", ","]) == "a"
    assert cut_at_stops(" plain ", []) == "plain"


def test_bad_generation_inputs(tiny_llama):
    p = synthetic_prompt(10, [(3, 5)], a=1, vocab=tiny_llama.config.vocab_size)
    X = make_backend("hf", tiny_llama).embed(p)
    with pytest.raises(SiclError, match="max_new_tokens"):
        greedy_generate(tiny_llama, X, -1)
    with pytest.raises(SiclError, match="exceeds the context of 512"):
        greedy_generate(tiny_llama, X, 600)
    X[2, 2] = float("inf")
    with pytest.raises(NumericalError):
        greedy_generate(tiny_llama, X, 3)
    assert greedy_generate(tiny_llama, X[:, :0].new_zeros(10, 32), 0).token_ids == []
