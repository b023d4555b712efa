"""Every launch configuration the launchers choose at the shapes the product meets, compiled for an NVIDIA target
without a GPU (kernels/_aot.py: Triton's own ptxas), with a cache of the results.

The interpreter runs code a GPU compile refuses (a tl.arange that is not a power of two) and has no shared memory or
register file: a float32 attention of head 256 with 64 x 64 tiles and 3 stages needed 344,320 B of shared memory,
where an H100 / H200 block has 232,448 B. So each kernel's configuration function (beside its launcher, e.g.
rope_rows.rope_rows_config) is called here as the launcher calls it on a GPU, at each family's real shapes, and the
configuration compiled for sm_90 (and sm_80) as the JIT specialises it (kernels/_aot.compile_kernel):

    FAMILIES                        the one table of the families' shapes (add a family here)
    family_cases(name, dtypes)      -> [Case]: every launcher's configuration at that family's shapes and flags
    decisions(cases)                -> [Case]: one a distinct launch decision (the same configuration, dtypes and
                                       non-boolean flags and Q_WHOLE / K_WHOLE; the other boolean
                                       flags of all of them on)
    suite_cases()                   -> decisions() of every family at one length: the suite's set
    compile_cases(cases, arch)      -> {case: result}: results from the cache, the rest compiled in subprocesses
    problems(case, result, arch)    -> [str]: a compile error, shared memory over the arch's block, a spill
    LIMITS                          the shared memory of a block by arch: 232,448 B (sm_90), 166,912 B (sm_80)

A result is {"shared": bytes, "regs": int, "stack": bytes (a spill makes a stack frame), "float_ops": {op: n},
"tensor_ops": {instruction: n} (the tensor cores' mma.sync / wgmma.mma_async, _aot.tensor_core_ops), "seconds": the
compile's, "error": str or None}, cached as one JSON file a case under cache_dir()
(SICL_COMPILE_CACHE, else the user cache's sicl_fast/sm_compile), keyed by the sha256 of the kernel's sources (its
module and what it imports from this package and from sicl_fast) and of _aot.py's, the case and Triton's version: a
changed kernel, configuration or Triton compiles again.
tests/test_sm90_configs.py compiles decisions() of every family; `bench/gpu_kernels.py --compile-only` every case.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import triton

from . import _aot

KERNELS = Path(__file__).resolve().parent
SICL = Path(importlib.util.find_spec("sicl_fast").origin).resolve().parent  # the package's folder (not imported here)
LIMITS = {90: 232_448, 80: 166_912}  # bytes of shared memory a block may use (H100 / H200, A100)

# The shapes the product meets: one entry a family the fast backend runs, from its checkpoint's config (d, heads H /
# Hk of hd, MLP I, vocabulary V, activation; q / k norms, Gemma's norms, attention and final soft-caps, sliding
# window, projection biases). aligned: d, hd, I, V multiples of 16, so the JIT specialises them (and every stride)
# as such; the last entry is the tests' own odd shapes, which the kernel tests also run on a GPU. Fields beyond the
# shapes: qk_norm True (a norm over each head) or 'whole' (over the whole q / k projection: Q_WHOLE / K_WHOLE);
# norms 'post' (no norm before attention and MLP, norms after them, in float32: HAS_W off in the layer's norms,
# HAS_POST and GEMMA on); bias True (every projection) or 'qkv' (q / k / v only); rot: the rotated width of a head
# where it is not the whole head (partial rotary; a runtime int, specialised as a multiple of 16 where aligned). The
# residual multiplier (y_scale) and logit scalings are runtime floats: no launch decision of their own.
# The later families' entries (issue #47) as their config.json on the Hugging Face Hub gives them (recalled, not
# read here): Qwen2.5-7B (q / k / v biases; sliding_window off without use_sliding_window), Mistral-7B-v0.3 (no
# window; v0.1's 4096), Ministral-8B-Instruct-2410, Phi-3-mini-4k-instruct (head 96, window 2047), Phi-4-mini-instruct
# (partial_rotary_factor 0.75 of head 128, longrope), granite-3.1-2b-instruct (V 49155 is no multiple of 16: the JIT
# does not specialise V there, this compile does; its multipliers are runtime floats), OLMo-2-1124-7B, SmolLM3-3B
# (its no-rope layers run the same kernels with the identity tables).
FAMILIES = {
    "SmolLM2-135M": dict(model_type="llama", d=576, H=9, Hk=3, hd=64, I=1536, V=49152, act="silu"),
    "Llama-3.1-8B": dict(model_type="llama", d=4096, H=32, Hk=8, hd=128, I=14336, V=128256, act="silu"),
    "Qwen3-4B": dict(model_type="qwen3", d=2560, H=32, Hk=8, hd=128, I=9728, V=151936, act="silu", qk_norm=True),
    "Gemma-2-2B": dict(model_type="gemma2", d=2304, H=8, Hk=4, hd=256, I=9216, V=256000, act="gelu_pytorch_tanh",
                       gemma=True, attn_cap=50.0, softcap=30.0, window=4096),
    "Gemma-3-270M": dict(model_type="gemma3_text", d=640, H=4, Hk=1, hd=256, I=2048, V=262144,
                         act="gelu_pytorch_tanh", gemma=True, qk_norm=True, window=512),
    "Qwen2.5-7B": dict(model_type="qwen2", d=3584, H=28, Hk=4, hd=128, I=18944, V=152064, act="silu", bias="qkv"),
    "Mistral-7B-v0.3": dict(model_type="mistral", d=4096, H=32, Hk=8, hd=128, I=14336, V=32768, act="silu"),
    "Ministral-8B": dict(model_type="ministral", d=4096, H=32, Hk=8, hd=128, I=12288, V=131072, act="silu",
                         window=32768),
    "Phi-3-mini": dict(model_type="phi3", d=3072, H=32, Hk=32, hd=96, I=8192, V=32064, act="silu", window=2047),
    "Phi-4-mini": dict(model_type="phi3", d=3072, H=24, Hk=8, hd=128, I=8192, V=200064, act="silu", rot=96,
                       window=262144),
    "Granite-3.1-2B": dict(model_type="granite", d=2048, H=32, Hk=8, hd=64, I=8192, V=49155, act="silu"),
    "OLMo-2-7B": dict(model_type="olmo2", d=4096, H=32, Hk=32, hd=128, I=11008, V=100352, act="silu",
                      qk_norm="whole", norms="post"),
    "SmolLM3-3B": dict(model_type="smollm3", d=2048, H=16, Hk=4, hd=128, I=11008, V=128256, act="silu"),
    "tests": dict(model_type="llama", d=72, H=3, Hk=1, hd=24, I=40, V=500, act="silu", bias=True, aligned=False),
}
NS = (8, 16)  # directions a step: B = N + 1 batch rows (forward estimator), 2 N + 1 (central)
LENGTHS = (256, 600, 2100)  # prompt tokens (the GPU suite's lengths); span positions P = L / 4
SUITE_LENGTHS = (600,)  # the suite's (suite_cases): of the configurations, only the proxy's tile follows L
DTYPES = ("float32", "bfloat16")  # the model dtypes of the plain forward (the difference form's are fixed)


@dataclass(frozen=True)
class Case:
    """One launch configuration of one kernel (a SPECS entry of _aot) to compile: what chose it, the pointer dtypes
    that differ from SPECS, the constexprs (the configuration's blocks and the flags), the compile options (warps,
    stages, fp fusion), and whether the JIT specialises the shape's integers as multiples of 16."""

    spec: str
    what: str
    signature: tuple = ()
    constexprs: tuple = ()
    options: tuple = ()
    aligned: bool = True
    flags: tuple = field(default=(), compare=False)  # the constexprs that are flags, not the configuration's

    def key(self, arch: int) -> str:
        """The cache key: the kernel's sources and _aot's (its SPECS and ALIGNED_INTS shape the compile), this case,
        the arch and Triton's version."""
        body = json.dumps([self.spec, self.signature, self.constexprs, self.options, self.aligned, arch,
                           triton.__version__, _source_digest(_aot.SPECS[self.spec][0][0]), _source_digest("_aot")])
        return hashlib.sha256(body.encode()).hexdigest()[:32]


