"""The run plan (sicl_fast.run.plan): every refusal rule in one table, with the message it gives; what 'auto' resolves
to on this machine; fast-fp32 as a plan; the engine, make_backend and the loops reading the plan."""
import dataclasses
import re
import warnings
from unittest import mock

import pytest
import torch

from sicl_fast import CalibrationConfig, Engine
from sicl_fast.backends import FastBackend, build_backend, make_backend
from sicl_fast.errors import SiclError, SiclWarning
from sicl_fast.models import from_transformers
from sicl_fast.models.attention import Attention
from sicl_fast.models.decoder_config import DecoderConfig
from sicl_fast.models.transformer import UnsupportedModelError, fast_low_precision
from sicl_fast.ops import cpp_ops
from sicl_fast.calibration.packed import run_packed
from sicl_fast.run import plan as plan_module
from sicl_fast.run.plan import (BACKENDS, Choices, RunPlan, check_buckets, check_estimator, make_plan,
                                resolve_attention, resolve_attention_check, resolve_diff, resolve_graphs, resolve_impl,
                                resolve_read_every, resolve_reuse)
from sicl_fast.calibration.static import StaticStep
from test_fast_backend import CharTokenizer, build, make_prompt
from test_ops import why_unavailable


@pytest.fixture(scope="module")
def odd_models():
    """A GPT-2 (no fast forward), a bfloat16 Llama, a Llama with a quantized (int8) weight, and one whose weights
    were made under torch.inference_mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = from_transformers(GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2,
                                                        n_positions=64)), CharTokenizer(), name="tiny-gpt2")
    quant = build("llama")
    quant.model.register_parameter("q8", torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    with torch.inference_mode():
        inference = build("llama")
    sdpa = build("gemma2", layers=1)  # its attention soft-cap needs eager attention: switched back to SDPA
    sdpa.model.set_attn_implementation("sdpa")
    biased = build("llama", layers=1)  # an LM head with a bias, which the fast decoder's head does not add
    head = biased.model.lm_head
    biased.model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.model.lm_head.weight.data.copy_(head.weight)
    return {"gpt2": gpt2, "bf16": build("llama", torch.bfloat16), "quant": quant, "inference": inference,
            "gemma2-sdpa": sdpa, "head-bias": biased}


def no_interpreter(monkeypatch):
    """Triton's kernels without CUDA and without TRITON_INTERPRET=1."""
    from sicl_fast import kernels

    monkeypatch.setattr(kernels, "interpreting", lambda: False)


def cpp_not_built(monkeypatch):
    monkeypatch.setattr(cpp_ops, "_C", None)
    monkeypatch.setattr(cpp_ops, "_IMPORT_ERROR", ImportError("no module"))


def plan_of(model="llama", setup=None, then=None, needs=None, **choices):
    """A case: make_plan on one of the models with `choices` (after setup(monkeypatch)), then then(plan); needs: an
    implementation the case cannot run without."""
    return dict(model=model, setup=setup, then=then, needs=needs, choices=choices)


CFG = CalibrationConfig(N=2, max_steps=2, scale=1.0)


def fp8_on_capability(cap: tuple):
    """resolve_diff('fp8') on a CUDA device of compute capability `cap` (no GPU needed: the plan reads only that)."""
    with mock.patch("torch.cuda.get_device_capability", lambda device=None: cap):
        return resolve_diff("fp8", BACKENDS["fast"], "cuda", torch.bfloat16)


def test_fp8_runs_on_fp8_tensor_cores_and_off_cuda():
    """sm_89+ takes FP8 differences on its tensor cores; the CPU emulates them (the precision study's path); below
    sm_89 the plan refuses (REFUSALS)."""
    for cap in ((8, 9), (9, 0)):
        assert fp8_on_capability(cap) == ("fp8", "asked for: the value rows through bf16 products, the difference "
                                          "rows through FP8 ones (torch._scaled_mm), an FP8 copy of each weight "
                                          "beside the bf16 one")
    assert resolve_diff("fp8", BACKENDS["fast"], "cpu", torch.float32)[1].startswith("asked for: emulated off CUDA")


