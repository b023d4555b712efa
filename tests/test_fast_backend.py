"""fast backend: own forward == the hf backend on tiny random-weight models of every supported family.

Llama (llama3 rope scaling, attention biases), Qwen3 (q/k norms), Gemma 2 (sliding window shorter than the
prompt, attention and final soft-capping; HF in eager mode so it soft-caps), Gemma 3 text (sliding / full layers
with their own rope, linear scaling on the global one). Norm weights are randomised so (1 + w) vs w matters.
"""
import functools
import math

import pytest
import torch

from conftest import reference_backend
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends.generate import greedy_generate
from sicl_fast.models import from_transformers
from sicl_fast.models.attention import attend_math
from sicl_fast.models.transformer import UnsupportedModelError, rope_inv_freq
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt

# the families of the tiny models here and in the modules that share them (tests/conftest.py's `models`); the
# later families (sicl_fast.models.decoder_config.SUPPORTED_FAMILIES) have their own in tests/test_fast_families.py
SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text")
TOL = dict(rtol=1e-4, atol=1e-4)
V, D, L, WINDOW = 256, 64, 48, 8
SPANS = ((14, 20), (26, 31))
B_END = 31
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)


class CharTokenizer:
    """Just enough tokenizer for generation: ids -> letters."""

    eos_token_id = None
    all_special_ids: list = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@torch.no_grad()