def _case(spec: str, what: str, cfg: dict, flags: dict, dtype: str | None = None, aligned: bool = True) -> Case:
    """A Case of the launch configuration cfg (a configuration function's dict) with the kernel's flags; dtype: the
    pointer type of the activations ('*fp32' / '*bf16') where the kernel runs in the model dtype."""
    consts = set(_aot.SPECS[spec][2])
    sig = tuple(sorted((p, dtype) for p in _ACTIVATIONS.get(spec, ()))) if dtype else ()
    blocks = {k: v for k, v in cfg.items() if k in consts}
    options = {**_TRITON_DEFAULTS, **{k: v for k, v in cfg.items() if k not in consts}}
    return Case(spec, what, sig, tuple(sorted({**flags, **blocks}.items())), tuple(sorted(options.items())), aligned,
                tuple(sorted(flags)))


_FIELDS = {"model_type", "d", "H", "Hk", "hd", "I", "V", "act", "qk_norm", "gemma", "norms", "attn_cap", "softcap",
           "window", "bias", "rot", "aligned"}
# boolean flags that choose between two forms of the code rather than add code: decisions() never merges them
_ALTERNATIVES = {"Q_WHOLE", "K_WHOLE"}
_DTYPE_FREE = {"residual_norm", "qk_rope", "gated", "softcap"}  # configuration functions that take no dtype
# the options a launch takes from Triton (3.6's CUDAOptions) where its configuration names none (not SPECS' own)
_TRITON_DEFAULTS = {"num_stages": 3, "enable_fp_fusion": True}
# the pointers of the plain kernels that hold the model-dtype activations (the rest: SPECS' types)
_ACTIVATIONS = {
    "residual_norm": ("x_ptr", "y_ptr", "x_out_ptr", "h_ptr"),
    "qk_rope": ("q_ptr", "k_ptr", "v_ptr", "k_out_ptr", "v_out_ptr", "cos_ptr", "sin_ptr"),
    "gated": ("gate_ptr", "up_ptr", "out_ptr"),
    "softcap": ("x_ptr",),
    "attention": ("q_ptr", "k_ptr", "v_ptr", "kp_ptr", "vp_ptr", "o_ptr"),
    "lse_partial": ("h_ptr", "w_ptr"),
}


