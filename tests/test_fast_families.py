"""The later families of the fast backend (issue 47) against the models' own logits: tiny random-weight models of
Qwen2 (q / k / v biases, a window on the layers past max_window_layers, yarn rope), Mistral (a window on every
layer, dynamic rope past max_position_embeddings), Ministral (windows per layer type, yarn with mscale), Phi-3 (fused
qkv_proj and gate_up_proj, partial rotary, longrope past original_max_position_embeddings), Granite (embedding,
residual, attention and logits multipliers, biases), OLMo 2 (norms after attention and MLP only, q / k norms over
the whole projection) and SmolLM3 (a layer without rope), two layers each. The oracle is plain transformers with
eager attention: the model's own logits over the whole prompt (the query's rows included: the length is the
prompt's, which dynamic and longrope read), log-softmaxed at the span positions.

Paths and tolerances (the bar of tests/test_fast_backend.py and tests/test_fused_decoder.py): float32 products (the
torch reference, the C++ ops, Triton's): the span log-probs within 1e-5 relative / absolute and the proxy f within
1e-5 relative (measured: <= 3.3e-6 absolute and 9e-7 relative); the difference form (bf16 products of the rows'
changes): assert_rows_close, row 0 within 1e-4 and each row's change from row 0 within 2-3 % of the largest. Both
projection scopes where the passes differ: 'demos' (the prefix's K/V kept) and 'prompt' (the prefix rows in every
pass as its lead rows). The C++ path runs every family; Triton's (under the interpreter: slow) runs OLMo 2 and Phi-3,
whose kernels changed most (norms, rotary), the op tests (tests/test_ops.py, tests/test_rows_ops.py) cover every
feature on every implementation.
"""
import dataclasses

import pytest
import torch

from conftest import reference_backend
from sicl_fast.backends import build_backend, make_backend
from sicl_fast.backends.generate import greedy_generate
from sicl_fast.calibration.ascent import Calibrator
from sicl_fast.calibration.static import StaticStep
from sicl_fast.diagnostics.profile import kernels_per_step
from sicl_fast.errors import SiclError
from sicl_fast.models import from_transformers
from sicl_fast.models.decoder_config import DecoderConfig, UnsupportedModelError
from sicl_fast.ops import cpp_ops
from sicl_fast.run.plan import make_plan
from sicl_fast.step.proxy import proxy_planned
from test_fast_backend import V, CharTokenizer, make_prompt, randomize_norms_and_biases
from test_fused_decoder import BUDGET_PER_LAYER_ROWS, BUDGET_REST_ROWS, CFG, assert_rows_close, one_layer
from test_ops import device_of, why_unavailable
from test_static import HostReadGuard

FAMILIES = ("qwen2", "mistral", "ministral", "phi3", "granite", "olmo2", "smollm3")
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
F32 = dict(rtol=1e-5, atol=1e-5)
SCOPES = {"demos": 14, "prompt": 6}  # projection scope -> the prefix rows a (14: a span starts right at row a)


def config(family: str):
    """(model class, config) of a tiny model of `family` with its quirks on (module docstring); the prompt has 48
    tokens, past the windows (8), dynamic's max_position_embeddings (32) and longrope's pretraining length (16)."""
    import transformers as T

    if family == "qwen2":
        return T.Qwen2ForCausalLM, T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                                max_window_layers=1, rope_parameters={
                                                    "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                    "original_max_position_embeddings": 16})
    if family == "mistral":
        return T.MistralForCausalLM, T.MistralConfig(**{**COMMON, "max_position_embeddings": 32}, sliding_window=8,
                                                     rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 1e4})
    if family == "ministral":
        return T.MinistralForCausalLM, T.MinistralConfig(**COMMON, sliding_window=8,
                                                         layer_types=["sliding_attention", "full_attention"],
                                                         rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                                          "rope_theta": 1e4, "mscale": 1.0,
                                                                          "mscale_all_dim": 0.5,
                                                                          "original_max_position_embeddings": 32})
    if family == "phi3":
        return T.Phi3ForCausalLM, T.Phi3Config(**{**COMMON, "max_position_embeddings": 64},
                                               original_max_position_embeddings=16, rope_parameters={
                                                   "rope_type": "longrope", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                   "long_factor": [2.0, 3.0, 5.0, 9.0]})
    if family == "granite":
        return T.GraniteForCausalLM, T.GraniteConfig(**COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                     attention_multiplier=0.2, logits_scaling=3.0,
                                                     attention_bias=True, mlp_bias=True)
    if family == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**COMMON)
    return T.SmolLM3ForCausalLM, T.SmolLM3Config(**COMMON, no_rope_layers=[1, 0])