def decoder_of(**changes):
    """DecoderConfig.from_hf (make_plan's first step on the fast backend) of a tiny Llama config with `changes` set
    on it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    for name, value in changes.items():
        setattr(cfg, name, value)
    return lambda: DecoderConfig.from_hf(cfg, None)


def without_a_plain_decoder():
    """The fast decoder over a model whose decoder module has no layers (build_backend's Transformer)."""
    from types import SimpleNamespace

    from sicl_fast.models.transformer import Transformer

    Transformer(SimpleNamespace(decoder=torch.nn.Module(), model=torch.nn.Module()), decoder_of()(), ops=None)


# every refusal of the run plan: (case, the exception, the message it gives)
REFUSALS = {
    "unknown backend": (plan_of(backend="nope"), SiclError,
                        r"unknown backend 'nope'; choose one of \['fast', 'fast-fp32', 'hf', 'naive'\] or 'auto'"),
    "unknown impl": (plan_of(impl="fast"), SiclError, "ops: unknown impl 'fast'; choose one of"),
    "unknown attention": (plan_of(attn="fa3"), SiclError, "unknown attention implementation 'fa3'"),
    "unknown diff_matmul": (plan_of(diff_matmul="int4"), SiclError, "unknown diff_matmul 'int4'"),
    "unknown attn_precision": (plan_of(attn_precision="tf32"), SiclError, "Engine: unknown attn_precision 'tf32'"),
    "tf32x3 on an attention that multiplies in IEEE float32": (
        plan_of(attn="sdpa", attn_precision="tf32x3", impl="torch"), SiclError,
        "attn_precision 'tf32x3' runs on the Triton attention .the tensor cores. or, emulated, on the math path; the "
        "'sdpa' attention multiplies in IEEE float32"),
    "tf32x3 emulated with the exact gradient": (
        plan_of(attn="math", attn_precision="tf32x3", grad=True), SiclError,
        "attn_precision 'tf32x3' on the math path is an emulation without a backward"),
    "unknown loop": (plan_of(loop="fast"), SiclError, "Engine: unknown loop 'fast'"),
    "unknown graphs": (plan_of(graphs="yes"), SiclError, "Engine: unknown graphs 'yes'"),
    "pack not a count": (plan_of(pack=0), SiclError, "Engine: pack must be >= 1, got 0"),
    "unknown reuse": (plan_of(reuse="yes"), SiclError, "Engine: unknown reuse 'yes'"),
    "reuse with packing": (plan_of(reuse="auto", pack=2), SiclError,
                           "reuse 'auto' with pack 2: packed calibration does not use the store"),
    "threads not a count": (plan_of(threads=0), SiclError, "Engine: threads must be >= 1, got 0"),
    "threads not an integer": (plan_of(threads=1.5), SiclError, "Engine: threads must be an integer, got 1.5"),
    "threads beyond the table": (plan_of(threads=5000), SiclError,
                                 r"Engine: threads must be <= 4096 \(threads of one process"),
    "sync_every not a count": (plan_of(sync_every=True), SiclError, "Engine: sync_every must be an integer, got True"),
    "fast on another family": (plan_of("gpt2", backend="fast"), UnsupportedModelError,
                               "supports the model families llama, qwen3, gemma2, gemma3_text.*'gpt2'"),
    "fast on a model whose head is not the fast decoder's": (
        plan_of("head-bias", backend="fast"), UnsupportedModelError,
        "the fast decoder's head has no bias and no cut vocabulary: the LM head's weight: the output module's bias"),
    "hf on a model whose attention drops what its math needs": (
        plan_of("gemma2-sdpa", backend="hf"), SiclError,
        r"model 'tiny-gemma2' \(gemma2\) runs transformers' 'sdpa' attention, but it soft-caps its attention scores "
        r"\(attn_logit_softcapping 2.0\), which only transformers' eager attention computes: load it with "
        "sicl_fast.load"),
    # the fast decoder's model rules (DecoderConfig.from_hf, made by make_plan; the Transformer, by build_backend)
    "bidirectional attention": (dict(call=decoder_of(use_bidirectional_attention=True)), UnsupportedModelError,
                                "bidirectional attention .embedding models. is not supported by the fast backend"),
    "another activation": (dict(call=decoder_of(hidden_act="relu")), UnsupportedModelError,
                           "activation 'relu' is not supported by the fast backend"),
    "another rope type": (dict(call=decoder_of(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4})),
                          UnsupportedModelError, r"rope_type 'proportional' is not supported by the fast backend "
                          r"\(default, linear, llama3, yarn, dynamic, longrope\); use the 'hf' backend"),
    "a rope the functions cannot read": (dict(call=decoder_of(rope_parameters={"rope_type": "linear",
                                                                               "rope_theta": 1e4})),
                                         UnsupportedModelError, "rope_type 'linear': the fast backend cannot compute "
                                         "its frequencies from this config .KeyError: 'factor'.; use the 'hf' backend"),
    "a rotary wider than the head": (dict(call=decoder_of(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                           "partial_rotary_factor": 2.0})),
                                     UnsupportedModelError, "rope 'all' rotates 16 of a head's 8 dims"),
    "a linear-attention layer (hybrid)": (dict(call=decoder_of(layer_types=["linear_attention"])),
                                          UnsupportedModelError, "layer 0 is a 'linear_attention' layer: the fast "
                                          "backend runs full_attention and sliding_attention layers"),
    "a sliding-window layer without a window": (dict(call=decoder_of(layer_types=["sliding_attention"],
                                                                     sliding_window=None)), UnsupportedModelError,
                                                "layer 0 is a sliding-window layer but the config has no window"),
    "a model without a plain decoder": (dict(call=without_a_plain_decoder), UnsupportedModelError,
                                        "this model is 'llama .Module without a plain decoder.'"),
    "grad with forward-only ops": (plan_of(impl="cpp", grad=True), SiclError,
                                   "estimator 'grad' needs differentiable ops, and impl 'cpp' is forward-only"),
    "fp8 below sm_89": (dict(call=lambda: fp8_on_capability((8, 0))), SiclError,
                        r"diff_matmul 'fp8' needs FP8 tensor cores \(CUDA sm_89\+: Ada, Hopper\); cuda is sm_80.*"
                        "use diff_matmul 'bf16'"),
    "cpp off the CPU": (dict(call=lambda: resolve_impl("cpp", "cuda")), SiclError,
                        "impl 'cpp' runs on the CPU; the model is on cuda .use 'triton' or 'torch'."),
    "cpp not built": (plan_of(impl="cpp", setup=cpp_not_built), SiclError,
                      "the C\\+\\+ extension sicl_fast.ops._C is not built.*setup.py build_ext"),
    "triton without CUDA or the interpreter": (plan_of(impl="triton", setup=no_interpreter, needs="triton"),
                                               SiclError,
                                               "impl 'triton' runs on CUDA; for cpu tensors set TRITON_INTERPRET=1"),
    "triton attention without CUDA or the interpreter": (
        plan_of(attn="triton", impl="torch", setup=no_interpreter, needs="triton"), SiclError,
        "attention implementation 'triton' runs on CUDA.*'sdpa' / 'math'"),
    "flash attention not installed": (plan_of(attn="flash", impl="torch"), SiclError,
                                      "attention implementation 'flash' needs flash-attn"),
    "cpp attention off the CPU": (dict(call=lambda: resolve_attention("cpp", BACKENDS["fast"], "cuda", torch.float32,
                                                                      "torch")), SiclError,
                                  "attention implementation 'cpp' runs on the CPU; this model is on cuda"),
    "static loop without a sync-free forward": (plan_of(backend="hf", loop="static"), SiclError,
                                                "loop 'static' needs the fast backend's sync-free forward; 'hf'"),
    "graphs on without CUDA": (plan_of(graphs="on"), SiclError, "graphs 'on' needs a CUDA device; the model is on cpu"),
    "graphs on without a static step": (dict(call=lambda: resolve_graphs("on", "cuda", False, "hf", "auto")),
                                        SiclError, "graphs 'on' captures the static step; backend 'hf' with loop"),
    "pack without the static loop": (plan_of(backend="fast", loop="eager", pack=2), SiclError,
                                     r"pack > 1 needs the static loop on the fast backend \(backend 'fast', loop"),
    "grad on a backend without a differentiable forward": (plan_of(backend="naive", grad=True), SiclError,
                                                           "the 'naive' backend has no differentiable forward"),
    "grad on quantized weights": (plan_of("quant", backend="hf", grad=True), SiclError,
                                  "holds torch.int8 weights .quantized."),
    "grad on inference-mode weights": (plan_of("inference", backend="hf", grad=True), SiclError,
                                       "made under torch.inference_mode"),
    # the rules a plan keeps for the calibrations that run on it
    "grad on a loop asked to be static": (plan_of(backend="fast", loop="static",
                                                  then=lambda p, lm: p.loop_for("grad")), SiclError,
                                          "static and packed steps run the zeroth-order ascent only"),
    "grad on forward-only ops of a zeroth-order run": (plan_of(impl="cpp", needs="cpp",
                                                               then=lambda p, lm: p.loop_for("grad")),
                                                       SiclError, "impl 'cpp' is forward-only"),
    "grad packed": (plan_of(backend="fast", pack=2, then=lambda p, lm: p.check_pack("grad")), SiclError,
                    "estimator 'grad' calibrates one prompt at a time"),
    "grad through the packed step": (plan_of(backend="fast", then=lambda p, lm: run_packed(
        build_backend(p, lm), [(None, dataclasses.replace(CFG, estimator="grad"))], 2)), SiclError,
        "the static and packed steps run the zeroth-order ascent only"),
    # the same two rules before any model loads (the CLI's --estimator with --pack / --loop)
    "grad with pack, before the model loads": (dict(call=lambda: check_estimator("grad", "auto", 2)), SiclError,
                                               "estimator 'grad' calibrates one prompt at a time"),
    "grad on the static loop, before the model loads": (dict(call=lambda: check_estimator("grad", "static", 1)),
                                                        SiclError, "run the zeroth-order ascent only; estimator "
                                                                   "'grad' runs on the eager loop"),
    "graph cache not a count": (plan_of(graph_cache=0), SiclError, "Engine: graph_cache must be >= 1, got 0"),
    "length buckets on the eager loop": (plan_of(loop="eager", length_buckets=4), SiclError,
                                         "length_buckets 4 pads the static step; backend 'fast' with loop 'eager'"),
    # issue 48: both were taken, shown by `plan` and padded nothing
    "length buckets with packing": (plan_of(pack=2, length_buckets=4), SiclError,
                                    "length_buckets 4: pack 2 runs the packed step, which pads each pack to its "
                                    "longest prompt, not to length buckets; use 'auto' or 'off', or pack 1"),
    "length buckets where every calibration takes the gradient, before the model loads": (
        dict(call=lambda: check_buckets(4, 1, grad=True)), SiclError,
        "length_buckets 4: estimator 'grad' runs on the eager loop, which pads nothing; use 'auto' or 'off'"),
    "length buckets not a power of two": (plan_of(length_buckets=3), SiclError,
                                          "length buckets: 3 lengths a doubling; the count must be a power of two"),
    "length buckets beyond the table": (plan_of(length_buckets=65), SiclError,
                                        r"Engine: length_buckets must be <= 64 \(length buckets a doubling"),
    "the static step on a backend without one": (plan_of(backend="hf",
                                                         then=lambda p, lm: p.require_sync_free("step")), SiclError,
                                                 "the static step needs a forward without host reads"),
    "the packed step on a backend without one": (plan_of(backend="hf",
                                                         then=lambda p, lm: p.require_sync_free("packed")), SiclError,
                                                 "the packed step needs the fast backend's sync-free"),
    # Engine.calibrate's best_at and icleval --answer-at (tests/test_reuse.py runs both faces)
    "best X along the run from the store": (dict(call=lambda: resolve_reuse("auto", 1, keeps_best=True)), SiclError,
                                            r"best_at \(icleval --answer-at\) keeps the best X along each "
                                            "calibration, and one from the store has none: use reuse 'off'"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_every_refusal(name, models, odd_models, monkeypatch):
    case, exc, message = REFUSALS[name]
    if case.get("needs") and why_unavailable(case["needs"]):
        pytest.skip(why_unavailable(case["needs"]))
    with pytest.raises(exc, match=message):
        if "call" in case:
            case["call"]()
        else:
            if case["setup"] is not None:
                case["setup"](monkeypatch)
            lm = {**models, **odd_models}[case["model"]]
            plan = make_plan(lm, **case["choices"])
            if case["then"] is not None:
                case["then"](plan, lm)


def test_the_table_keeps_up_with_the_module():
    """A rule added to sicl_fast/run/plan.py, or to the fast decoder's model rules (decoder_config.py, the Transformer's
    constructor), without its row here fails this count: the table has a row per raise and per categorical check of
    those modules (some rules have two or three rows: their plan-time, calibration-time and pre-load faces)."""
    import sicl_fast.models.decoder_config as decoder_config
    import sicl_fast.run.plan as plan

    src = open(plan.__file__).read()
    rules = len(re.findall(r"\braise SiclError\(", src)) + len(re.findall(r"\bcheck_choice\(self\.", src))
    model_src = open(decoder_config.__file__).read()
    model_rules = len(re.findall(r"\braise (UnsupportedModelError|unsupported)\(", model_src)) + 1  # + Transformer's
    assert rules >= 21 and model_rules == 9 and len(REFUSALS) >= rules + model_rules


def test_choices_are_checked_before_a_model_loads():
    with pytest.raises(SiclError, match="unknown graphs 'yes'"):
        Engine(model="no-such-model", graphs="yes")  # the choice fails first, not the model
    with pytest.raises(SiclError, match="pack must be an integer, got 1.5"):
        Choices(pack=1.5)


def test_auto_on_this_machine(models, odd_models):
    lm = models["llama"]
    p = make_plan(lm)
    assert p.backend == "fast" and p.kind.cls == "fast" and p.decoder.family == "llama"
    assert p.impl == ("cpp" if cpp_ops.available() else "torch")
    assert p.attention == ("cpp" if cpp_ops.available() else "sdpa")
    assert p.diff_matmul == ("bf16" if fast_low_precision(lm.device) else "off")
    assert (p.loop, p.sync_every, p.graphs, p.pack, p.grad) == ("static", 1, False, 1, False)
    assert make_plan(odd_models["gpt2"]).backend == "hf" and make_plan(odd_models["gpt2"]).loop == "eager"
    g = make_plan(lm, grad=True)
    assert g.impl == "torch" and g.grad_refusal is None and g.loop_for("grad") == "eager"
    assert g.loop_for("forward") == "static"
    # a bf16 model: the difference form wherever it runs (a plain bf16 ascent loses the perturbations)
    assert make_plan(odd_models["bf16"], backend="fast", impl="torch").diff_matmul == "bf16"
    if why_unavailable("triton") is None:
        assert make_plan(lm, impl="triton").attention == "triton"  # the fused kernel of the Triton ops


ROPES = {  # what the fast decoder refused by its rope or activation, where auto exited 2 (issue #47)
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                  "original_max_position_embeddings": 64}),
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    "longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}),
    "partial rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    "relu": dict(hidden_act="relu"),
}