def family_cases(name: str, dtypes=DTYPES, lengths=LENGTHS) -> list[Case]:
    """Every launcher's configuration, as its configuration function chooses it on a GPU, at FAMILIES[name]'s
    shapes (each N of NS, both estimators, and L of `lengths`) and flags, the plain kernels in each model dtype of
    `dtypes` (float32 first)."""
    # the modules (the package's names gated, rope_rows, ... are the launchers)
    (attention, best, bookkeep, fp8_rows, gated, gated_rows, norm_rows, perturb, proxy, randn, rms_norm, rope,
     rope_rows, softcap, span_logprobs, split_bf16, zo_update) = (
        importlib.import_module(f"{__package__}.{m}") for m in (
            "attention", "best", "bookkeep", "fp8_rows", "gated", "gated_rows", "norm_rows", "perturb", "proxy",
            "randn", "rms_norm", "rope", "rope_rows", "softcap", "span_logprobs", "split_bf16", "zo_update"))
    f = {"qk_norm": False, "gemma": False, "norms": "pre", "attn_cap": None, "softcap": None, "window": None,
         "bias": False, "rot": None, "aligned": True, **FAMILIES[name]}
    if set(f) - _FIELDS:
        raise ValueError(f"FAMILIES[{name!r}] has fields {sorted(set(f) - _FIELDS)} that family_cases does not read")
    d, H, Hk, hd, I, al = f["d"], f["H"], f["Hk"], f["hd"], f["I"], f["aligned"]
    if f["rot"] is not None and (not 0 < f["rot"] < hd or f["rot"] % 2 or (al and f["rot"] % 16)):
        raise ValueError(f"FAMILIES[{name!r}]: rot {f['rot']} is not an even part of head {hd}"
                         + (" that is a multiple of 16 (aligned)" if al else ""))
    act = gated.ACT_CODES[f["act"]]
    attn_flags = dict(HAS_SOFTCAP=f["attn_cap"] is not None, HAS_WINDOW=f["window"] is not None)
    post = f["norms"] == "post"
    f32_norms, has_post, ws = f["gemma"] or post, f["gemma"] or post, (True, False) if post else (True,)
    whole = dict(Q_WHOLE=f["qk_norm"] == "whole" and H > 1, K_WHOLE=f["qk_norm"] == "whole" and Hk > 1)
    qk = dict(HAS_NORM=bool(f["qk_norm"]), **whole)
    qkv_bias, out_bias = f["bias"] in (True, "qkv"), f["bias"] is True
    out = []
    for dt in dtypes:
        p = {"float32": "*fp32", "bfloat16": "*bf16"}[dt]
        tag = f"{name} {dt}"
        out += [_case("residual_norm", f"{tag}: residual_norm_config(d={d})", rms_norm.residual_norm_config(d, False),
                      dict(HAS_Y=True, HAS_POST=has_post, HAS_W=w, GEMMA=f32_norms), p, al) for w in ws]
        out += [
            _case("qk_rope", f"{tag}: qk_rope_config(H={H}, Hk={Hk}, hd={hd})", rope.qk_rope_config(H, Hk, hd, False),
                  dict(**qk, GEMMA=f32_norms), p, al),
            _case("gated", f"{tag}: gated_config(n={I})", gated.gated_config(I, False), dict(ACT=act), p, al),
        ]
        for prec in attention.PRECISIONS if dt == "float32" else ("ieee",):  # a float32 q's: each precision's tiles
            out.append(_case("attention", f"{tag}: prefix_attention_config(hd={hd}, {dt}, precision={prec!r})",
                             attention.prefix_attention_config(hd, _torch_dtype(dt), interp=False, precision=prec),
                             dict(HAS_PREFIX=True, UPCAST=False, PRECISION=prec, **attn_flags), p, al))
        if f["softcap"] is not None:
            out.append(_case("softcap", f"{tag}: softcap_config()", softcap.softcap_config(False), {}, p, al))
        for L in lengths:
            M = L // 4
            out.append(_case("lse_partial", f"{tag}: span_logprobs_config(M={M}, d={d})",
                             span_logprobs.span_logprobs_config(M, d, _torch_dtype(dt), False),
                             dict(HAS_SOFTCAP=f["softcap"] is not None, UPCAST=False, PRECISION="ieee"), p, al))
    out.append(_case("lse_combine", f"{name}: lse_combine_config()", span_logprobs.lse_combine_config(False), {},
                     aligned=al))
    if "bfloat16" in dtypes:  # a bf16 model's difference form: its reference's bf16 pieces, its FP8 differences
        for L in lengths:
            n = L * max(d, H * hd, I)  # the value rows' largest product input (the reference pass takes L rows)
            out.append(_case("split_bf16", f"{name} L {L}: split_config(n={n})", split_bf16.split_config(n, False),
                             {}, aligned=al))
        for k in dict.fromkeys((d, H * hd, I)):  # the inputs of qkv / gate_up, o, down
            out.append(_case("fp8_rows", f"{name}: fp8_rows_config(k={k})", fp8_rows.fp8_rows_config(k, False), {},
                             aligned=al))
    for N, central in ((N, central) for N in NS for central in (False, True)):
        B = 2 * N + 1 if central else N + 1
        for L in lengths:
            R, P, tag = B * L, L // 4, f"{name} B {B} L {L}"
            out += [_case("norm_rows", f"{tag}: norm_rows_config(R={R}, d={d})",
                          norm_rows.norm_rows_config(R, d, False),
                          dict(HAS_Y=True, HAS_BIAS=out_bias, HAS_POST=has_post, HAS_W=w, Y_REF=True, H_REF=True),
                          aligned=al) for w in ws]
            out += [
                _case("rope_rows", f"{tag}: rope_rows_config(R={R}, H={H}, Hk={Hk}, hd={hd})",
                      rope_rows.rope_rows_config(R, H, Hk, hd, False),
                      dict(HAS_BIAS=qkv_bias, HAS_REF=True, **qk), aligned=al),
                _case("gated_rows", f"{tag}: gated_rows_config(R={R}, I={I})",
                      gated_rows.gated_rows_config(R, I, False),
                      dict(ACT=act, HAS_BIAS=out_bias, Y_REF=True, A_REF=True), aligned=al),
                *(_case("attention_rows", f"{tag}: attention_rows_config(hd={hd}, precision={prec!r})",
                        attention.attention_rows_config(hd, interp=False, precision=prec),
                        dict(PREFIX_CAUSAL=False, HAS_REF=True, PRECISION=prec, **attn_flags), aligned=al)
                  for prec in attention.PRECISIONS),
                _case("proxy", f"{tag}: proxy_config(W={P})", proxy.proxy_config(P, False), {}, aligned=al),
                _case("zo_step", f"{tag}: zo_step_config(d={d})", zo_update.zo_step_config(d, interp=False),
                      dict(CENTRAL=central, NORMALIZE=False, PROJECT=True, STEP_PTR=True, END_PTR=True, HI_END=True),
                      aligned=al),
                _case("zo_project", f"{tag}: zo_project_config(L={L})", zo_update.zo_project_config(
                    L, zo_update.zo_step_config(d, interp=False)["BLOCK_D"], False), dict(END_PTR=True), aligned=al),
                _case("bookkeep_state", f"{tag}: bookkeep_state_config(N={N})",
                      bookkeep.bookkeep_state_config(N, False),
                      dict(CENTRAL=central, HAS_SNR=True, HAS_PATIENCE=True, HAS_MARGIN=True), aligned=al),
            ]
            for ref in (True, False):  # the span head of a pass, with the value rows' reference logits or without
                out.append(_case("lse_rows_partial", f"{tag}: span_logprobs_rows_config(B={B}, P={P}, Vb=1, "
                                 f"has_ref={ref})",
                                 span_logprobs.span_logprobs_rows_config(B, P, d, 1, ref, interp=False),
                                 dict(HAS_SOFTCAP=f["softcap"] is not None, HAS_REF=ref, UPCAST=False), aligned=al))
    flat = dict(STEP_PTR=True, END_PTR=True)
    out += [
        _case("perturb", f"{name}: perturb_config()", perturb.perturb_config(interp=False), dict(CENTRAL=True, **flat),
              aligned=al),  # CENTRAL: the code of both estimators
        _case("randn", f"{name}: randn_config()", randn.randn_config(False), {}, aligned=al),
        _case("best_copy", f"{name}: copy_config()", best.copy_config(False), {}, aligned=al),
        _case("bookkeep_copy", f"{name}: copy_config()", best.copy_config(False), {}, aligned=al),
        _case("best_state", f"{name}: best_state_config()", best.best_state_config(False), {}, aligned=al),
    ]
    return list(dict.fromkeys(out))  # one a distinct case, in order