def build(family: str):
    """A tiny model of `family` (config), eager attention, its norm weights and biases randomised (so that w, 1 + w
    and a missing bias would show)."""
    torch.manual_seed(FAMILIES.index(family) + 11)
    cls, cfg = config(family)
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    randomize_norms_and_biases(model)
    return from_transformers(model, CharTokenizer(), name=f"tiny-{family}")


@pytest.fixture(scope="module")
def fams():
    return {f: build(f) for f in FAMILIES}


def own_logprobs(lm, batch: torch.Tensor, prompt, X0: torch.Tensor) -> torch.Tensor:
    """The model's own log-probs [B, P] of the span tokens: transformers' forward (eager attention) over the whole
    prompt, batch [B, >= b, d]'s rows [0, b) then X0's rows [b, L), from a fresh rotary state (transformers' dynamic
    rope keeps the longest length it has seen)."""
    rot = lm.decoder.rotary_emb
    if hasattr(rot, "original_inv_freq"):
        rot.inv_freq, rot.max_seq_len_cached = rot.original_inv_freq, rot.original_max_seq_len
    b = prompt.demo_end
    x = torch.cat([batch[:, :b], X0[b:].expand(batch.shape[0], -1, -1)], dim=1)
    with torch.no_grad():
        lp = torch.log_softmax(lm.model(inputs_embeds=x.to(lm.dtype)).logits.float(), dim=-1)
    return lp[:, prompt.positions - 1].gather(-1, prompt.targets.view(1, -1, 1).expand(x.shape[0], -1, 1))[..., 0]


def step_and_own(lm, name: str, impl: str, scope: str, diff: str = "off"):
    """((f, lp) of a static step's first perturbation batch on backend `name`, (f, lp) of the model's own logits on
    that batch), the step: the proxy of both by the reference (step.proxy) on the step's plan."""
    a = SCOPES[scope]
    p = make_prompt(a, seed=a + 2)
    be = make_backend(name, lm, impl=impl, diff_matmul=diff)
    X0 = be.embed(p)
    st = StaticStep(be, Calibrator(be, dataclasses.replace(CFG, projection_scope=scope)).config, p, X0)
    assert st.forward.policy == ("kept" if scope == "demos" else "pass")
    st.perturb()
    lp = st.forward(st.batch)
    own = own_logprobs(lm, st.batch, p, X0)
    return (st.ops.proxy_planned(lp, st.proxy_plan).f, lp), (proxy_planned(own, st.proxy_plan).f, own), st


def assert_f32_close(got, ref):
    torch.testing.assert_close(got[1], ref[1], **F32)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_reference_matches_the_models_own_logits(fams, family):
    """The reference ops, float32 products, both prefix policies; the span log-probs of any batch (span_logprobs)
    too."""
    lm = fams[family]
    for scope in SCOPES:
        got, ref, _ = step_and_own(lm, "fast-fp32", "torch", scope)
        assert_f32_close(got, ref)
    p = make_prompt(0, seed=5)
    fast = reference_backend("fast", lm)
    X = fast.embed(p).unsqueeze(0).repeat(3, 1, 1)
    X[1:, :31] += 0.05 * torch.randn(2, 31, X.shape[-1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fast.span_logprobs(X, p), own_logprobs(lm, X, p, X[0]), **F32)


@pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")
@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_paths_match_the_models_own_logits_within_the_launch_budget(fams, family):
    """The C++ ops: float32 products (kept prefix), the difference form with both prefix policies, and the
    difference form's kernels per step: 9 a decoder layer, 30 for the rest (tests/test_cpp_launch_budget.py)."""
    lm = fams[family]
    got, ref, _ = step_and_own(lm, "fast-fp32", "cpp", "demos")
    assert_f32_close(got, ref)
    for scope in SCOPES:
        got, ref, st = step_and_own(lm, "fast", "cpp", scope, diff="bf16")
        assert st.forward.rows_on and st.backend.model.attention.impl == "cpp"
        assert_rows_close(got, ref)
    assert_within_budget(launches(st))


def dry(monkeypatch) -> None:
    """Triton's kernels counted as launched but not run from here on (until monkeypatch.undo): the interpreter's run
    is what costs (a family's count took 28-41 s on this loaded CPU, 0.1 s dry)."""
    import triton.runtime.interpreter as interpreter

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda self, *a, **k: None)


