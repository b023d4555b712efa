"""Ahead-of-time compilation of the kernels for an NVIDIA target, without a GPU (ptxas ships with triton).

Used by tests (the RNG kernels' PTX must contain no FMA and no approximate division / sqrt, or the GPU would
not reproduce sicl_fast.rng bit for bit) and by `bench/gpu_kernels.py --compile-only` (registers, spills).

    compile_kernel(name, arch=90, **overrides) -> triton CompiledKernel
    float_ops(ptx) -> Counter of the float32 arithmetic instructions in a PTX listing
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_AOT_PACKAGE = "_sicl_fast_kernels_aot"


def _jit_package():
    """The kernels as real JITFunctions. Under TRITON_INTERPRET=1 the loaded package holds interpreted
    functions, which cannot be compiled: load a second copy of kernels/ with the interpreter switched off."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return sys.modules[__package__]
    if _AOT_PACKAGE in sys.modules:
        return sys.modules[_AOT_PACKAGE]
    init = Path(__file__).resolve().parent / "__init__.py"
    spec = importlib.util.spec_from_file_location(_AOT_PACKAGE, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    old = os.environ["TRITON_INTERPRET"]
    os.environ["TRITON_INTERPRET"] = "0"
    sys.modules[_AOT_PACKAGE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_AOT_PACKAGE]
        raise
    finally:
        os.environ["TRITON_INTERPRET"] = old
    return module


_F, _D, _I = "*fp32", "*fp64", "*i32"

# name -> ((module, kernel), signature, constexprs, options)
SPECS = {
    "randn": (("randn", "_randn_kernel"), {"out_ptr": _F, "seed64": "i64", "n": "i32"}, {"BLOCK": 1024},
              {"num_warps": 4, "enable_fp_fusion": False}),
    "perturb": (("perturb", "_perturb_kernel"),
                {"x_ptr": _F, "out_ptr": _F, "seed64": "i64", "n": "i32", "d": "i32", "a": "i32", "b": "i32",
                 "mu": "fp32"},
                {"CENTRAL": True, "BLOCK": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
    "zo_step": (("zo_update", "_step_kernel"),
                {"x_ptr": _F, "x0_ptr": _F, "f_ptr": _F, "out_ptr": _F, "pdot_ptr": _D, "pxx_ptr": _D,
                 "px0_ptr": _D, "seed64": "i64", "N": "i32", "L": "i32", "d": "i32", "a": "i32", "b": "i32",
                 "lo": "i32", "hi": "i32", "mu": "fp32", "eta": "fp32", "clip_norm": "fp32"},
                {"CENTRAL": False, "NORMALIZE": False, "PROJECT": True, "BLOCK_D": 1024},
                {"num_warps": 4, "enable_fp_fusion": False}),
    "zo_project": (("zo_update", "_project_kernel"),
                   {"out_ptr": _F, "x0_ptr": _F, "pdot_ptr": _D, "pxx_ptr": _D, "px0_ptr": _D, "fired_ptr": _I,
                    "consts_ptr": _D, "L": "i32", "d": "i32", "lo": "i32"},
                   {"BLOCK_L": 1024, "BLOCK_D": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
    "proxy": (("proxy", "_proxy_kernel"),
              {"lp_ptr": _F, "stride_b": "i32", "off_ptr": "*i64", "f_ptr": _F, "C_ptr": _F, "R_ptr": _F,
               "G_ptr": _F, "c_ptr": _F, "P": "i32", "T": "i32", "alpha": "fp32", "beta": "fp32", "gamma": "fp32",
               "rank": "fp32", "below": "i32", "above": "i32"},
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
                  {"num_warps": 4}),
    "best_state": (("best", "_best_state_kernel"), {"f_ptr": _F, "best_f_ptr": _F, "counters_ptr": _I}, {},
                   {"num_warps": 1}),
}


def compile_kernel(name: str, arch: int = 90, signature: dict | None = None, constexprs: dict | None = None,
                   options: dict | None = None):
    """Compile one kernel of SPECS for CUDA sm_<arch> (no GPU needed). Overrides update the spec's dicts."""
    (mod, attr), sig, consts, opts = SPECS[name]
    fn = getattr(sys.modules[_jit_package().__name__ + "." + mod], attr)
    sig = {**sig, **(signature or {})}
    consts = {**consts, **(constexprs or {})}
    opts = {**opts, **(options or {})}
    full_sig = {}
    for arg in fn.arg_names:
        full_sig[arg] = "constexpr" if arg in consts else sig[arg]
    src = ASTSource(fn, full_sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def float_ops(ptx: str) -> Counter:
    """Counter of float32 arithmetic instructions (mul.rn.f32, fma.rn.f32, div.rn.f32, sqrt.approx.f32, ...)."""
    return Counter(re.findall(r"\b(?:add|sub|mul|fma|div|sqrt|rsqrt|rcp|ex2|lg2)(?:\.[a-z0-9]+)*\.f32\b", ptx))