def decisions(cases) -> list[Case]:
    """One case a distinct launch decision: the cases of one kernel with the same configuration, dtypes (any, for
    the kernels whose configuration does not depend on them: _DTYPE_FREE), alignment, non-boolean flags and
    _ALTERNATIVES, as the first of them (float32 before bf16) with every other boolean flag that any of them sets
    (the most code)."""
    groups: dict = {}
    for c in cases:
        flags = dict(c.constexprs)
        fixed = tuple((k, v) for k, v in c.constexprs
                      if k not in c.flags or not isinstance(v, bool) or k in _ALTERNATIVES)
        key = (c.spec, () if c.spec in _DTYPE_FREE else c.signature, fixed, c.options, c.aligned)
        if key in groups:
            have = groups[key]
            merged = {k: v or flags[k] if k in c.flags and isinstance(v, bool) else v for k, v in have.constexprs}
            groups[key] = Case(have.spec, have.what, have.signature, tuple(sorted(merged.items())), have.options,
                               have.aligned, have.flags)
        else:
            groups[key] = c
    return list(groups.values())


def suite_cases() -> list[Case]:
    """The suite's set (tests/test_sm90_configs.py): decisions() over every family at SUITE_LENGTHS."""
    return decisions([c for name in FAMILIES for c in family_cases(name, lengths=SUITE_LENGTHS)])