def launches(st, monkeypatch=None) -> tuple:
    """(kernels a step of `st`, a decoder layer's, the rest's), after a forward of its batch (step_and_own: what the
    model keeps, its bf16 weights and rotary tables, is made then, not counted). monkeypatch given: after a first
    step, counted dry (see dry) under the host-read guard (tests/test_static.py), whose exit undoes both: a step that
    reads nothing back launches the same kernels whatever its values hold."""
    if monkeypatch is None:
        n, layer = kernels_per_step(st), one_layer(st)
    else:
        dry(monkeypatch)
        st()
        with HostReadGuard(monkeypatch):
            n, layer = kernels_per_step(st), one_layer(st)
    return n.total, layer, n.total - layer * n.n_layers


def assert_within_budget(counted: tuple) -> None:
    _, layer, rest = counted
    assert 0 < layer <= BUDGET_PER_LAYER_ROWS and 0 < rest <= BUDGET_REST_ROWS, counted


@pytest.mark.parametrize("family,scope", [("olmo2", "prompt"), ("phi3", "demos")])
def test_triton_paths_match_the_models_own_logits(fams, family, scope, monkeypatch):
    """Triton's kernels (the interpreter on the CPU), the difference form against the model's own logits: OLMo 2 with
    the prefix rows as lead rows of the pass (norm_rows without a norm, rope_rows' q / k norms over the whole
    projection), Phi-3 with the prefix's K/V kept (partial rotary, longrope) and its launches per step counted with
    the kernels run and dry (launches), the same (measured: 34, 9 a layer, on Phi-3, Granite and OLMo 2 alike)."""
    if why_unavailable("triton") or device_of("triton") != "cpu":
        pytest.skip(why_unavailable("triton") or "the tiny models live on the CPU")
    got, ref, st = step_and_own(fams[family], "fast", "triton", scope, diff="bf16")
    assert st.forward.rows_on and st.backend.model.attention.impl == "triton"
    assert_rows_close(got, ref)
    if scope == "demos":
        counted = launches(st)
        assert_within_budget(counted)
        assert launches(st, monkeypatch) == counted


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_step_within_the_launch_budget(fams, family, monkeypatch):
    """Triton's difference form, each family and both projection scopes: at most 9 kernels a decoder layer and 30
    for the rest (tests/test_fused_decoder.py's budget), counted dry (launches)."""
    if why_unavailable("triton") or device_of("triton") != "cpu":
        pytest.skip(why_unavailable("triton") or "the tiny models live on the CPU")
    be = make_backend("fast", fams[family], impl="triton", diff_matmul="bf16")
    for scope, a in SCOPES.items():
        dry(monkeypatch)  # the step's set-up too (its prefix K/V and reference pass)
        p = make_prompt(a, seed=a + 2)
        st = StaticStep(be, Calibrator(be, dataclasses.replace(CFG, projection_scope=scope)).config, p, be.embed(p))
        assert st.forward.rows_on and st.forward.policy == ("kept" if scope == "demos" else "pass")
        assert_within_budget(launches(st, monkeypatch))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])  # mistral's context (32) < the prompt
def test_generation_matches_transformers(fams, family):
    """Greedy decoding through the static KV cache against transformers' own generation: Phi-3's longrope past its
    pretraining length, in the prompt and in every token decoded after it."""
    lm = fams[family]
    fast = reference_backend("fast", lm)
    p = make_prompt(6, seed=3)
    X = fast.embed(p)
    got, ref = fast.generate(X, p, max_new_tokens=12), greedy_generate(lm, X, max_new_tokens=12)
    assert got.token_ids == ref.token_ids and len(got.token_ids) == 12


