"""The run plan: every mode of a run resolved once, from the user's choices and the loaded model, with every
refusal rule, each in one place.

    choices = Choices(backend="auto", impl="auto", ...)     the choices as given, checked before a model loads
    plan = make_plan(lm, choices)   (or make_plan(lm, backend="fast", ...))          a frozen RunPlan
    print(plan.explain())           every axis, its value and why it resolved so (`sicl-fast plan`)
    plan = confirm_plan(early, lm, choices)   a plan made before the load (on the model's architecture without its
                                    weights: sicl_fast.run.planned), kept once the loaded weights agree with it

The axes:
    backend       auto (fast where the fast decoder's config builds from the whole model config, else hf with the
                  refusal as the reason), fast, fast-fp32 (fast with plain products), hf, naive
    head          how the hf backend makes the span rows' logits (sicl_fast.models.output_head: the LM head's
                  weight with the family's bias, multiplier and soft-cap, or the model's own forward at those rows),
                  checked against the model's own forward
    impl          the hot ops (sicl_fast.ops): auto (Triton on CUDA, the C++ extension on the CPU when built, else
                  torch; torch for the exact gradient), torch, cpp, triton
    attention     the fast decoder's attention kernel (sicl_fast.models.attention): auto, math, sdpa, flash, triton,
                  cpp; attention_check: whether the kernel is compared with the math path when the plan is made
                  (CUDA; 'math' where it fails, with the kernel and why); per call the kernel hands what it cannot do
                  exactly to the math path (named in explain())
    attention_precision  how the fast decoder's float32 attention multiplies (the reference pass's, the difference
                  form's and a float32 model's): auto ('tf32x3' with the Triton kernel: 3 TF32 products on the tensor
                  cores, about 21 of float32's 24 bits, which keep the float32 gain: bench/RESULTS.md section 31;
                  'ieee' with the others, their own float32 products), tf32x3 (the Triton kernel's; on the math path
                  emulated in torch, the precision study's path), ieee (IEEE float32 FMA on the CUDA cores with Triton)
    diff_matmul   the fast decoder's difference form for perturbation batches (sicl_fast.models.rows): auto, off
                  (plain products in the model dtype), bf16, fp8 (the differences in FP8 e4m3)
    loop          static (the sync-free step, sicl_fast.calibration.static) or eager (Calibrator.run); sync_every
    read_every    decoding: tokens between two host reads of the fast backend's greedy answer
    graphs        CUDA graphs of the static step and the decode step (sicl_fast.run.graphs); graph_cache: how many
                  static steps (and their graphs) are kept
    length_buckets  the static step padded to a ladder of lengths, so that prompts of nearby lengths share one step
                  and its graph (sicl_fast.run.buckets): auto (on where graphs are), off, or the sizes a doubling
    pack          prompts per packed step (sicl_fast.calibration.packed)
    estimator     whether the run takes the exact gradient (grad) and where a calibration of each estimator runs
                  (loop_for, check_pack)
    threads       torch's and the C++ ops' thread count (sicl_fast.run.threads; build_backend applies it), and the
                  OpenMP wait policy the process runs with (decided once, when sicl_fast is imported)

Engine, make_backend / build_backend, make_ops, the static, packed and graph paths and the CLI read the plan and
decide nothing themselves.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from ..errors import SiclError, SiclWarning
from .buckets import PER_OCTAVE, check_per_octave
from .graphs import BUCKET_CAPACITY, DEFAULT_CAPACITY, GRAPH_MODES
from .knobs import check_range
from ..models.attention import ATTN_IMPLS, PRECISE_IMPLS, flash_available
from ..models.loading import check_device
from ..models.decoder_config import DecoderConfig, UnsupportedModelError
from ..models.output_head import OutputHead, attention_of, eager_reason
from ..models.transformer import DIFF_MATMUL, fast_low_precision
from ..models.weights import fp8_refusal
from ..ops import DIFFERENTIABLE_IMPLS, IMPLS, cpp_ops
from ..ops.triton_ops import load_kernels
from ..step.spec import check_choice
from .threads import choose_wait_policy, resolve_threads, warn_oversubscribed

LOOPS = ("auto", "static", "eager")
ATTN_PRECISIONS = ("auto", "tf32x3", "ieee")


@dataclass(frozen=True)
class BackendKind:
    """What a backend name runs (the facts the rules below read)."""

    cls: str  # the Backend class: 'fast', 'hf' or 'naive' (sicl_fast.backends)
    plain: bool  # every product in float32 (fast-fp32: no difference products)
    differentiable: bool  # has a forward autograd can run through (estimator 'grad', sicl_fast.calibration.grad)
    sync_free: bool  # has a forward without host reads (FastBackend.span_forward): the static and packed steps


BACKENDS = {
    "fast": BackendKind("fast", plain=False, differentiable=True, sync_free=True),
    "fast-fp32": BackendKind("fast", plain=True, differentiable=True, sync_free=True),
    "hf": BackendKind("hf", plain=True, differentiable=True, sync_free=False),
    "naive": BackendKind("naive", plain=True, differentiable=False, sync_free=False),
}
GRAD_BACKENDS = tuple(n for n, k in BACKENDS.items() if k.differentiable)


@dataclass(frozen=True)
class Choices:
    """What the user asked for (every field as Engine takes it), checked on construction: no model needed."""

    backend: str = "auto"
    impl: str = "auto"
    attn: str = "auto"
    attn_precision: str = "auto"
    diff_matmul: str = "auto"
    loop: str = "auto"
    sync_every: int | None = None
    graphs: str = "auto"
    graph_cache: int | None = None  # None: DEFAULT_CAPACITY, BUCKET_CAPACITY with length buckets
    length_buckets: int | str = "auto"  # or 'off', or the sizes a doubling (sicl_fast.run.buckets)
    pack: int | str = 1  # or 'auto': packed where it pays (auto_pack)
    grad: bool = False  # the run takes the exact gradient (estimator 'grad')
    reuse: str | None = "off"  # the calibration store: 'auto', 'on', 'off'; None: 'auto' unless packing
    threads: int | None = None  # None: OMP_NUM_THREADS, else the cores this process may use (sicl_fast.run.threads)

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise SiclError(f"unknown backend {self.backend!r}; choose one of {sorted(BACKENDS)} or 'auto'")
        check_choice(self.impl, IMPLS, "impl", "ops")
        if self.attn not in ATTN_IMPLS:
            raise SiclError(f"unknown attention implementation {self.attn!r}; choose one of {ATTN_IMPLS}")
        check_choice(self.attn_precision, ATTN_PRECISIONS, "attn_precision", "Engine")
        if self.diff_matmul not in DIFF_MATMUL:
            raise SiclError(f"unknown diff_matmul {self.diff_matmul!r}; choose one of {DIFF_MATMUL}")
        check_choice(self.loop, LOOPS, "loop", "Engine")
        check_choice(self.graphs, GRAPH_MODES, "graphs", "Engine")
        if self.pack != "auto":
            check_range("pack", self.pack, "Engine")
        if self.graph_cache is not None:
            check_range("graph_cache", self.graph_cache, "Engine")
        if self.length_buckets not in ("auto", "off"):
            check_per_octave(check_range("length_buckets", self.length_buckets, "Engine"))
            if self.pack != "auto":  # with 'auto', once the plan knows the pack (which then leaves them room)
                check_buckets(self.length_buckets, self.pack)
        if self.sync_every is not None:
            check_range("sync_every", self.sync_every, "Engine")
        if self.pack != "auto":  # with 'auto', once the plan knows the pack
            resolve_reuse(self.reuse, self.pack)
        # --threads, or OMP_NUM_THREADS beyond the table's limit refused, beyond the cores warned, before a model loads
        warn_oversubscribed(self.threads)


# ------------------------------------------------------------------------------------------- the rules, once


def forward_only(impl: str, asked: str | None = None) -> str | None:
    """Why `impl` cannot carry the exact gradient's backward (None: it can). asked: the impl asked for ('auto' took
    `impl` for a run without the exact gradient: the fix is to build the engine for it, not another impl)."""
    if impl in DIFFERENTIABLE_IMPLS:
        return None
    if asked == "auto":
        return (f"estimator 'grad' needs differentiable ops, and impl 'auto' took {impl!r} here, which is forward-only "
                "(the C++ and Triton ops have no backward): build the engine for the exact gradient "
                "(Engine(grad=True); on the command line, --estimator grad), where 'auto' takes 'torch'")
    return (f"estimator 'grad' needs differentiable ops, and impl {impl!r} is forward-only (the C++ and Triton ops "
            f"have no backward); use impl 'torch' or 'auto' (--impl torch)")


def no_differentiable_forward(name: str) -> str:
    return (f"the {name!r} backend has no differentiable forward; estimator 'grad' runs on the "
            + ", ".join(f"'{n}'" for n in GRAD_BACKENDS[:-1]) + f" and '{GRAD_BACKENDS[-1]}' backends")


def resolve_backend(name: str, config, embedding, lm=None) -> tuple[str, str, DecoderConfig | None]:
    """(the backend `name` resolves to, why, the fast decoder's config where it is the fast one) for a model's text
    config and input-embedding module. 'auto' builds the fast decoder's config from the whole config and takes
    'hf' on any refusal (another family, a rope type, partial rotary, ...), the refusal its reason; a fast backend
    asked for raises it (UnsupportedModelError). lm: the loaded model, whose own logits the fast decoder's head
    must make (fast_head_refusal); None before a model loads (the command line's --pack auto)."""
    try:
        decoder = DecoderConfig.from_hf(config, embedding) if name == "auto" or BACKENDS[name].cls == "fast" else None
        why = fast_head_refusal(decoder, lm) if decoder is not None and lm is not None else None
        if why is not None:
            raise UnsupportedModelError(why)
    except UnsupportedModelError as exc:
        if name != "auto":
            raise
        return "hf", f"auto: the fast decoder refuses this {config.model_type!r} model: {exc}", None
    if name == "auto":
        return "fast", f"auto: the fast decoder runs this {config.model_type!r} model", decoder
    return name, "asked for", decoder


def fast_head_refusal(decoder: DecoderConfig, lm) -> str | None:
    """Why the fast decoder's LM head would not make the model's own logits (None: it does): the model's head as
    checked against its forward (LoadedModel.output_head) has a bias, a cut vocabulary, a rule the table does not
    know, or another final soft-cap (Gemma3ForConditionalGeneration does not soft-cap, whatever its text config
    says) or logit multiplier (both read by output_head.head_terms, the model's config here, its text config there)."""
    head = lm.output_head
    if head.mode != "table":
        return f"its logits are not its LM head's weight with the known rules: {head.why}"
    if head.bias or head.vocab is not None:
        return f"the fast decoder's head has no bias and no cut vocabulary: {head.why}"
    if head.softcap != decoder.final_softcap:
        return (f"the fast decoder soft-caps the logits at {decoder.final_softcap}, and {type(lm.model).__name__} "
                f"at {head.softcap} ({head.why})")
    if head.scale != decoder.logit_scale:
        return (f"the fast decoder scales the logits by {decoder.logit_scale}, and {type(lm.model).__name__} by "
                f"{head.scale} ({head.why})")
    return None


def resolve_head(kind: BackendKind, lm) -> tuple[OutputHead | None, str]:
    """(the hf backend's OutputHead, why): how the span rows' logits are made, checked against the model's own
    forward (LoadedModel.output_head, which refuses a model that is not causal or whose input embeddings are not its
    tokens': the naive backend's rule too). The fast decoder makes its own (its DecoderConfig)."""
    if kind.cls == "fast":
        return None, "the fast decoder's LM head (its config's final soft-cap), checked against the model's own logits"
    head = lm.output_head  # the probe runs once per loaded model; its refusals hold for naive too
    if kind.cls == "naive":
        return None, "the model's own full logits, every row"
    return head, head.why


def resolve_impl(impl: str, device, grad: bool = False) -> tuple[str, str]:
    """(the implementation `impl` names on `device`, why); a SiclError when it cannot run there. grad: the run takes
    the exact gradient, which needs a differentiable implementation (torch)."""
    check_choice(impl, IMPLS, "impl", "ops")
    dev = torch.device(device)
    if grad and impl != "auto" and forward_only(impl):
        raise SiclError(forward_only(impl))
    if grad:
        name, why = "torch", "auto: the exact gradient needs differentiable ops"
    elif impl != "auto":
        name, why = impl, "asked for"
    elif dev.type == "cuda":
        name, why = "triton", "auto: the model is on CUDA"
    elif dev.type == "cpu" and cpp_ops.available():
        name, why = "cpp", "auto: the C++ extension is built and the model is on the CPU"
    else:
        name, why = "torch", "auto: no Triton (not CUDA) and no C++ extension for this device"
    if name == "cpp":
        if dev.type != "cpu":
            raise SiclError(f"impl 'cpp' runs on the CPU; the model is on {device} (use 'triton' or 'torch')")
        cpp_ops.require()  # says how to build the extension when it is missing
    elif name == "triton":
        load_kernels(dev)  # says what is missing: triton, or CUDA / TRITON_INTERPRET=1
    return name, why


# what each kernel hands to the math path, call by call (sicl_fast.models.attention.Attention): execution details of
# one kernel, not choices, shown by explain(); every kernel's decoding steps attend through the math path (a masked
# whole KV buffer: the same shapes at every position)
MATH_PATH = {
    "sdpa": "soft-capped layers, masks SDPA cannot take exactly, decoding steps",
    "flash": "float32 inputs, masks flash-attn cannot take exactly, decoding steps",
    "triton": "a KV cache's prefill after position 0, decoding steps",
    "cpp": "the exact gradient's forward (autograd recording), a bf16 / fp16 model's plain forward, decoding steps",
}


def resolve_attention(attn: str, kind: BackendKind, device, dtype, impl: str, lm=None) -> tuple[str | None, str]:
    """The fast decoder's attention kernel and why; for the hf and naive backends, which run transformers' own
    attention, a refusal where the loaded model's attention drops what its math needs (eager_reason; load() and
    from_transformers() choose eager for such a model)."""
    if kind.cls != "fast":
        runs = attention_of(lm.model) if lm is not None else None
        why = eager_reason(lm.model.config) if lm is not None else None
        if why is not None and runs != "eager":
            raise SiclError(f"model {lm.name!r} ({lm.family}) runs transformers' {runs!r} attention, but {why}: "
                            "load it with sicl_fast.load or from_transformers (which pick eager attention for it), or "
                            "call model.set_attn_implementation('eager')")
        return None, f"transformers' own attention ({runs})" + (f": eager, as {why}" if why else "")
    dev = torch.device(device)
    if attn == "triton":
        load_kernels(dev, "attention implementation 'triton'", "'sdpa' / 'math'")
    if attn == "cpp" and dev.type != "cpu":
        raise SiclError(f"attention implementation 'cpp' runs on the CPU; this model is on {dev}")
    if attn == "cpp":
        cpp_ops.require()
    if attn == "flash" and not flash_available():
        raise SiclError("attention implementation 'flash' needs flash-attn: pip install \"sicl-fast[flash]\"")
    name, why = resolve_attention_kernel(attn, dev, dtype, impl)
    return name, why if name == "math" else f"{why}; the math path takes {MATH_PATH[name]}"


def resolve_attention_kernel(attn: str, dev: torch.device, dtype, impl: str) -> tuple[str, str]:
    """The fast decoder's attention kernel that `attn` names (checked by resolve_attention), and why."""
    if attn != "auto":
        return attn, "asked for"
    if impl == "triton":
        return "triton", "auto: the fused prefix + rows kernel of impl 'triton'"
    if impl == "cpp":
        return "cpp", "auto: the C++ prefix + rows attention of impl 'cpp'"
    if dev.type == "cuda" and flash_available() and dtype in (torch.float16, torch.bfloat16):
        return "flash", "auto: flash-attn on CUDA, fp16 / bf16"
    # torch's CPU flash kernel: exact to 1e-5 against math (tested) and ~1.5x faster at SmolLM2's head shapes
    return "sdpa", "auto: torch's SDPA"


def resolve_attention_precision(asked: str, attention: str | None, grad: bool = False) -> tuple[str | None, str]:
    """(how the fast decoder's float32 attention multiplies, why) for the kernel `attention` (None: not the fast
    decoder, which runs transformers' own attention): module docstring's attention_precision. 'tf32x3' runs on the
    Triton kernel, or emulated on the math path (without a backward: refused with the exact gradient); the other
    kernels multiply in IEEE float32 and refuse it."""
    if attention is None:
        return None, "not the fast decoder"
    if asked == "auto":
        if attention == "triton":
            return "tf32x3", ("auto: the Triton kernel's float32 products on the tensor cores, 3 TF32 products (about "
                              "21 of float32's 24 bits; they keep the float32 gain: bench/RESULTS.md section 31)")
        return "ieee", f"auto: the {attention!r} kernel's own float32 products"
    if asked == "tf32x3" and attention not in PRECISE_IMPLS:
        raise SiclError(f"attn_precision 'tf32x3' runs on the Triton attention (the tensor cores) or, emulated, on the "
                        f"math path; the {attention!r} attention multiplies in IEEE float32 (use attn 'triton' or "
                        "'math', or attn_precision 'auto')")
    if asked == "tf32x3" and attention == "math":
        if grad:
            raise SiclError("attn_precision 'tf32x3' on the math path is an emulation without a backward; the exact "
                            "gradient takes attn_precision 'auto' or 'ieee'")
        return "tf32x3", "asked for: emulated in torch on the math path (the precision study's path, slow)"
    if attention == "triton":
        return asked, ("asked for: IEEE float32 FMA on the CUDA cores" if asked == "ieee" else
                       "asked for: 3 TF32 products on the tensor cores")
    return asked, "asked for"


def resolve_attention_check(attention: str | None, device, fallback: bool) -> tuple[bool, str]:
    """Whether the fast backend compares its attention kernel with the math path once, when it is built
    (Attention.verify): on CUDA, where a fused kernel may fail or differ on the machine; fallback (the kernel was
    'auto'): a mismatch warns and takes 'math', else it is an error."""
    if attention is None:
        return False, "not the fast decoder"
    if attention == "math":
        return False, "the math path is the reference"
    if torch.device(device).type != "cuda":
        return False, "not CUDA: the CPU kernels are tested against the math path"
    return True, ("CUDA: compared with the math path once, when the plan is made; "
                  + ("'math' on a mismatch (auto)" if fallback else "a mismatch is an error (asked for)"))


def verify_attention(attention: str, decoder: DecoderConfig, device, dtype, fallback: bool, rows: bool,
                     precision: str = "ieee"):
    """The check resolve_attention_check turned on, run (Attention.verify on the model's heads, on its device, with
    the difference form's rows where they are on): (the kernel the backend will run, the reason when that is not
    `attention` (else None), the check's value and reason). A kernel that fails its check is replaced by 'math' with
    fallback (asked 'auto'), else raises SiclError naming the kernel and why."""
    from ..models.attention import Attention
    from ..ops import attention_kernels

    att = Attention(attention, decoder.attn_scale, decoder.attn_softcap, dtype, device, attention_kernels(attention),
                    precision)
    problem = att.verify(decoder.H, decoder.Hk, decoder.hd, fallback=fallback, rows=rows)  # warns where it falls back
    if problem is None:
        return attention, None, "passed", "CUDA: compared with the math path once, on the model's heads: within " \
            "tolerance"
    return ("math", f"{attention!r} failed its check on this machine (attention_check): the math path", "failed",
            f"CUDA: {problem}; 'math' instead")


# what the precision study measured of the plain low-precision ascent (bench/precision_fidelity.py; RESULTS 17),
# per model dtype: the perturbation is about one bf16 ulp of an embedding, eight float16 ulps
PLAIN_LOW_PRECISION = {
    "bfloat16": ("a plain bfloat16 ascent keeps only a few per cent of the float32 gain (the perturbation is about one "
                 "bf16 ulp of an embedding; bench/RESULTS.md section 17: 5 % on SmolLM2, none on Gemma 3 270M); "
                 "diff_matmul 'bf16' (the default) keeps it"),
    "float16": ("a plain float16 ascent keeps only part of the float32 gain (the perturbation is about eight float16 "
                "ulps of an embedding; bench/RESULTS.md section 25: 42 % and 81 % on two short SmolLM2 prompts); "
                "diff_matmul 'bf16' (the default) keeps it"),
}


def plain_low_precision(dtype) -> bool:
    """Would a plain ascent on a model of this dtype lose its perturbations to rounding (below float32)?"""
    return dtype in (torch.bfloat16, torch.float16)


def resolve_diff(diff: str, kind: BackendKind, device, dtype) -> tuple[str, str]:
    """The fast decoder's products for perturbation batches: the difference form ('bf16', 'fp8') or plain ('off').
    The plain form on a bf16 / fp16 model (asked for, or fast-fp32) warns with what the precision study measured."""
    low = plain_low_precision(dtype)
    name = str(dtype).replace("torch.", "")
    if kind.cls != "fast":
        return "off", "not the fast decoder"
    if kind.plain or diff == "off":
        if low:
            warnings.warn(PLAIN_LOW_PRECISION[name], SiclWarning, stacklevel=3)
        return "off", ("fast-fp32: every product plain, in the model dtype" if kind.plain else "asked for")
    if diff == "fp8":
        refusal = fp8_refusal(device)
        if refusal:
            raise SiclError(refusal)
        if torch.device(device).type == "cuda":
            return diff, ("asked for: the value rows through bf16 products, the difference rows through FP8 ones "
                          "(torch._scaled_mm), an FP8 copy of each weight beside the bf16 one")
        return diff, "asked for: emulated off CUDA (float32 products of FP8 values: the accuracy study's path, slow)"
    if diff != "auto":
        return diff, "asked for"
    # 'fp8' is never chosen by 'auto': its accuracy is measured (bench/precision_fidelity.py) but not its speed yet
    if low:
        return "bf16", (f"auto: a plain {name} ascent loses the perturbations to rounding; the difference form "
                        "keeps them")
    if fast_low_precision(torch.device(device)):
        return "bf16", "auto: bf16 products are fast here (AVX512-BF16 / AMX, or CUDA sm_80+)"
    return "off", "auto: bf16 products are not faster here (plain float32)"


def resolve_loop(loop: str, name: str) -> tuple[str, str]:
    sync_free = BACKENDS[name].sync_free
    if loop == "static" and not sync_free:
        raise SiclError(f"loop 'static' needs the fast backend's sync-free forward; {name!r} has none (use loop "
                        "'eager' or 'auto')")
    if loop == "eager":
        return "eager", "asked for"
    if loop == "static":
        return "static", "asked for"
    if sync_free:
        return "static", f"auto: the {name!r} backend has a sync-free forward"
    return "eager", f"auto: the {name!r} backend has no sync-free forward"


def resolve_graphs(mode: str, device, static: bool, name: str, loop: str) -> tuple[bool, str]:
    """'on' / 'off' / 'auto' (on for CUDA with the static loop) -> whether the engine captures, why."""
    cuda = torch.device(device).type == "cuda"
    if mode == "on" and not cuda:
        raise SiclError(f"graphs 'on' needs a CUDA device; the model is on {torch.device(device)} (use 'auto' or "
                        "'off')")
    if mode == "on" and not static:
        raise SiclError(f"graphs 'on' captures the static step; backend {name!r} with loop {loop!r} has none (use "
                        "graphs 'auto' or 'off')")
    if mode != "auto":
        return mode == "on", "asked for"
    if not cuda:
        return False, "auto: not CUDA"
    return static, "auto: CUDA and the static loop" if static else "auto: no static step to capture"


# prompts through one forward where packing pays (auto_pack): the H200 measurements issue #38 quotes (bench/RESULTS.md
# section 18 lists them, not re-measured here) and RESULTS 4 / 10
AUTO_PACK = 8
PACK_MAX_PARAMS = 1e9  # at and above, one prompt's products run at the bf16 rate already: packing gains nothing


def auto_pack(device, n_params: int, static: bool = True, grad: bool = False, buckets: bool = False
              ) -> tuple[int, str]:
    """(prompts per forward, why) for pack 'auto': 8 on CUDA for a model under 1B parameters with the static loop
    (a SmolLM2-shape mix of 24 prompts packed 8 at a time: 180 ms a prompt against 527 one by one on an H200, as
    issue #38 measured it: RESULTS 18), else 1 (the CPU: packing loses there, the padding and the attention growing
    with the square, RESULTS 10; 1B parameters and more: nothing to gain, Llama-3.1-8B 3,040 vs 2,977 ms (issue
    #38), Gemma-2-2B packed slower (RESULTS 4); the exact gradient and the eager loop run one prompt at a time;
    buckets: a count of length buckets asked for, which the packed step would leave unused (buckets_unused)). The
    one rule for the plan and for the command line, which decides before the model loads (sicl_fast.models.facts
    gives the size)."""
    if grad:
        return 1, "auto: the exact gradient calibrates one prompt at a time"
    if not static:
        return 1, "auto: packing needs the static loop"
    if torch.device(device).type != "cuda":
        return 1, "auto: not CUDA (on the CPU packing loses: RESULTS 10)"
    if n_params >= PACK_MAX_PARAMS:
        return 1, (f"auto: {n_params / 1e9:.1f}B parameters: one prompt's products run at the bf16 rate already "
                   "(RESULTS 4, 18)")
    if buckets and buckets_unused(AUTO_PACK):
        return 1, "auto: length buckets asked for, which the packed step does not use"
    return AUTO_PACK, (f"auto: CUDA and {n_params / 1e6:.0f}M parameters: up to {AUTO_PACK} prompts through one "
                       "forward (2.9x one by one at SmolLM2's shape on an H200, RESULTS 18)")


# the packed step pads each pack to its longest prompt, not to a length bucket (sicl_fast.calibration.packed): the
# one line to change when it takes buckets (buckets_unused is then only the exact gradient's rule)
PACKED_BUCKETS = False


def buckets_unused(pack: int, grad: bool = False) -> str | None:
    """Why length buckets would pad nothing in a run of `pack` prompts a step, every calibration taking the exact
    gradient when `grad` (None: they pad its static step). The one rule for Choices, the plan, auto_pack and the
    command line."""
    if pack > 1 and not PACKED_BUCKETS:
        return f"pack {pack} runs the packed step, which pads each pack to its longest prompt, not to length buckets"
    if grad:
        return "estimator 'grad' runs on the eager loop, which pads nothing"
    return None


def check_buckets(mode, pack: int, grad: bool = False) -> None:
    """A count of length buckets asked for where they would pad nothing (buckets_unused) is refused."""
    why = buckets_unused(pack, grad) if mode not in ("auto", "off") else None
    if why:
        raise SiclError(f"length_buckets {mode}: {why}; use 'auto' or 'off'" + (", or pack 1" if pack > 1 else ""))


def resolve_buckets(mode, graphs: bool, static: bool, name: str, loop: str, pack: int = 1,
                    grad: bool = False) -> tuple[int | None, str]:
    """(length buckets a doubling or None, why): 'auto' takes PER_OCTAVE where the static step is captured (a new
    length would cost a capture: 1.6 s at SmolLM2, RESULTS 4) and runs unpacked, none elsewhere (uncaptured, padding
    only adds work); a count as asked, on the static loop without packing only (the padded step is the static one).
    grad: the run takes the exact gradient, whose calibrations run on the eager loop, unpadded (said, not refused:
    the zeroth-order ones of the same engine take the buckets)."""
    grad_note = "; the exact gradient's calibrations run on the eager loop, unpadded" if grad else ""
    if mode == "off":
        return None, "asked for"
    if mode == "auto":
        if graphs and buckets_unused(pack):
            return None, f"auto: {buckets_unused(pack)}"
        if graphs:
            return PER_OCTAVE, (f"auto: captured steps; {PER_OCTAVE} lengths a doubling share one (at most 25 % "
                                f"padding, same results up to the products' summation order){grad_note}")
        return None, "auto: no captured step to share (padding would only add work)"
    if not static:
        raise SiclError(f"length_buckets {mode} pads the static step; backend {name!r} with loop {loop!r} has none "
                        "(use 'auto' or 'off')")
    check_buckets(mode, pack)
    return mode, f"asked for: {mode} lengths a doubling share one static step{grad_note}"


def resolve_graph_cache(capacity: int | None, buckets: int | None) -> tuple[int, str]:
    """(static steps kept, why): as asked, else DEFAULT_CAPACITY, or BUCKET_CAPACITY with length buckets (their
    graphs share one memory pool: a kept bucket costs its buffers only)."""
    if capacity is not None:
        return capacity, "asked for"
    if buckets is not None:
        return BUCKET_CAPACITY, "default with length buckets (one memory pool for their graphs)"
    return DEFAULT_CAPACITY, "default"


def resolve_pack(pack, static: bool, name: str, loop: str, device=None, n_params: int = 0,
                 grad: bool = False, buckets: bool = False) -> tuple[int, str]:
    """(prompts per packed step, why): 'auto' by auto_pack (buckets: a count of length buckets asked for); a count
    as asked, > 1 only on the static loop."""
    if pack == "auto":
        return auto_pack(device, n_params, static, grad, buckets)
    if pack > 1 and not static:
        raise SiclError(f"pack > 1 needs the static loop on the fast backend (backend {name!r}, loop {loop!r})")
    return pack, "one prompt at a time" if pack == 1 else f"up to {pack} prompts through one forward (packed step)"


def check_zeroth_order(estimator: str) -> None:
    """The static and packed steps run the zeroth-order ascent only."""
    if estimator == "grad":
        raise SiclError("the static and packed steps run the zeroth-order ascent only; estimator 'grad' runs on the "
                        "eager loop (loop 'eager' or 'auto', --loop eager; no --pack)")


def check_unpacked(estimator: str, pack: int) -> None:
    """pack > 1 runs the zeroth-order packed step only."""
    if pack > 1 and estimator == "grad":
        raise SiclError("pack > 1 runs the zeroth-order packed step; estimator 'grad' calibrates one prompt at a "
                        "time (pack 1)")


def check_estimator(estimator: str, loop: str, pack: int) -> None:
    """Before any model loads (the CLI's --estimator with --loop / --pack): the exact gradient runs one prompt at a
    time on the eager loop. The rules RunPlan.check_pack and loop_for apply to a plan's calibrations."""
    check_unpacked(estimator, pack)
    if loop == "static":
        check_zeroth_order(estimator)


REUSE_MODES = ("auto", "on", "off")


def resolve_reuse(reuse: str | None, pack: int, keeps_best: bool = False) -> tuple[str, str]:
    """(mode, why) of the calibration store (sicl_fast.answering.reuse): None is the command line's default, 'auto'
    unless packing; the packed step calibrates without the store. keeps_best: the calibrations keep the best X along
    their run (Engine.calibrate's best_at, icleval --answer-at), which a calibration from the store does not have: the
    store is off by default then, and refused when asked for."""
    if reuse is None:
        if keeps_best:
            return "off", "default with best_at / --answer-at (a calibration from the store has no run)"
        if pack > 1:
            return "off", "default with pack > 1 (the packed step calibrates without the store)"
        return "auto", "default: reuse a stored calibration where that is exact, calibrate per query elsewhere"
    check_choice(reuse, REUSE_MODES, "reuse", "Engine")
    if reuse != "off" and keeps_best:
        raise SiclError(f"best_at (icleval --answer-at) keeps the best X along each calibration, and one from the "
                        f"store has none: use reuse 'off' (--reuse off, the default with --answer-at), not {reuse!r}")
    if reuse != "off" and pack > 1:
        raise SiclError(f"reuse {reuse!r} with pack {pack}: packed calibration does not use the store; use reuse "
                        "'off' (--reuse off), or pack 1")
    return reuse, {"auto": "asked for: reuse where exact, calibrate per query elsewhere",
                   "on": "asked for: reuse always (approximate where the projection could have fired)",
                   "off": "asked for: every prompt calibrated"}[reuse]


def default_sync_every(device) -> int:
    """Steps between two reads of the static step's state: 1 on the CPU (a read costs nothing there and the
    progress stays exact); 8 on a GPU, where a read waits for the device (measured on an H200, bench/RESULTS.md
    section 4: SmolLM2's whole calibration within 1 % of the same time from 1 to 32 steps a read, so 8 keeps the
    progress line close at no measurable cost)."""
    return 1 if torch.device(device).type == "cpu" else 8


def resolve_read_every(kind: BackendKind, device) -> tuple[int, str]:
    """Tokens the fast backend decodes between two host reads of its greedy answer (the answer is the same for any
    count: tokens past a stop are dropped): 1 on the CPU, where a read costs nothing and no token is computed past
    a stop; 8 on a GPU, where a read waits for the device. Other backends decode through transformers, one read a
    token."""
    if kind.cls != "fast":
        return 1, "transformers' generation (not the fast decoder) reads every token"
    if torch.device(device).type == "cpu":
        return 1, "CPU: a read costs nothing, and no token is decoded past a stop"
    return 8, "not the CPU: a read waits for the device"


def grad_refusal(impl: str, name: str, lm, asked: str | None = None) -> str | None:
    """Why estimator 'grad' cannot run on this implementation, backend and model (None: it can): forward-only ops
    (asked: the impl asked for, forward_only), a backend without a differentiable forward, weights autograd cannot
    go through."""
    why = forward_only(impl, asked)
    if why:
        return why
    if not BACKENDS[name].differentiable:
        return no_differentiable_forward(name)
    params = list(lm.model.parameters())
    bad = sorted({str(p.dtype) for p in params if not p.dtype.is_floating_point})
    if bad:
        return (f"estimator 'grad': model {lm.name!r} holds {', '.join(bad)} weights (quantized), which autograd "
                "cannot run through; load it in a floating-point dtype")
    if any(p.is_inference() for p in params):
        return (f"estimator 'grad': the weights of {lm.name!r} were made under torch.inference_mode, and autograd "
                "cannot use them; load the model outside inference_mode")
    return None


# ------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RunPlan:
    """Every axis of a run, resolved (module docstring). why: (axis, value, reason) per axis, for explain()."""

    model: str
    family: str
    device: torch.device
    dtype: torch.dtype
    backend: str  # 'fast', 'fast-fp32', 'hf', 'naive': what results and records report
    impl: str  # 'torch', 'cpp', 'triton'
    attention: str | None  # the fast decoder's kernel ('math', 'sdpa', 'flash', 'triton', 'cpp'); None: not fast
    attention_fallback: bool  # asked 'auto': a fused kernel that fails its check on CUDA falls back to 'math'
    attention_check: bool  # the kernel compared with the math path once when the plan was made (CUDA)
    attention_precision: str | None  # the float32 attention's products: 'tf32x3' or 'ieee'; None: not fast
    diff_matmul: str  # 'off', 'bf16', 'fp8'
    decoder: DecoderConfig | None  # the fast decoder's model facts (None: not the fast backend)
    head: OutputHead | None  # how the hf backend makes the span rows' logits (None: not the hf backend)
    loop: str  # 'static' or 'eager': where zeroth-order calibrations run
    loop_asked: str
    sync_every: int
    read_every: int  # decoding: tokens between two host reads (FastBackend.generate, query-only answers)
    graphs: bool
    graph_cache: int
    length_buckets: int | None  # length bucket sizes a doubling (sicl_fast.run.buckets); None: one step a shape
    pack: int
    grad: bool  # the run takes the exact gradient: ops, backend and model checked differentiable
    grad_refusal: str | None  # why estimator 'grad' cannot run on this plan (None: it can)
    reuse: str  # the calibration store: 'auto', 'on', 'off' (sicl_fast.answering.reuse)
    threads: int  # torch's and the C++ ops' thread count
    wait_policy: str  # how OpenMP's threads wait at a barrier ('passive', the environment's, libgomp's default)
    fallback: str | None = None  # what a failed check of a new capture's first replay switched to, and why (fall_back)
    why: tuple = field(default=(), compare=False)

    @property
    def kind(self) -> BackendKind:
        return BACKENDS[self.backend]

    @property
    def static(self) -> bool:
        return self.loop == "static"

    def check_grad(self) -> None:
        """Refuse the exact gradient where it cannot run (grad_refusal)."""
        if self.grad_refusal:
            raise SiclError(self.grad_refusal)

    def check_zeroth_order(self, estimator: str) -> None:
        """The static and packed steps run the zeroth-order ascent only (check_zeroth_order)."""
        check_zeroth_order(estimator)

    def require_sync_free(self, what: str) -> None:
        """The static ('step') and packed ('packed') steps need the backend's forward without host reads."""
        if self.kind.sync_free:
            return
        if what == "packed":
            raise SiclError(f"the packed step needs the fast backend's sync-free forward; {self.backend!r} has none")
        raise SiclError(f"the static step needs a forward without host reads, which the {self.backend!r} backend "
                        "does not have; use the 'fast' or 'fast-fp32' backend, or the eager loop")

    def loop_for(self, estimator: str) -> str:
        """Where one calibration with `estimator` runs: 'static' or 'eager'. The exact gradient runs on the eager
        loop when the loop was left to 'auto', is refused on a loop asked to be static, and needs grad_refusal None."""
        if estimator != "grad":
            return self.loop
        if self.loop_asked == "static":
            self.check_zeroth_order(estimator)
        self.check_grad()
        return "eager"

    def check_pack(self, estimator: str) -> None:
        """calibrate_many with pack > 1 runs the zeroth-order packed step only (check_unpacked)."""
        check_unpacked(estimator, self.pack)

    def result_axes(self, attention: str | None = None) -> dict:
        """The axes whose value changes a calibration's bits, JSON-ready: the calibration store's key holds them
        (sicl_fast.store.keys). attention: the kernel the backend actually runs, where the plan cannot say it (a
        fused kernel that failed its check on CUDA falls back to 'math'; the hf and naive backends run transformers'
        own attention, which the plan does not choose); None: the plan's.

        Length buckets are one where on: a padded step's products run over more rows, which may change their
        summation order (tests/test_buckets.py). The thread count on the CPU is one of them: the products and the
        C++ ops split their sums by thread, so SmolLM2's proxy moves in its last bits between 1 and 2 threads (an
        entry made with one count is not what an engine with another computes, and would be served to it as
        exact). On CUDA it is not.

        The attention's precision is one where it is not IEEE float32 ('tf32x3': the Triton kernel's default, or
        the math path's emulation), for the attention that runs.

        Left out, as they give the same bits: the loop and sync_every (the static step equals the eager loop bit
        for bit at any read interval, tests/test_static.py and bench/same_histories.py), graphs and graph_cache (a
        captured step replays the same kernels, test_static.py's capture test), grad (it picks the ops, whose impl
        is here; the estimator is a config field, in the key), reuse (how the store is used, not what a run
        computes) and the wait policy. pack: the store never sees a packed run (reuse is off with pack > 1)."""
        axes = {"backend": self.backend, "impl": self.impl, "attention": attention or self.attention,
                "diff_matmul": self.diff_matmul, "dtype": str(self.dtype), "device": self.device.type,
                "threads": self.threads if self.device.type == "cpu" else None}
        precision = self.attention_precision if (attention or self.attention) == self.attention else "ieee"
        if precision not in (None, "ieee"):  # present only when not IEEE float32: the keys made before it stay
            axes["attention_precision"] = precision
        if self.length_buckets is not None:  # the padded forward's products may sum in another order (present only
            axes["length_buckets"] = self.length_buckets  # when on: the keys of runs without buckets stay as they were)
        return axes

    def explain(self) -> str:
        """The plan as a table: every axis, its value and why."""
        lines = [f"run plan: model {self.model} ({self.family}, {str(self.dtype).replace('torch.', '')}, "
                 f"{self.device})"]
        width = max(len(axis) for axis, _, _ in self.why)
        for axis, value, reason in self.why:
            lines.append(f"  {axis:<{width}}  {value!s:<13}  {reason}")
        return "\n".join(lines)


FALLBACKS = ("uncaptured", "torch")


def fall_back(plan: RunPlan, to: str, why: str) -> RunPlan:
    """The plan a run goes on with after the first replay of a new capture failed its check (sicl_fast.run.graphs:
    first_replay): 'uncaptured' (graphs off: the plan's ops gave the step right uncaptured) or 'torch' (graphs off,
    the torch ops and the math attention: the plan's ops were wrong uncaptured too). `fallback` says which and why
    (the records' settings carry it: sicl_fast.run.settings), and so do the reasons of the axes it changed."""
    check_choice(to, FALLBACKS, "fallback", "fall_back")
    changes = {"graphs": False}
    if to == "torch":
        changes.update(impl="torch", attention="math")
    shown = {**changes, "graphs": "off"}
    rows = tuple((axis, shown[axis], f"fell back ({to}): {why}") if axis in shown else (axis, value, reason)
                 for axis, value, reason in plan.why if axis != "fallback")
    return dataclasses.replace(plan, **changes, fallback=f"{to}: {why}", why=rows + (("fallback", to, why),))


def without_effect(c: Choices, backend: str, loop: str) -> list[str]:
    """The choices asked for that the plan of `backend` on `loop` does not read, one line each (make_plan warns
    them; a refusal would stop `sicl-fast bench`, which runs one set of flags on several backends): the difference
    products and the attention kernel belong to the fast decoder (not 'fast-fp32''s float32 products), and the
    eager loop reads its state every step, whatever sync_every says."""
    kind, out = BACKENDS[backend], []
    if c.diff_matmul in ("bf16", "fp8") and (kind.cls != "fast" or kind.plain):
        out.append(f"diff_matmul {c.diff_matmul!r} has no effect on backend {backend!r}: only the 'fast' backend "
                   "multiplies differences in lower precision")
    if c.attn != "auto" and kind.cls != "fast":
        out.append(f"attn {c.attn!r} has no effect on backend {backend!r}, which runs transformers' own attention")
    if c.attn_precision != "auto" and kind.cls != "fast":
        out.append(f"attn_precision {c.attn_precision!r} has no effect on backend {backend!r}, which runs "
                   "transformers' own attention")
    if c.sync_every is not None and loop == "eager":
        out.append(f"sync_every {c.sync_every} has no effect on the eager loop, which reads its state every step "
                   "(it sets the static loop's reads)")
    return out


def make_plan(lm, choices: Choices | None = None, **kw) -> RunPlan:
    """The RunPlan of `choices` (or Choices(**kw)) on the loaded model `lm` (module docstring). Raises a SiclError
    (UnsupportedModelError for a model the fast backend cannot run) naming what cannot be done and what to do."""
    c = choices if choices is not None else Choices(**kw)
    dev, dtype, family = torch.device(lm.device), lm.dtype, lm.family
    check_device(dev, f"model {lm.name!r} (on {dev})")
    backend, why_backend, decoder = resolve_backend(c.backend, lm.text_config, lm.model.get_input_embeddings(), lm)
    kind = BACKENDS[backend]
    impl, why_impl = resolve_impl(c.impl, dev, c.grad)
    attention, why_attention = resolve_attention(c.attn, kind, dev, dtype, impl, lm)
    head, why_head = resolve_head(kind, lm)
    check, why_check = resolve_attention_check(attention, dev, c.attn == "auto")
    precision, why_precision = resolve_attention_precision(c.attn_precision, attention, c.grad)
    diff, why_diff = resolve_diff(c.diff_matmul, kind, dev, dtype)
    checked = "on" if check else "off"
    if check:
        attention, failed, checked, why_check = verify_attention(attention, decoder, dev, dtype, c.attn == "auto",
                                                                 diff != "off", precision)
        why_attention = failed or why_attention
        if failed:
            precision, why_precision = "ieee", "the math path's own, after the attention check's fallback"
    loop, why_loop = resolve_loop(c.loop, backend)
    static = loop == "static"
    if c.grad and static:  # the loop axis is the zeroth-order calibrations' (loop_for)
        why_loop += "; the exact gradient's calibrations run on the eager loop"
    sync_every = c.sync_every if c.sync_every is not None else default_sync_every(dev)
    why_sync = "asked for" if c.sync_every is not None else f"default on {dev.type}"
    read_every, why_read = resolve_read_every(kind, dev)
    graphs, why_graphs = resolve_graphs(c.graphs, dev, static, backend, c.loop)
    n_params = sum(p.numel() for p in lm.model.parameters()) if c.pack == "auto" else 0
    pack, why_pack = resolve_pack(c.pack, static, backend, c.loop, dev, n_params, c.grad,
                                  buckets=c.length_buckets not in ("auto", "off"))
    buckets, why_buckets = resolve_buckets(c.length_buckets, graphs, static, backend, c.loop, pack, c.grad)
    graph_cache, why_cache = resolve_graph_cache(c.graph_cache, buckets)
    reuse, why_reuse = resolve_reuse(c.reuse, pack)
    threads, why_threads = resolve_threads(c.threads)
    for line in without_effect(c, backend, loop):  # legal, but nothing reads them here: one line each
        warnings.warn(line, SiclWarning, stacklevel=2)
    if c.sync_every is not None and loop == "eager":
        why_sync = "asked for; no effect on the eager loop, which reads its state every step"
    wait, why_wait = choose_wait_policy()
    refusal = grad_refusal(impl, backend, lm, c.impl)
    if c.grad and refusal:
        raise SiclError(refusal)
    if c.grad:
        why_grad = "the run takes the exact gradient: differentiable ops, the eager loop"
    else:
        why_grad = f"forward / central on the {loop} loop; " + (f"'grad' refused: {refusal}" if refusal else
                                                                "'grad' would run on the eager loop")
    loaded = lm.extra.get("why", {})  # how the model's device and dtype were chosen (sicl_fast.models.loading)
    why = (("device", str(dev), loaded.get("device", "the loaded model's")),
           ("dtype", str(dtype).replace("torch.", ""), loaded.get("dtype", "the loaded model's")),
           ("backend", backend, why_backend), ("head", head.mode if head else "-", why_head),
           ("impl", impl, why_impl),
           ("attention", attention or "-", why_attention), ("attention_check", checked, why_check),
           ("attention_precision", precision or "-", why_precision),
           ("diff_matmul", diff, why_diff), ("loop", loop, why_loop), ("sync_every", sync_every, why_sync),
           ("read_every", read_every, why_read),
           ("graphs", "on" if graphs else "off", why_graphs),
           ("length_buckets", "off" if buckets is None else buckets, why_buckets),
           ("graph_cache", graph_cache, why_cache), ("pack", pack, why_pack),
           ("estimator", "grad" if c.grad else "zeroth-order", why_grad), ("reuse", reuse, why_reuse),
           ("threads", threads, why_threads), ("wait_policy", wait, why_wait))
    return RunPlan(model=lm.name, family=family, device=dev, dtype=dtype, backend=backend, impl=impl,
                   attention=attention, attention_fallback=c.attn == "auto", attention_check=check,
                   attention_precision=precision, diff_matmul=diff,
                   decoder=decoder, head=head, loop=loop, loop_asked=c.loop, sync_every=sync_every,
                   read_every=read_every,
                   graphs=graphs, graph_cache=graph_cache, length_buckets=buckets, pack=pack, grad=c.grad,
                   grad_refusal=refusal, reuse=reuse, threads=threads, wait_policy=wait, why=why)


def _unexplained(head: OutputHead | None) -> OutputHead | None:
    """A head without its `why` (the probe's words and the table's differ where they agree)."""
    return head if head is None else dataclasses.replace(head, why="")


def confirm_plan(plan: RunPlan, lm, choices: Choices) -> RunPlan:
    """The plan made before the load from the same choices (sicl_fast.run.planned: on the model's architecture
    without its weights) as the loaded model `lm` confirms it: what only the weights tell is read from them (the
    output head checked against the model's own forward, LoadedModel.output_head, which may refuse what the head's
    table alone allowed; the exact gradient's refusal, from the weights' dtypes; how the device and dtype were
    chosen). Where they agree, that plan is the engine's: nothing is resolved again (the attention kernel's check on
    CUDA included). Where they do not, or `lm` is not the model the plan was made for, the plan is made afresh on
    `lm` (make_plan, which falls back or refuses as it does)."""
    dev = torch.device(lm.device)
    if plan.model != lm.name or plan.device.type != dev.type or plan.dtype != lm.dtype:
        return make_plan(lm, choices)
    if plan.kind.cls == "fast" and fast_head_refusal(plan.decoder, lm) is not None:
        return make_plan(lm, choices)
    head, why_head = resolve_head(plan.kind, lm)
    refusal = grad_refusal(plan.impl, plan.backend, lm, choices.impl)
    if _unexplained(head) != _unexplained(plan.head) or refusal != plan.grad_refusal:
        return make_plan(lm, choices)
    loaded = lm.extra.get("why", {})  # as make_plan reads them
    why = tuple((axis, value, loaded.get(axis, reason) if axis in ("device", "dtype") else
                 why_head if axis == "head" else reason) for axis, value, reason in plan.why)
    return dataclasses.replace(plan, device=dev, head=head, why=why)


__all__ = ["ATTN_PRECISIONS", "AUTO_PACK", "BACKENDS", "FALLBACKS", "LOOPS", "MATH_PATH", "PACKED_BUCKETS",
           "PLAIN_LOW_PRECISION", "REUSE_MODES", "fall_back",
           "BackendKind", "Choices", "RunPlan", "auto_pack", "buckets_unused", "check_buckets", "confirm_plan",
           "make_plan",
           "plain_low_precision", "check_estimator", "check_unpacked",
           "check_zeroth_order", "default_sync_every", "forward_only", "grad_refusal", "no_differentiable_forward",
           "fast_head_refusal", "resolve_attention", "resolve_attention_check", "resolve_attention_kernel",
           "resolve_attention_precision",
           "resolve_backend", "resolve_head",
           "resolve_buckets", "resolve_diff", "resolve_graph_cache", "resolve_graphs", "resolve_impl", "resolve_loop",
           "resolve_pack", "resolve_read_every", "verify_attention",
           "resolve_reuse", "without_effect"]
