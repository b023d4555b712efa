"""Ahead-of-time compilation of the kernels for an NVIDIA target, without a GPU (ptxas ships with triton).

Used through kernels/_configs.py (its child interpreters): tests/test_sm90_configs.py (shared memory, spills, the
tensor cores), tests/test_kernel_rng.py (the RNG kernels' PTX must contain no FMA and no approximate division /
sqrt, or the GPU would not reproduce step.rng bit for bit) and `bench/gpu_kernels.py --compile-only`.

    compile_kernel(name, arch=90, **overrides) -> triton CompiledKernel   (kernels imported as JIT functions; with
                                                                         aligned=True as the JIT specialises them)
    spec_mismatches() -> list of str: where SPECS disagrees with the kernels' own parameters (tested empty)
    float_ops(ptx) -> Counter of the float32 arithmetic instructions in a PTX listing
    tensor_core_ops(ptx) -> Counter of its tensor-core instructions (mma.sync, wgmma.mma_async) by operand type

Under TRITON_INTERPRET=1 the kernels of this process are interpreted functions, which cannot be compiled (and
so are triton.language's own @jit helpers, such as tl.randint4x, made when triton is first imported), so
kernels/_configs.py compiles in fresh interpreters with TRITON_INTERPRET=0: the same installed package, loaded the
normal way, whatever this process imported before.
"""
from __future__ import annotations

import importlib
import inspect
import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sicl_fast.errors import SiclError

from . import _utils

_F, _D, _I, _H = "*fp32", "*fp64", "*i32", "*bf16"

_W = _utils.num_warps_for  # the warps launch() gives a program of that many elements (tiled kernels: their own)