def without_its_quirk(family: str, lm):
    """The fast backend of `lm` with one of its family's quirks switched off: the decoder config's field, or (OLMo 2's
    post-norms, a layer structure) the layers' tensors."""
    plan = make_plan(lm, backend="fast-fp32", impl="torch")
    dec = plan.decoder
    default_rope = tuple((k, tuple(sorted({**dict(v), "rope_type": "default"}.items()))) for k, v in dec.rope)
    change = {"qwen2": dict(windows=(None, None)), "ministral": dict(windows=(None, None)),
              "mistral": dict(rope=default_rope), "phi3": dict(rope=default_rope),  # dynamic, longrope: off
              "granite": dict(residual_mult=None), "smollm3": dict(rope_of_layer=("all", "all"))}.get(family, {})
    be = build_backend(dataclasses.replace(plan, decoder=dataclasses.replace(dec, **change)), lm)
    if family == "olmo2":
        for layer in be.model.layers:
            layer.post_attn_norm = None
    return be


@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_exercise_their_quirks(fams, family):
    """Each family's quirk switched off changes the span log-probs: the parity tests above would see it missing."""
    lm = fams[family]
    be = without_its_quirk(family, lm)
    p = make_prompt(6, seed=4)
    X = be.embed(p).unsqueeze(0)
    assert (be.span_logprobs(X, p) - own_logprobs(lm, X, p, X[0])).abs().max() > 1e-3


def test_rope_tables_are_transformers_own(fams):
    """yarn, dynamic and longrope: the tables for the prompt's length (48 tokens) are transformers' cos / sin (the
    attention factor included) for one forward over it; dynamic and longrope past their threshold differ from their
    tables at construction, and prompts of lengths that give two tables cannot share a pass."""
    for family in ("qwen2", "mistral", "phi3", "ministral"):
        lm = fams[family]
        m = reference_backend("fast", lm).model
        m.fit_rope(48)
        cos, sin = m.rotary["all"].tables(0, 48)
        rot = lm.decoder.rotary_emb
        rot.inv_freq, rot.max_seq_len_cached = rot.original_inv_freq, rot.original_max_seq_len
        ref_cos, ref_sin = rot(torch.zeros(1, 48, 1), torch.arange(48)[None])
        torch.testing.assert_close(cos[:, 0], ref_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin[:, 0], ref_sin[0], rtol=0, atol=0)
        if family in ("mistral", "phi3"):
            before = cos.clone()
            m.fit_rope(10)
            assert (m.rotary["all"].tables(0, 48)[0] - before).abs().max() > 1e-3
            with pytest.raises(SiclError, match="different rotary tables.*--pack 1"):
                m.fit_rope(10, 48)
    assert reference_backend("fast", fams["phi3"]).model.rotary["all"].cos.shape[-1] == 8  # half of head 16


def test_decoder_config_reads_the_quirks(fams):
    """DecoderConfig.from_hf: each family's quirks as the general fields the decoder reads."""
    cfg = {f: DecoderConfig.from_hf(lm.text_config, lm.model.get_input_embeddings()) for f, lm in fams.items()}
    assert [cfg[f].windows for f in ("qwen2", "mistral", "ministral", "phi3")] == [
        (None, 8), (8, 8), (8, None), (None, None)]
    assert (cfg["olmo2"].norms, cfg["olmo2"].norm_f32, cfg["qwen2"].norms) == ("post", True, "pre")
    g = cfg["granite"]
    assert (g.input_mult, g.residual_mult, g.attn_scale, g.logit_scale) == (3.0, 0.5, 0.2, 1 / 3.0)
    assert cfg["smollm3"].rope_of_layer == ("all", "none") and cfg["mistral"].max_positions == 32
    assert all(cfg[f].residual_mult is None and cfg[f].logit_scale is None for f in FAMILIES if f != "granite")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next", "gemma4_text"])
def test_other_families_are_refused_by_name(family):
    """MoE, hybrid linear attention and Gemma 4's per-layer inputs stay on hf: the refusal names the family."""
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnsupportedModelError, match=f"this model is '{family}': use the 'hf' backend"):
        DecoderConfig.from_hf(CONFIG_MAPPING[family](), None)