def problems(case: Case, result: dict, arch: int = 90) -> list[str]:
    """What is wrong with a case's compile for sm_<arch>: an error, shared memory over the block's LIMITS (and over
    sm_80's: an A100 runs it too), a block that is not a power of two, and on sm_90 (the H100 / H200 the product is
    tuned for) a spill (a stack frame); [] when none. (An sm_80 compile's spills are shown by the sweep, not refused:
    at the tests' odd shapes ptxas spills 8 - 32 B there, at no family's.)"""
    if result.get("error"):
        return [f"{case.what}: {case.spec} does not compile for sm_{arch}: {result['error']}"]
    out = []
    for lim_arch, limit in LIMITS.items():
        if lim_arch <= arch and result["shared"] > limit:
            out.append(f"{case.what}: {case.spec} needs {result['shared']:,} B of shared memory, over sm_{lim_arch}'s "
                       f"{limit:,} B")
    if result["stack"] and arch >= 90:
        out.append(f"{case.what}: {case.spec} spills ({result['stack']} B stack frame, {result['regs']} registers)")
    odd = [f"{k}={v}" for k, v in case.constexprs if k.startswith("BLOCK") and v & (v - 1)]
    if odd:
        out.append(f"{case.what}: {case.spec} has blocks that are not powers of two: {', '.join(odd)}")
    return out