def rope_model(family: str, changes: dict):
    """A 1-layer Llama or Qwen3 (head width 8) with `changes` in its config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=256, **changes)
    return cls(cfg)


@pytest.mark.parametrize("family,variant", [("llama", v) for v in ROPES] + [("qwen3", "yarn")])
def test_auto_decides_from_the_whole_config(family, variant):
    """#47 item 3: auto builds the fast decoder's config and takes hf on any refusal, the refusal its reason (it took
    fast by the family's name, and the fast config's refusal ended plan and calibrate with exit 2); where the fast
    decoder runs the config, fast."""
    lm = from_transformers(rope_model(family, ROPES[variant]), CharTokenizer(), name=f"tiny-{variant}")
    try:
        DecoderConfig.from_hf(lm.text_config, lm.model.get_input_embeddings())
        refusal = None
    except UnsupportedModelError as exc:
        refusal = str(exc)
    plan = make_plan(lm, backend="auto")
    why = dict((a, w) for a, _, w in plan.why)["backend"]
    if refusal is None:
        assert plan.backend == "fast" and plan.decoder is not None
    else:
        assert plan.backend == "hf" and plan.decoder is None and plan.head.mode == "table"
        assert why == f"auto: the fast decoder refuses this '{family}' model: {refusal}"
    p = make_prompt(2)
    p = dataclasses.replace(p, input_ids=p.input_ids % 64)
    backend = build_backend(plan, lm)
    assert torch.isfinite(backend.span_logprobs(backend.embed(p).unsqueeze(0), p)).all()


def test_plan_of_a_qwen3_yarn_folder_falls_back_to_hf(tmp_path, capsys):
    """#47: `sicl-fast plan --model DIR` on a Qwen3 folder with a yarn rope (what Qwen's model cards tell long-context
    users to set) exits 0 with hf and the fast decoder's refusal where it exited 2, unless the fast decoder runs it."""
    from conftest import word_tokenizer
    from sicl_fast.commands.cli import main

    rope_model("qwen3", ROPES["yarn"]).save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]) == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["backend"][0] == "fast" or "rope_type 'yarn'" in rows["backend"][1]
    assert rows["head"][0] == ("-" if rows["backend"][0] == "fast" else "table")