# name -> ((module, kernel), signature, constexprs, options): the options as the launcher runs the kernel
SPECS = {
    "randn": (("randn", "_randn_kernel"), {"out_ptr": _F, "seed64": "i64", "n": "i32"}, {"BLOCK": 1024},
              {"num_warps": 4, "enable_fp_fusion": False}),
    "perturb": (("perturb", "_perturb_kernel"),
                {"x_ptr": _F, "out_ptr": _F, "seed64": "i64", "step_ptr": "*i64", "end_ptr": "*i64", "n": "i32",
                 "d": "i32", "a": "i32", "b": "i32", "mu": "fp32"},
                {"CENTRAL": True, "STEP_PTR": True, "END_PTR": True, "BLOCK": 1024},
                {"num_warps": 4, "enable_fp_fusion": False}),
    "zo_step": (("zo_update", "_step_kernel"),
                {"x_ptr": _F, "x0_ptr": _F, "f_ptr": _F, "out_ptr": _F, "pdot_ptr": _D, "pxx_ptr": _D,
                 "px0_ptr": _D, "seed64": "i64", "step_ptr": "*i64", "end_ptr": "*i64", "N": "i32", "L": "i32",
                 "d": "i32", "a": "i32", "b": "i32", "lo": "i32", "hi": "i32", "mu": "fp32", "eta": "fp32",
                 "clip_norm": "fp32"},
                {"CENTRAL": False, "NORMALIZE": False, "PROJECT": True, "STEP_PTR": True, "END_PTR": True,
                 "HI_END": True, "BLOCK_D": 1024},
                {"num_warps": 4, "enable_fp_fusion": False}),
    "zo_project": (("zo_update", "_project_kernel"),
                   {"out_ptr": _F, "x0_ptr": _F, "pdot_ptr": _D, "pxx_ptr": _D, "px0_ptr": _D, "fired_ptr": _I,
                    "consts_ptr": _D, "end_ptr": "*i64", "L": "i32", "d": "i32", "lo": "i32"},
                   {"END_PTR": True, "BLOCK_L": 1024, "BLOCK_D": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
    "proxy": (("proxy", "_proxy_kernel"),
              {"lp_ptr": _F, "stride_b": "i32", "off_ptr": "*i64", "count_ptr": "*i64", "f_ptr": _F, "C_ptr": _F,
               "R_ptr": _F, "G_ptr": _F, "c_ptr": _F, "T": "i32", "alpha": "fp32", "beta": "fp32", "gamma": "fp32",
               "q": "fp32"},
              {"BLOCK_P": 512}, {"num_warps": 4}),
    "lse_partial": (("span_logprobs", "_lse_partial_kernel"),
                    {"h_ptr": "*bf16", "stride_hm": "i32", "w_ptr": "*bf16", "stride_wv": "i32", "tgt_ptr": "*i64",
                     "m_ptr": _F, "s_ptr": _F, "t_ptr": _F, "M": "i32", "P": "i32", "V": "i32", "d": "i32",
                     "v_per_split": "i32", "softcap": "fp32"},
                    {"HAS_SOFTCAP": True, "UPCAST": False, "PRECISION": "ieee", "BLOCK_M": 64, "BLOCK_V": 128,
                     "BLOCK_K": 128},
                    {"num_warps": 4, "num_stages": 3}),
    "lse_partial_f32": (("span_logprobs", "_lse_partial_kernel"),
                        {"h_ptr": _F, "stride_hm": "i32", "w_ptr": _F, "stride_wv": "i32", "tgt_ptr": "*i64",
                         "m_ptr": _F, "s_ptr": _F, "t_ptr": _F, "M": "i32", "P": "i32", "V": "i32", "d": "i32",
                         "v_per_split": "i32", "softcap": "fp32"},
                        {"HAS_SOFTCAP": False, "UPCAST": False, "PRECISION": "ieee", "BLOCK_M": 64, "BLOCK_V": 64,
                         "BLOCK_K": 32},
                        {"num_warps": 4, "num_stages": 3}),
    "lse_combine": (("span_logprobs", "_lse_combine_kernel"),
                    {"m_ptr": _F, "s_ptr": _F, "t_ptr": _F, "out_ptr": _F, "M": "i32", "SPLITS": "i32"},
                    {"BLOCK": 256}, {"num_warps": 4}),
    "best_copy": (("best", "_best_copy_kernel"),
                  {"f_ptr": _F, "best_f_ptr": _F, "x_ptr": _F, "best_x_ptr": _F, "n": "i32"}, {"BLOCK": 2048},
                  {"num_warps": _W(2048)}),
    "best_state": (("best", "_best_state_kernel"), {"f_ptr": _F, "best_f_ptr": _F, "counters_ptr": _I}, {},
                   {"num_warps": _W(1)}),
    # the decoder's fused kernels, at bf16 and Gemma-like settings (the most code: every branch on)
    "residual_norm": (("rms_norm", "_residual_norm_kernel"),
                      {"x_ptr": _H, "y_ptr": _H, "post_w_ptr": _F, "w_ptr": _F, "x_out_ptr": _H, "h_ptr": _H,
                       "d": "i32", "eps": "fp32", "y_scale": "fp32"},
                      {"HAS_Y": True, "HAS_POST": True, "HAS_W": True, "GEMMA": True, "BLOCK": 4096}, {"num_warps": 8}),
    "qk_rope": (("rope", "_qk_rope_kernel"),
                {"q_ptr": _H, "k_ptr": _H, "v_ptr": _H, "k_out_ptr": _H, "v_out_ptr": _H, "cos_ptr": _H,
                 "sin_ptr": _H, "qn_ptr": _F, "kn_ptr": _F, "stride_q": "i32", "stride_k": "i32", "stride_v": "i32",
                 "stride_ko": "i32", "stride_vo": "i32", "stride_cs": "i32", "n_rows": "i32", "T": "i32", "H": "i32",
                 "Hk": "i32", "hd": "i32", "rot": "i32", "eps": "fp32"},
                {"HAS_NORM": True, "Q_WHOLE": False, "K_WHOLE": False, "GEMMA": True, "BLOCK_R": 1, "BLOCK_H": 8,
                 "BLOCK_HK": 4, "BLOCK_D": 256},
                {"num_warps": _W(1 * 8 * 256), "enable_fp_fusion": False}),
    "gated": (("gated", "_gated_kernel"),
              {"gate_ptr": _H, "up_ptr": _H, "out_ptr": _H, "n_cols": "i32", "stride_g": "i32", "stride_u": "i32"},
              {"ACT": 1, "BLOCK": 1024}, {"num_warps": 4}),
    "softcap": (("softcap", "_softcap_kernel"), {"x_ptr": _F, "n": "i32", "cap": "fp32"}, {"BLOCK": 1024},
                {"num_warps": 4}),
    "attention": (("attention", "_prefix_attention_kernel"),
                  {**{p: _H for p in ("q_ptr", "k_ptr", "v_ptr", "kp_ptr", "vp_ptr", "o_ptr")},
                   **{p: "i32" for p in ("sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h",
                                         "skp_t", "skp_h", "svp_t", "svp_h", "so_b", "so_t", "so_h", "T", "a", "H",
                                         "G", "hd", "pos0", "window")},
                   "scale": "fp32", "cap": "fp32"},
                  {"HAS_PREFIX": True, "HAS_SOFTCAP": True, "HAS_WINDOW": True, "UPCAST": False,
                   "PRECISION": "ieee", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 256, "CHUNK_D": 64},
                  {"num_warps": 4, "num_stages": 2}),
    "bookkeep_state": (("bookkeep", "_bookkeep_state_kernel"),
                      {"f_ptr": _F, "params_ptr": _D, "s_ptr": "*i64", "steps_run_ptr": "*i64", "reason_ptr": "*i64",
                       "low_snr_ptr": "*i64", "proj_ptr": "*i64", "hist_ptr": _F, "best_f_ptr": _F,
                       "counters_ptr": _I, "anchor_ptr": _F, "fired_ptr": _I, "flags_ptr": _I, "N": "i32",
                       "mu": "fp32", "patience": "i32", "max_steps": "i32"},
                      {"CENTRAL": True, "HAS_SNR": True, "HAS_PATIENCE": True, "HAS_MARGIN": True, "BLOCK_N": 64},
                      {"num_warps": _W(64)}),
    "bookkeep_copy": (("bookkeep", "_bookkeep_copy_kernel"),
                     {"flags_ptr": _I, "x_ptr": _F, "x_next_ptr": _F, "best_x_ptr": _F, "n": "i32"}, {"BLOCK": 2048},
                     {"num_warps": _W(2048)}),
    # the difference form's kernels (float32 rows, bf16 values and differences), every branch on
    "norm_rows": (("norm_rows", "_norm_rows_kernel"),
                  {"x_ptr": _F, "y_ptr": _H, "bias_ptr": _F, "post_w_ptr": _F, "w_ptr": _F, "anchor_ptr": "*i64",
                   "slot_ptr": "*i64", "y_ref_ptr": _F, "h_ref_ptr": _F, "x_out_ptr": _F, "h_ptr": _H, "R": "i32",
                   "lead": "i32", "B": "i32", "T": "i32", "d": "i32", "s_yref": "i32", "s_href": "i32",
                   "eps": "fp32", "y_scale": "fp32"},
                  {"HAS_Y": True, "HAS_BIAS": True, "HAS_POST": True, "HAS_W": True, "Y_REF": True, "H_REF": True,
                   "BLOCK_R": 2, "BLOCK": 1024},
                  {"num_warps": _W(2 * 1024)}),
    "rope_rows": (("rope_rows", "_rope_rows_kernel"),
                  {"qkv_ptr": _H, "bias_ptr": _F, "anchor_ptr": "*i64", "slot_ptr": "*i64", "ref_ptr": _F,
                   "cos_ptr": _F, "sin_ptr": _F, "qn_ptr": _F, "kn_ptr": _F, "q_ptr": _F, "k_ptr": _F, "v_ptr": _F,
                   "R": "i32", "lead": "i32", "B": "i32", "T": "i32", "pos0": "i32", "H": "i32", "Hk": "i32",
                   "hd": "i32", "rot": "i32", "s_ref": "i32", "eps": "fp32"},
                  {"HAS_BIAS": True, "HAS_REF": True, "HAS_NORM": True, "Q_WHOLE": False, "K_WHOLE": False,
                   "BLOCK_R": 1, "BLOCK_H": 16, "BLOCK_HK": 4, "BLOCK_D": 64},
                  {"num_warps": _W(1 * 16 * 64)}),
    "gated_rows": (("gated_rows", "_gated_rows_kernel"),
                   {"y_ptr": _H, "bias_ptr": _F, "anchor_ptr": "*i64", "slot_ptr": "*i64", "y_ref_ptr": _F,
                    "a_ref_ptr": _F, "out_ptr": _H, "R": "i32", "lead": "i32", "B": "i32", "T": "i32", "I": "i32",
                    "s_yref": "i32", "s_aref": "i32"},
                   {"ACT": 1, "HAS_BIAS": True, "Y_REF": True, "A_REF": True, "BLOCK_R": 2, "BLOCK_C": 1024},
                   {"num_warps": _W(2 * 1024), "enable_fp_fusion": False}),
    "attention_rows": (("attention", "_attention_rows_kernel"),
                       {**{p: _F for p in ("q_ptr", "k_ptr", "v_ptr", "kp_ptr", "vp_ptr", "o_ref_ptr")},
                        "anchor_ptr": "*i64", "slot_ptr": "*i64", "o_ptr": _H,
                        **{p: "i32" for p in ("sq_r", "sk_r", "sv_r", "skp_t", "svp_t", "s_oref", "lead", "B", "T",
                                              "pos0", "a", "H", "G", "hd", "n_lead_tiles", "n_groups",
                                              "rows_per_group", "window")},
                        "scale": "fp32", "cap": "fp32"},
                       {"PREFIX_CAUSAL": False, "HAS_SOFTCAP": True, "HAS_WINDOW": True, "HAS_REF": True,
                        "PRECISION": "tf32x3", "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64, "CHUNK_D": 64},
                       {"num_warps": 8, "num_stages": 1}),
    "lse_rows_partial": (("span_logprobs", "_lse_rows_partial_kernel"),
                         {"h_ptr": _H, "stride_hb": "i32", "stride_hp": "i32", "w_ptr": _H, "stride_wv": "i32",
                          "tgt_ptr": "*i64", "anchor_ptr": "*i64", "z_ref_ptr": _F, "stride_zb": "i32",
                          "stride_zp": "i32", "slot_ptr": "*i64", "m_ptr": _F, "s_ptr": _F, "t_ptr": _F, "B": "i32",
                          "P": "i32", "V": "i32", "d": "i32", "per_tile": "i32", "v_per_split": "i32", "Vb": "i32",
                          "softcap": "fp32"},
                         {"HAS_SOFTCAP": True, "HAS_REF": True, "UPCAST": False, "BLOCK_M": 64, "BLOCK_MV": 8,
                          "BLOCK_V": 64, "BLOCK_K": 64},
                         {"num_warps": 8, "num_stages": 3}),
    "fp8_rows": (("fp8_rows", "_fp8_rows_kernel"), {"x_ptr": _H, "q_ptr": "*u8", "scale_ptr": _F, "k": "i32"},
                 {"BLOCK": 2048}, {"num_warps": _W(2048)}),
    "split_bf16": (("split_bf16", "_split_bf16_kernel"), {"x_ptr": _F, "out_ptr": _H, "N": "i32"},
                   {"PIECES": 3, "BLOCK": 1024}, {"num_warps": _W(1024)}),
}


# The integer arguments the JIT sees as multiples of 16 at real model shapes (d, V, head sizes, row strides), by
# kernel: with every pointer 16-byte aligned (torch's allocations), what compile_kernel(aligned=True) gives
# tt.divisibility 16, as triton's launcher specialises them (vectorised loads and fewer address registers: the
# register counts of the code that runs; the unspecialised compile is the one of odd shapes).
ALIGNED_INTS = {
    "residual_norm": ("d",),
    "qk_rope": ("stride_q", "stride_k", "stride_v", "stride_ko", "stride_vo", "stride_cs", "hd", "rot"),
    "gated": ("n_cols", "stride_g", "stride_u"),
    "attention": ("sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "skp_t", "skp_h", "svp_t",
                  "svp_h", "so_b", "so_t", "so_h", "hd"),
    "lse_partial": ("stride_hm", "stride_wv", "V", "d", "v_per_split"),
    "perturb": ("d",),
    "zo_step": ("d",),
    "norm_rows": ("d", "s_yref", "s_href"),
    "rope_rows": ("hd", "rot", "s_ref"),
    "gated_rows": ("I", "s_yref", "s_aref"),
    "attention_rows": ("sq_r", "sk_r", "sv_r", "skp_t", "svp_t", "s_oref", "hd"),
    "lse_rows_partial": ("stride_hb", "stride_hp", "stride_wv", "stride_zb", "stride_zp", "V", "d", "v_per_split"),
}


def _kernel(name: str):
    """The kernel object (JITFunction, or InterpretedFunction under TRITON_INTERPRET=1) a SPECS entry names."""
    mod, attr = SPECS[name][0]
    return getattr(importlib.import_module(f"{__package__}.{mod}"), attr)


def spec_mismatches() -> list[str]:
    """Where SPECS disagrees with the kernels: every parameter named once, constexprs exactly the parameters
    annotated tl.constexpr. Empty when they agree (a changed kernel signature shows up here, in a test)."""
    out = []
    for name, (_, sig, consts, _) in SPECS.items():
        params = inspect.signature(_kernel(name).fn).parameters
        want_const = {p for p, v in params.items() if "constexpr" in str(v.annotation)}
        if set(consts) != want_const:
            out.append(f"{name}: constexprs {sorted(consts)} != kernel's {sorted(want_const)}")
        if set(sig) != set(params) - want_const:
            out.append(f"{name}: signature {sorted(sig)} != kernel's {sorted(set(params) - want_const)}")
        if not set(ALIGNED_INTS.get(name, ())) <= {p for p in sig if sig[p] == "i32"}:
            out.append(f"{name}: ALIGNED_INTS names {sorted(set(ALIGNED_INTS[name]) - set(sig))}, not i32 arguments")
    return out


def compile_kernel(name: str, arch: int = 90, signature: dict | None = None, constexprs: dict | None = None,
                   options: dict | None = None, aligned: bool = False):
    """Compile one kernel of SPECS for CUDA sm_<arch> (no GPU needed). Overrides update the spec's dicts. aligned:
    every pointer and the kernel's ALIGNED_INTS given tt.divisibility 16, as the JIT specialises them at real shapes.
    Needs the kernels as JIT functions (TRITON_INTERPRET unset or 0 at import): kernels/_configs.compile_cases
    otherwise."""
    if _utils.interpreting():
        raise SiclError("compile_kernel needs the kernels as JIT functions; under TRITON_INTERPRET=1 use "
                        "kernels._configs.compile_cases (it compiles in separate interpreters)")
    _, sig, consts, opts = SPECS[name]
    fn = _kernel(name)
    sig = {**sig, **(signature or {})}
    consts = {**consts, **(constexprs or {})}
    opts = {**opts, **(options or {})}
    full_sig = {arg: "constexpr" if arg in consts else sig[arg] for arg in fn.arg_names}
    attrs = {}
    if aligned:
        ints = set(ALIGNED_INTS.get(name, ()))
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
                 if arg not in consts and (sig[arg].startswith("*") or arg in ints)}
    src = ASTSource(fn, full_sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def tensor_core_ops(ptx: str) -> Counter:
    """Counter of tensor-core instructions in a PTX listing, keyed by instruction, shape and operand type:
    'mma.sync m16n8k8 tf32' (sm_80's warp-level mma: a warp's), 'wgmma.mma_async m64n32k8 tf32' (sm_90's: a warp
    group's, four warps)."""
    got = Counter()
    for op, mods in re.findall(r"\b(mma\.sync|wgmma\.mma_async)((?:\.[a-z0-9]+)*)", ptx):
        shape = next((m for m in mods.split(".") if re.fullmatch(r"m\d+n\d+k\d+", m)), "?")
        kinds = [t for t in ("tf32", "bf16", "f16", "e4m3", "e5m2") if f".{t}" in mods]
        got[f"{op} {shape} {kinds[0] if kinds else '?'}"] += 1
    return got


def float_ops(ptx: str) -> Counter:
    """Counter of float32 arithmetic instructions (mul.rn.f32, fma.rn.f32, div.rn.f32, sqrt.approx.f32, ..., and
    cvt.rna.tf32.f32: tf32x3's rounding of an operand)."""
    return Counter(re.findall(r"\b(?:(?:add|sub|mul|fma|div|sqrt|rsqrt|rcp|ex2|lg2)(?:\.[a-z0-9]+)*\.f32|"
                              r"cvt\.rna\.tf32\.f32)\b", ptx))