def cache_dir() -> Path:
    """Where compile results are kept: SICL_COMPILE_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/sicl_fast/sm_compile."""
    if os.environ.get("SICL_COMPILE_CACHE"):
        return Path(os.environ["SICL_COMPILE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sicl_fast" / "sm_compile"


def compile_cases(cases, arch: int = 90, cache: Path | None = None, jobs: int = 1, timeout: float | None = None
                  ) -> dict:
    """{case: result} for each case compiled for sm_<arch>: from the cache where it holds the case's key, the others
    compiled in `jobs` fresh interpreters (TRITON_INTERPRET=0, an empty Triton cache), each result written to the
    cache as soon as it is made. A case whose compile did not finish within `timeout` seconds gets
    {"error": "not compiled: ..."}."""
    cache = Path(cache or cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    cases = list(dict.fromkeys(cases))
    todo = [c for c in cases if _cached(cache / f"{c.key(arch)}.json") is None]
    if todo:
        _compile_missing(todo, arch, cache, jobs, timeout)
    out = {}
    for c in cases:
        out[c] = _cached(cache / f"{c.key(arch)}.json") or {"error": "not compiled: the compile ran out of time or "
                                                                      "its process failed"}
    return out


def _cached(path: Path) -> dict | None:
    """The result a cache entry holds, or None: no entry, or one that does not read as a result (cut short, edited,
    not JSON): it is compiled again and replaced, not a traceback of every later check."""
    try:
        result = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(result, dict) and "error" in result and (
        result["error"] is not None or all(isinstance(result.get(k), int) for k in ("shared", "regs", "stack")))
    return result if ok else None


def _compile_missing(todo, arch: int, cache: Path, jobs: int, timeout: float | None) -> None:
    """Compile `todo` in min(jobs, len(todo)) child interpreters, each a share of the cases (python -m this module)."""
    shares = [todo[i::max(1, min(jobs, len(todo)))] for i in range(max(1, min(jobs, len(todo))))]
    with tempfile.TemporaryDirectory() as triton_cache:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": triton_cache}
        procs = []
        for share in shares:
            payload = json.dumps([[c.spec, c.what, dict(c.signature), dict(c.constexprs), dict(c.options), c.aligned,
                                   c.key(arch)] for c in share])
            p = subprocess.Popen([sys.executable, "-m", __name__, str(cache), str(arch)], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append((p, payload))
        for p, payload in procs:
            try:
                p.communicate(payload, timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _source_digest(module: str, _memo: dict = {}) -> str:  # noqa: B006 - a per-process memo of file digests
    """sha256 of the kernel module's source and of what it imports: this package's modules (recursively) and
    sicl_fast's (their constants may be baked into the kernel: the stop reasons of bookkeep)."""
    if module not in _memo:
        seen, todo, h = set(), [KERNELS / f"{module}.py"], hashlib.sha256()
        while todo:
            path = todo.pop()
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            text = path.read_text()
            todo += [KERNELS / f"{m}.py" for m in re.findall(r"^from \.(\w+) import", text, re.M)]
            if path.parent == KERNELS:
                todo += [SICL.joinpath(*m.split(".")).with_suffix(".py")
                         for m in re.findall(r"^from sicl_fast\.([\w.]+) import", text, re.M)]
        for path in sorted(seen):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        _memo[module] = h.hexdigest()
    return _memo[module]


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack frame bytes) of a cubin, from the cuobjdump that ships with triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    got = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    return int(got["REG"]), int(got["STACK"])


def _compile_one(spec, signature, constexprs, options, aligned, arch) -> dict:
    """The result of one case (module docstring), compiled in this interpreter (the kernels as JIT functions)."""
    t0 = time.perf_counter()
    try:
        k = _aot.compile_kernel(spec, arch, signature, constexprs, options, aligned=aligned)
    except Exception as exc:  # a compile error of any kind is the result
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return {"error": f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]}
    regs, stack = _resources(k.asm["cubin"])
    return {"shared": int(k.metadata.shared), "regs": regs, "stack": stack,
            "float_ops": dict(_aot.float_ops(k.asm["ptx"])), "tensor_ops": dict(_aot.tensor_core_ops(k.asm["ptx"])),
            "seconds": round(time.perf_counter() - t0, 2), "error": None}


if __name__ == "__main__":  # python -m sicl_fast.kernels._configs CACHE ARCH < cases (JSON): the child interpreter
    cache_path, arch_n = Path(sys.argv[1]), int(sys.argv[2])
    for spec_, _what, sig_, consts_, opts_, aligned_, key_ in json.load(sys.stdin):
        result = _compile_one(spec_, sig_, consts_, opts_, aligned_, arch_n)
        tmp = cache_path / f".{key_}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, cache_path / f"{key_}.json")