def test_fast_fp32_is_a_plan_not_a_class(models):
    lm = models["qwen3"]
    be = make_backend("fast-fp32", lm, impl="torch")
    assert type(be) is FastBackend and be.name == be.plan.backend == "fast-fp32"
    assert be.plan.diff_matmul == "off" and not be.model.rows_on
    assert make_backend("fast", lm, diff_matmul="bf16", impl="torch").model.rows_on
    with pytest.warns(SiclWarning, match="diff_matmul 'bf16' has no effect on backend 'fast-fp32'"):
        assert make_plan(lm, backend="fast-fp32", diff_matmul="bf16").diff_matmul == "off"  # plain products, always


def test_a_choice_the_plan_does_not_read_is_said_once(models):
    """#40's neighbours: diff_matmul or attn asked of a backend without the fast decoder's products and kernels,
    and sync_every of the eager loop, were taken without a word (warned, not refused: `bench` runs one set of
    flags on several backends)."""
    import warnings

    lm = models["llama"]
    cases = [(dict(backend="hf", diff_matmul="fp8"), "diff_matmul 'fp8' has no effect on backend 'hf'"),
             (dict(backend="naive", attn="sdpa"), "attn 'sdpa' has no effect on backend 'naive'"),
             (dict(backend="fast", loop="eager", sync_every=4), "sync_every 4 has no effect on the eager loop")]
    for kw, needle in cases:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            plan = make_plan(lm, impl="torch", **kw)
        assert [str(w.message) for w in got if needle in str(w.message)] and len(got) == 1, [str(w.message)
                                                                                               for w in got]
    assert "no effect on the eager loop" in dict((a, w) for a, _, w in plan.why)["sync_every"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what the plan reads: no word
        make_plan(lm, impl="torch", backend="fast", attn="math", diff_matmul="off", loop="static", sync_every=4)
        make_plan(lm, impl="torch", backend="hf", diff_matmul="off")


def test_the_plain_low_precision_ascent_says_what_it_loses(odd_models, models):
    """Not a default anywhere; asked for (diff_matmul 'off', or fast-fp32) on a bf16 model, it warns in one line
    with what the precision study measured. A float32 model's plain form is the exact reference: no word."""
    for choices in (dict(backend="fast", diff_matmul="off"), dict(backend="fast-fp32")):
        with pytest.warns(SiclWarning, match=r"a plain bfloat16 ascent keeps only a few per cent of the float32 gain"):
            make_plan(odd_models["bf16"], impl="torch", **choices)
    with pytest.warns(SiclWarning, match=r"a plain float16 ascent keeps only part of the float32 gain \(the "
                                         "perturbation is about eight float16 ulps"):  # it spoke of a bf16 ulp
        make_plan(build("llama", torch.float16), impl="torch", backend="fast", diff_matmul="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plan(models["llama"], backend="fast-fp32", impl="torch")
        make_plan(odd_models["bf16"], backend="fast", impl="torch")


def test_length_buckets_and_the_gradient_where_they_run(models):
    """Issue 48: `plan` showed length buckets with --pack > 1 and --estimator grad, which pad nothing, and 'loop
    static' beside 'estimator grad ... the eager loop'; the refusal of the exact gradient under impl 'auto' advised
    "use impl 'torch' or 'auto'". One rule (buckets_unused) for the plan, auto_pack and the command line."""
    from sicl_fast.run.plan import auto_pack, forward_only, resolve_buckets

    packed = resolve_buckets("auto", True, True, "fast", "auto", pack=8)  # captured steps, packed
    assert packed == (None, "auto: pack 8 runs the packed step, which pads each pack to its longest prompt, not to "
                            "length buckets")
    assert resolve_buckets("auto", True, True, "fast", "auto", pack=1)[0] == 4
    assert auto_pack(torch.device("cuda"), 135_000_000, buckets=True) == (
        1, "auto: length buckets asked for, which the packed step does not use")  # a count asked: room for it
    why = dict((a, w) for a, _, w in make_plan(models["llama"], impl="torch", grad=True, length_buckets=2).why)
    assert why["loop"].endswith("; the exact gradient's calibrations run on the eager loop"), why["loop"]
    assert why["length_buckets"].endswith("; the exact gradient's calibrations run on the eager loop, unpadded")
    assert "build the engine for the exact gradient (Engine(grad=True); on the command line, --estimator grad), " \
           "where 'auto' takes 'torch'" in forward_only("cpp", "auto")
    assert "use impl 'torch' or 'auto'" in forward_only("cpp", "cpp")


def test_explain_names_every_axis(models):
    text = make_plan(models["llama"], backend="fast-fp32", impl="torch").explain()
    for axis in ("backend", "impl", "attention", "attention_check", "attention_precision", "diff_matmul", "loop",
                 "sync_every", "read_every", "graphs", "length_buckets", "graph_cache", "pack", "estimator"):
        assert re.search(rf"^  {axis} +\S", text, re.M), axis
    assert "fast-fp32: every product plain, in the model dtype" in text and "tiny-llama" in text
    # the attention kernel's per-call hand-offs to the math path are said beside it
    assert re.search(r"^  attention +sdpa +auto: torch's SDPA; the math path takes soft-capped layers", text, re.M)


def test_attention_check_and_read_every_are_the_plans(models, monkeypatch):
    """Whether the fast backend checks its attention kernel against the math path when built (CUDA) and how many
    tokens it decodes between two host reads are plan axes, resolved once; the backend only reads them."""
    lm = models["llama"]
    plan = make_plan(lm, backend="fast", impl="torch", attn="sdpa")
    assert (plan.attention_check, plan.read_every) == (False, 1)  # the CPU
    assert resolve_attention_check("sdpa", "cuda", True) == (True, "CUDA: compared with the math path once, when the "
                                                                    "plan is made; 'math' on a mismatch (auto)")
    assert not resolve_attention_check("math", "cuda", True)[0] and not resolve_attention_check(None, "cuda", True)[0]
    fast, hf = BACKENDS["fast"], BACKENDS["hf"]
    assert resolve_read_every(fast, "cuda")[0] == 8 and resolve_read_every(fast, "cpu")[0] == 1
    assert resolve_read_every(hf, "cuda")[0] == 1  # transformers' generation reads every token
    checked = []
    monkeypatch.setattr(Attention, "verify", lambda self, *a, fallback, rows: checked.append((self.impl, fallback,
                                                                                             rows)))
    be = build_backend(dataclasses.replace(plan, attention_check=True, read_every=3), lm)
    assert checked == [] and be.read_every == 3  # the plan checks; the backend reads it
    monkeypatch.setattr(plan_module, "resolve_attention_check", lambda *a: (True, "as on CUDA"))
    assert make_plan(lm, backend="fast", impl="torch", attn="sdpa").attention_check
    assert checked == [("sdpa", False, True)]  # asked for by name (no fallback), with the difference form's rows


@pytest.mark.skipif(bool(why_unavailable("triton")), reason="needs triton")
def test_an_attention_kernel_that_fails_its_check_is_math_with_the_reason(models, monkeypatch):
    """On CUDA the plan compares a fused attention kernel with the math path in every form the model runs; any
    error of a kernel, Triton's OutOfResources (a TritonError, not a RuntimeError) among them, makes 'auto' take the
    math path, with the kernel and why in `sicl-fast plan`'s table; a kernel asked for by name is an error. The real
    kernels pass the same check (here under the interpreter)."""
    from triton.runtime.errors import OutOfResources

    from sicl_fast import kernels as K

    lm = models["llama"]
    monkeypatch.setattr(plan_module, "resolve_attention_check", lambda *a: (True, "as on CUDA"))
    plan = make_plan(lm, backend="fast", impl="triton")
    assert (plan.attention, plan.attention_check) == ("triton", True)  # the real kernels: every form within tolerance
    assert re.search(r"attention_check +passed", plan.explain())

    def no_room(*a, **k):  # what prefix_attention met at head 256 in float32 before its tiles were chosen per dtype
        raise OutOfResources(344320, 232448, "shared memory")

    monkeypatch.setattr(K, "prefix_attention", no_room)
    with pytest.warns(RuntimeWarning, match="prefix_attention .* raised OutOfResources.*using 'math'"):
        plan = make_plan(lm, backend="fast", impl="triton")
    lines = plan.explain()
    assert plan.attention == "math" and build_backend(plan, lm).attention_kernel == "math"
    assert re.search(r"attention +math +'triton' failed its check on this machine", lines)
    assert re.search(r"attention_check +failed +CUDA: prefix_attention \(float32, head_dim 16\) raised OutOfResources: "
                     "out of resource: shared memory, Required: 344320, Hardware limit: 232448", lines), lines
    with pytest.raises(SiclError, match=r"'triton' attention failed its check.*prefix_attention \(float32, "
                       r"head_dim 16\) raised OutOfResources"):
        make_plan(lm, backend="fast", impl="triton", attn="triton")


def test_the_float32_attentions_precision_is_the_plans(models, odd_models):
    """attn_precision (issue 53, item 6): auto is tf32x3 with the Triton attention (its tensor cores) and the kernel's
    own IEEE float32 elsewhere; ieee asked for runs IEEE FMA on Triton; tf32x3 asked on the math path is its torch
    emulation. The model's Attention gets it, the store's key and a record's settings hold it where it is not IEEE
    (the keys made before it stay), and a kernel that fails its check falls back to the math path in IEEE."""
    lm = models["llama"]
    plain = make_plan(lm, backend="fast", impl="torch", attn="sdpa")
    assert plain.attention_precision == "ieee" and "attention_precision" not in plain.result_axes()
    assert re.search(r"^  attention_precision +ieee +auto: the 'sdpa' kernel's own float32 products", plain.explain(),
                     re.M)
    emulated = make_plan(lm, backend="fast", impl="torch", attn="math", attn_precision="tf32x3")
    assert emulated.attention_precision == "tf32x3" and emulated.result_axes()["attention_precision"] == "tf32x3"
    be = build_backend(emulated, lm)
    assert (be.model.attention.impl, be.model.attention.precision) == ("math", "tf32x3")
    assert make_plan(odd_models["gpt2"]).attention_precision is None  # transformers' own attention
    with pytest.warns(SiclWarning, match="attn_precision 'ieee' has no effect on backend 'hf'"):
        make_plan(odd_models["gpt2"], attn_precision="ieee")
    if why_unavailable("triton") is None:
        tri = make_plan(lm, backend="fast", impl="triton")
        assert (tri.attention, tri.attention_precision) == ("triton", "tf32x3")
        assert tri.result_axes()["attention_precision"] == "tf32x3"
        assert tri.result_axes("math").get("attention_precision") is None  # the math path that runs: IEEE
        ieee = make_plan(lm, backend="fast", impl="triton", attn_precision="ieee")
        assert ieee.attention_precision == "ieee" and "IEEE float32 FMA on the CUDA cores" in ieee.explain()
        assert build_backend(ieee, lm).model.attention.precision == "ieee"
    broken = type("Broken", (), {"prefix_attention": staticmethod(lambda *a, **k: 1 / 0)})()
    att = Attention("triton", 0.5, None, torch.float32, "cpu", kernels=broken, precision="tf32x3")
    with pytest.warns(RuntimeWarning, match="raised ZeroDivisionError.*using 'math'"):
        att.verify(2, 1, 8, fallback=True)
    assert (att.impl, att.precision) == ("math", "ieee")  # a failed check: the math path, no emulation
    with pytest.raises(SiclError, match="the 'cpp' attention multiplies in IEEE float32; precision 'tf32x3'"):
        Attention("cpp", 0.5, None, torch.float32, "cpu", kernels=cpp_ops, precision="tf32x3")


def test_a_backend_runs_a_plan_it_does_not_make(models):
    """A backend is built from a RunPlan (make_plan's defaults, once): it makes none of its own."""
    lm = models["llama"]
    with pytest.raises(TypeError, match="plan"):
        FastBackend(lm)
    with pytest.raises(SiclError, match="FastBackend runs a RunPlan .sicl_fast.run.plan.make_plan., got str"):
        FastBackend(lm, "fast")
    assert make_backend("fast", lm).plan == make_plan(lm, backend="fast")


def test_plan_and_decoder_config_are_immutable(models):
    """A RunPlan hashes (its DecoderConfig holds no dict) and nothing changes the decoder's rope table in place."""
    lm = models["gemma3_text"]
    plan = make_plan(lm, backend="fast", impl="torch")
    assert {plan: 1}[make_plan(lm, backend="fast", impl="torch")] == 1
    dec = plan.decoder
    with pytest.raises(dataclasses.FrozenInstanceError):
        dec.rope = ()
    with pytest.raises(TypeError):
        dec.rope[0][1][0] = ("rope_theta", 1.0)
    params = dec.rope_params("full_attention")
    theta = params["rope_theta"]
    params["rope_theta"] = theta * 2
    assert dec.rope_params("full_attention")["rope_theta"] == theta


def test_engine_backends_and_loops_read_the_plan(models):
    lm = models["llama"]
    with pytest.warns(SiclWarning, match="sync_every 3 has no effect on the eager loop"):
        eng = Engine(lm, backend="fast-fp32", impl="torch", loop="eager", sync_every=3)
    assert isinstance(eng.plan, RunPlan) and eng.backend.plan is eng.plan
    with pytest.warns(SiclWarning, match="sync_every 3 has no effect"):
        assert eng.plan == make_plan(lm, backend="fast-fp32", impl="torch", loop="eager", sync_every=3)
    assert build_backend(eng.plan, lm).name == "fast-fp32" and eng.plan.loop_for("forward") == "eager"
    p = make_prompt(0)
    with pytest.raises(SiclError, match="the static step needs a forward without host reads.*'hf'"):
        StaticStep(make_backend("hf", lm, impl="torch"), CFG, p, lm.model.get_input_embeddings()(p.input_ids))
    with pytest.raises(SiclError, match="packed step needs the fast backend"):
        run_packed(make_backend("hf", lm, impl="torch"), [(p, CFG)], pack=2)


def test_decoder_config_holds_the_family_quirks(models):
    """DecoderConfig.from_hf, made once per model (the plan holds it): sizes and quirks as fields."""
    from sicl_fast.models.decoder_config import DecoderConfig

    cfgs = {f: DecoderConfig.from_hf(lm.text_config, lm.model.get_input_embeddings()) for f, lm in models.items()}
    # transformers 5's Gemma embedding modules scale their output (embed_scale): the forward multiplies nothing
    assert {f: (c.gemma, c.attn_softcap, c.final_softcap, c.input_mult) for f, c in cfgs.items()} == {
        "llama": (False, None, None, None), "qwen3": (False, None, None, None),
        "gemma2": (True, 2.0, 5.0, None), "gemma3_text": (True, None, None, None)}
    gemma2 = models["gemma2"]
    plain = torch.nn.Embedding(4, gemma2.hidden_size)  # an embedding that does not scale (older Gemma 2 code)
    unscaled = DecoderConfig.from_hf(gemma2.text_config, plain)
    assert unscaled.input_mult == gemma2.hidden_size ** 0.5
    assert DecoderConfig.from_hf(models["llama"].text_config, plain).input_mult is None  # Gemma 2's quirk only
    plan = make_plan(gemma2, backend="fast", impl="torch")
    assert build_backend(plan, gemma2).model.embed_scale is None  # the Transformer reads the field, nothing else
    mult = build_backend(dataclasses.replace(plan, decoder=unscaled), gemma2).model.embed_scale
    assert float(mult) == pytest.approx(gemma2.hidden_size ** 0.5)
    assert cfgs["llama"].attn_scale == 16 ** -0.5 and cfgs["gemma2"].attn_scale == 24 ** -0.5
    assert cfgs["gemma2"].windows == (8, None, 8) and cfgs["llama"].windows == (None, None, None)
    assert cfgs["gemma3_text"].rope_of_layer == ("sliding_attention", "full_attention", "sliding_attention")
    assert [key for key, _ in cfgs["gemma3_text"].rope] == ["full_attention", "sliding_attention"]
    assert cfgs["llama"].rope_of_layer == ("all",) * 3
    assert make_plan(models["qwen3"], backend="fast").decoder == cfgs["qwen3"]
    assert make_plan(models["qwen3"], backend="hf").decoder is None


def test_pack_auto_packs_where_it_pays(models, monkeypatch):
    """#38: pack 'auto' (the command line's default) packs on CUDA for a model under 1B parameters with the static
    loop (measured 2.9x one by one there), one prompt at a time elsewhere, each with its reason; the command line
    decides before the model loads, by the same rule, and a store asked for is used rather than packed past."""
    import argparse

    from sicl_fast.commands import cli
    from sicl_fast.run.plan import auto_pack

    cuda = torch.device("cuda")
    assert auto_pack(cuda, 135_000_000)[0] == 8 and "2.9x" in auto_pack(cuda, 135_000_000)[1]
    for args, why in (((cuda, 8_000_000_000), "8.0B parameters"), ((torch.device("cpu"), 135_000_000), "not CUDA"),
                      ((cuda, 135_000_000, False), "static loop"), ((cuda, 135_000_000, True, True), "gradient")):
        n, reason = auto_pack(*args)
        assert n == 1 and why in reason, reason
    plan = make_plan(models["llama"], impl="torch", pack="auto")
    assert plan.pack == 1 and "not CUDA" in dict((a, w) for a, _, w in plan.why)["pack"]
    assert plan.reuse == "off"  # Engine's own default without a store
    monkeypatch.setattr("sicl_fast.models.loading.resolve_device", lambda device: (cuda, "test"))
    lm = models["llama"]  # auto takes the fast backend for it: the static loop, which packing needs
    monkeypatch.setattr("sicl_fast.models.facts.model_arch", lambda model: ("tiny", lm.model.config, lm.model))
    for extra, want in (({}, 8), ({"store": "/tmp/s"}, 1), ({"reuse": "on"}, 1), ({"loop": "eager"}, 1)):
        args = argparse.Namespace(cmd="calibrate", pack="auto", device="auto", model=None, backend="auto",
                                  loop="auto", reuse=None, store=None, estimator=None, method=None)
        vars(args).update(extra)
        cli._resolve_pack(args)
        assert args.pack == want, (extra, args.pack)