def randomize_norms_and_biases(model) -> None:
    """Norm weights moved off their init and biases drawn, in place: so that w against 1 + w, or a bias left out,
    changes the logits a test compares."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.2 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)


def build(family: str, dtype=torch.float32, layers: int = 3, tokenizer=None):
    """layers < 3: the same model shapes with fewer decoder layers (for the slow paths: Triton's interpreter).
    tokenizer: a real one (its vocabulary sets the model's), for tests that tokenize text; else CharTokenizer."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed({"llama": 1, "qwen3": 2, "gemma2": 3, "gemma3_text": 4}[family])
    common = {**COMMON, "num_hidden_layers": layers}
    if tokenizer is not None:
        common["vocab_size"] = len(tokenizer)
    if family == "llama":
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            **common, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "qwen3":
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(**common)
    elif family == "gemma2":
        cls, cfg = Gemma2ForCausalLM, Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                   final_logit_softcapping=5.0, attn_logit_softcapping=2.0)
    else:
        cls, cfg = Gemma3ForCausalLM, Gemma3TextConfig(
            **common, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"][:layers],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})
    model = cls(cfg)
    if family == "gemma2":
        model.config._attn_implementation = "eager"  # HF's SDPA path ignores the attention soft-cap
    randomize_norms_and_biases(model)
    model.to(dtype)
    return from_transformers(model, tokenizer or CharTokenizer(), name=f"tiny-{family}")


@functools.cache
def tiny_models() -> dict:
    """One tiny model per family, built once for the whole session (the `models` fixture of tests/conftest.py;
    nothing may change their weights or config)."""
    return {f: build(f) for f in SUPPORTED_FAMILIES}


def make_prompt(a: int, seed: int = 0) -> Prompt:
    g = torch.Generator().manual_seed(seed)
    return Prompt(request=Request(id="t", prompt="x" * 100, output_spans=((10, 20),)),
                  input_ids=torch.randint(0, V, (L,), generator=g), token_spans=SPANS, demo_start=a,
                  demo_end=B_END)


def perturbed(X: torch.Tensor, a: int, B: int = 5, scale: float = 0.05, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch = X[:B_END].unsqueeze(0).repeat(B, 1, 1)
    batch[1:, a:B_END] += scale * torch.randn(B - 1, B_END - a, X.shape[1], generator=g)
    return batch


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_span_logprobs_match_hf(models, family):
    lm = models[family]
    hf, fast = reference_backend("hf", lm), reference_backend("fast", lm)
    nocache = reference_backend("fast", lm, prefix_cache=False)
    # a = 0: no prefix; 6: a prefix; 14: the first span starts at a (its first prediction is a prefix row)
    for a in (0, 6, 14):
        p = make_prompt(a, seed=a)
        X = perturbed(hf.embed(p), a)
        ref = hf.span_logprobs(X, p)
        got = fast.span_logprobs(X, p)
        assert got.shape == ref.shape == (5, 11) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, **TOL)
        torch.testing.assert_close(nocache.span_logprobs(X, p), ref, **TOL)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_the_prompt_exercises_window_and_softcap(models, family):
    """The parity test would catch a missing sliding window / soft-cap: turning them off changes the numbers."""
    lm = models[family]
    p = make_prompt(6)
    hf, fast = reference_backend("hf", lm), reference_backend("fast", lm)
    X = perturbed(hf.embed(p), 6)
    ref = hf.span_logprobs(X, p)
    for layer in fast.model.layers:
        layer.window = None
    assert (fast.span_logprobs(X, p) - ref).abs().max() > 1e-3
    if family == "gemma2":
        fast = reference_backend("fast", lm)
        fast.model.attention.softcap = None
        assert (fast.span_logprobs(X, p) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("diff", ["off", "bf16"])
def test_prefix_policies(models, monkeypatch, diff):
    """The step forward's prefix policies (sicl_fast.backends.step_forward): 'kept' computes the prefix once, from
    X0, and gives what 'pass' (the prefix rows in every call) and 'none' (every batch row runs the full rows) give
    on batches whose prefix rows are X0's; 'pass' follows prefix rows that changed (the whole-matrix projection
    rescales them), which 'kept' is never used for. Plain products and the difference form alike."""
    lm = models["gemma3_text"]
    a = 6
    p = make_prompt(a)
    hf, fast = reference_backend("hf", lm), reference_backend("fast", lm, diff_matmul=diff)
    m = fast.model
    built = []
    for name in ("prefix_kv", "prefix_rows"):
        real = getattr(m, name)
        monkeypatch.setattr(m, name, lambda rows, _real=real: built.append(1) or _real(rows))
    X0 = fast.embed(p)
    X, X2 = perturbed(X0, a), perturbed(X0, a, seed=7)
    kept = fast.step_forward(p, "kept", 5, X0)
    assert len(built) == 1
    got = [kept(X), kept(X2)]
    assert len(built) == 1  # the calls reuse it
    # the difference form's row 0 is a bf16 product: within bf16's error of the float32 path, differences kept
    tol = TOL if diff == "off" else dict(rtol=0, atol=5e-2)
    for policy in ("pass", "none"):
        fwd = fast.step_forward(p, policy, 5)
        for batch, ref in zip((X, X2), got):
            torch.testing.assert_close(fwd(batch), ref, rtol=0, atol=2e-6 if diff == "off" else 2e-3)
    for batch in (X, X2, X * 0.9):  # the last: a rescaled prefix
        torch.testing.assert_close(fast.step_forward(p, "pass", 5)(batch), hf.span_logprobs(batch, p), **tol)
    assert fast.step_forward(make_prompt(0), "kept", 5).policy == "none"  # no prefix rows: nothing to keep


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_calibration_history_matches_hf(models, family):
    lm = models[family]
    cfg = CalibrationConfig(N=4, max_steps=3, tau=0, scale=1.0, seed=1)
    p = make_prompt(6)
    ref = Calibrator(reference_backend("hf", lm), cfg).run(p)  # the torch ops on both: only the backends differ
    fast = reference_backend("fast", lm, diff_matmul="off")  # every product in float32 (test_diff_products.py: bf16)
    got = Calibrator(fast, cfg).run(p)
    assert len(got.history) == len(ref.history) == 3
    assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5) for x, y in zip(got.history, ref.history))
    torch.testing.assert_close(got.embeddings, ref.embeddings, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_generation_matches_hf(models, family):
    lm = models[family]
    fast = reference_backend("fast", lm)
    p = make_prompt(6, seed=3)
    X = fast.embed(p)  # the whole prompt (query included): 48 rows, past the sliding window
    for stops in ((), ("zz",)):
        ref = greedy_generate(lm, X, max_new_tokens=12, stop_strings=stops)
        got = fast.generate(X, p, max_new_tokens=12, stop_strings=stops)
        assert type(got) is type(ref)
        assert got.token_ids == ref.token_ids and len(got.token_ids) > 0
        assert (got.text, got.answer, got.stop_reason) == (ref.text, ref.answer, ref.stop_reason)
    assert fast.generate(X, p, max_new_tokens=0).token_ids == []


def test_generation_stops_like_hf(models):
    lm = models["llama"]
    fast = reference_backend("fast", lm)
    p = make_prompt(6, seed=3)
    X = fast.embed(p)
    first = greedy_generate(lm, X, max_new_tokens=6).token_ids
    lm.model.generation_config.eos_token_id = first[2]  # the third token becomes EOS
    try:
        got, ref = fast.generate(X, p, max_new_tokens=6), greedy_generate(lm, X, max_new_tokens=6)
    finally:
        lm.model.generation_config.eos_token_id = None
    assert got.stop_reason == ref.stop_reason == "eos" and got.token_ids == ref.token_ids == first[:2]
    stop = CharTokenizer().decode(first[1:2])
    got, ref = fast.generate(X, p, 6, stop_strings=(stop,)), greedy_generate(lm, X, 6, stop_strings=(stop,))
    assert got.stop_reason == ref.stop_reason == "stop_string" and got.token_ids == ref.token_ids


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_sdpa_kernels_match_math(models, family):
    """attn='sdpa' (torch's fused kernels with log-sum-exp, on the CPU) gives the math path's numbers."""
    lm = models[family]
    math_b, sdpa_b = reference_backend("fast", lm, attn="math"), reference_backend("fast", lm, attn="sdpa")
    for a in (0, 6):
        p = make_prompt(a)
        X = perturbed(math_b.embed(p), a)
        torch.testing.assert_close(sdpa_b.span_logprobs(X, p), math_b.span_logprobs(X, p), rtol=1e-5, atol=1e-5)
    m = sdpa_b.model
    assert m.attention.max_error(m.H, m.Hk, m.hd) < 1e-4
    m.attention.verify(m.H, m.Hk, m.hd, fallback=False)  # what a CUDA machine runs once, when the plan is made
    assert m.attention.impl == "sdpa"


def test_attention_verify_falls_back_loudly_or_raises(models, monkeypatch):
    """A fused kernel that disagrees with the math path: 'auto' warns and takes math; a named kernel raises."""
    from sicl_fast.errors import SiclError
    from sicl_fast.models import attention

    real = attention.attend_sdpa
    monkeypatch.setattr(attention, "attend_sdpa", lambda *a: (lambda o: (o[0] * 1.5, o[1]) if o else o)(real(*a)))
    m = reference_backend("fast", models["llama"], attn="sdpa").model
    with pytest.raises(SiclError, match="'sdpa' attention failed its check on this machine: "
                       r"scaled_dot_product_attention \(float32, head_dim 16\) differs from the math path"):
        m.attention.verify(m.H, m.Hk, m.hd, fallback=False)
    with pytest.warns(RuntimeWarning, match="differs from the math path.*using 'math'"):
        m.attention.verify(m.H, m.Hk, m.hd, fallback=True)
    assert m.attention.impl == "math"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_runs_and_stays_close(models, family):
    lm32 = models[family]
    lm16 = build(family, torch.bfloat16)
    p = make_prompt(6)
    X = perturbed(reference_backend("hf", lm32).embed(p), 6)
    ref32 = reference_backend("hf", lm32).span_logprobs(X, p)
    hf16 = reference_backend("hf", lm16).span_logprobs(X, p)
    got16 = reference_backend("fast", lm16).span_logprobs(X, p)
    assert got16.dtype == torch.float32 and bool(torch.isfinite(got16).all())
    # bf16 vs bf16: the same computation up to rounding order; vs float32: within bf16's own error
    assert (got16 - hf16).abs().max() < 0.05
    assert (got16 - ref32).abs().max() <= max(0.05, 2 * float((hf16 - ref32).abs().max()))
    g = reference_backend("fast", lm16).generate(X[0], p, 4)
    assert len(g.token_ids) > 0 or g.stop_reason == "eos"


def test_rope_tables_match_transformers(models):
    for family in ("llama", "gemma3_text"):
        rot = models[family].decoder.rotary_emb
        fast = reference_backend("fast", models[family]).model
        for kind, r in fast.rotary.items():
            buf = rot.inv_freq if kind == "all" else getattr(rot, f"{kind}_inv_freq")
            assert torch.equal(r.inv_freq, buf)
    inv, _ = rope_inv_freq({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 16)
    plain, _ = rope_inv_freq({"rope_theta": 500000.0}, 16)
    assert inv[0] == plain[0] and inv[-1] == plain[-1] / 8  # high frequencies kept, low ones divided


def test_shared_prefix_attention_equals_copied():
    """Keys every batch row shares (batch 1, folded into the query rows) == the same keys copied per row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 5, 4, 8, generator=g), torch.randn(1, 7, 2, 8, generator=g), torch.randn(1, 7, 2, 8,
                                                                                                       generator=g)
    bias = torch.zeros(5, 1, 7).masked_fill_(torch.rand(5, 1, 7, generator=g) < 0.3, -math.inf)
    bias[0] = -math.inf  # a query that sees nothing: o = 0, lse = -inf
    o1, l1 = attend_math(q, k, v, bias, 0.3, 7.0)
    o2, l2 = attend_math(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), bias, 0.3, 7.0)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    assert bool((o1[:, 0] == 0).all()) and bool((l1[:, 0] == -math.inf).all())


def test_unsupported_family_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    lm = from_transformers(GPT2LMHeadModel(cfg), CharTokenizer(), name="tiny-gpt2")
    with pytest.raises(UnsupportedModelError, match="llama, qwen3, gemma2, gemma3_text.*'gpt2'"):
        reference_backend("fast", lm)


@pytest.mark.slow
def test_smollm2_matches_hf(smol):
    from sicl_fast.formats.requests import parse_request
    from sicl_fast.formats.spans import tokenize

    req = parse_request({"id": "s", "instruction": "Convert number words to digits.",
                         "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"},
                                   {"input": "ten", "output": "10"}], "query": "two"})
    p = tokenize(req, smol.tokenizer)
    assert p.demo_start > 0
    hf, fast = reference_backend("hf", smol), reference_backend("fast", smol)
    X = perturbed_rows(hf.embed(p), p, B=3, scale=0.005)
    torch.testing.assert_close(fast.span_logprobs(X, p), hf.span_logprobs(X, p), **TOL)
    X0 = hf.embed(p)
    assert fast.generate(X0, p, 6, stop_strings=("\n",)).token_ids == greedy_generate(
        smol, X0, 6, stop_strings=("\n",)).token_ids


def perturbed_rows(X, p, B, scale):
    g = torch.Generator().manual_seed(0)
    batch = X[:p.demo_end].unsqueeze(0).repeat(B, 1, 1)
    a, b = p.demo_start, p.demo_end
    batch[1:, a:b] += scale * torch.randn(B - 1, b - a, X.shape[1], generator=g)
    return batch
