"""Triton kernels of sicl_fast, installed as `sicl_fast.kernels` (sicl_fast.ops.triton_ops uses them; the
implementation is chosen once, by the run plan, sicl_fast.run.plan).

One op a file, each a @triton.jit kernel plus a launcher that checks shapes / dtypes / devices and launches through
_utils.launch (on CUDA, on the tensors' own device) with the configuration its kernel's function beside it chooses
(blocks, warps, stages: _utils.launch_config; compiled for sm_90 at every family's shapes by _configs.py):

    span_logprobs(hidden [B, P, d], weight [V, d], targets [P], softcap=None) -> [B, P] float32
    span_logprobs_rows(hidden [B, P, d] bf16, weight [V, d] bf16, targets [P], anchor [B], softcap=None, z_ref=None,
                       value_slot=None)                 the span head of a difference-form pass -> [B, P] float32
                                                        (z_ref [Vb, P, V]: the value rows' reference logits)
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q) -> ProxyOut(f, C, R, G, c)
    proxy_planned(logprobs [B, P], plan: ProxyPlan) -> ProxyOut   (no checks, no host reads)
    perturb(X [L, d] float32, step, spec: StepSpec) -> [B, b, d] float32
    zo_update(X, X0, f [B], step, spec) -> (X_new [L, d] float32, fired int32 [1] on the device)
    track_best(f, X, BestState) -> BestState            best-so-far X / f / patience on the device
    bookkeep(st, f, fired, cfg)                         the static step's bookkeeping on its StepState
                                                        (sicl_fast.step.step_state)
    randn(seed, step, num, rows, d) -> [num, rows, d]   the directions U (= step.rng.directions, bitwise)
    cached_tensors() -> list                            device constants the launchers cache (a graph keeps them)

The decoder's fused kernels (references in sicl_fast.models.elementwise and sicl_fast.models.attention):

    residual_norm(x, y, post_w, w, eps, gemma) -> (x + y', rms_norm(x + y', w))   RMSNorm + residual
    qk_rope(q, k, v, cos, sin, q_norm, k_norm, eps, gemma, k_out, v_out)           rotary (q / k norms) in place
    gated(gate, up, act_name) -> act(gate) * up                                    SwiGLU / GeGLU
    softcap_(x, cap)                                                               logit soft-cap in place
    prefix_attention(q, k, v, prefix, pos0, window, scale, softcap) -> o           shared-prefix attention

and the difference form's (sicl_fast.models.rows: float32 rows, every product's input and output in bf16 values'
changes from their float32 reference (optional: the *_ref [V, k] arguments, None: the values as they are) and
differences; references there and in sicl_fast.models.attention), one launch each:

    norm_rows(x, y, bias, post_w, w, eps, gemma, rows, y_ref, h_ref) -> (x', h)   residual + RMSNorm
    rope_rows(qkv, bias, rows, cos, sin, q_norm, k_norm, eps, gemma, H, Hk, k_out, v_out, qkv_ref) -> q
                                                                                   q / k norms + rotary, K/V out
    gated_rows(y, bias, act_name, rows, y_ref, a_ref) -> a                         SwiGLU / GeGLU
    attention_rows(q, k, v, rows, prefix, scale, softcap, window, o_ref) -> o     lead + batch rows, o in the form
    split_bf16(x, pieces) -> [pieces, n, k] bf16                                   float32 rows as bf16 pieces (the
                                                                                   reference pass's bf16 products)
    fp8_rows(x) -> (q float8 e4m3, scale [M, 1])                                   FP8 differences, a scale a row

Kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from ._utils import interpreting
from .best import BestState, track_best
from .perturb import perturb
from .proxy import proxy, proxy_planned
from .randn import randn
from .span_logprobs import span_logprobs, span_logprobs_rows
from .zo_update import cached_tensors, zo_update
from .bookkeep import bookkeep
from .attention import attention_rows, prefix_attention
from .fp8_rows import fp8_rows
from .gated import gated
from .gated_rows import gated_rows
from .norm_rows import norm_rows
from .rms_norm import residual_norm
from .rope import qk_rope
from .rope_rows import rope_rows
from .softcap import softcap_
from .split_bf16 import split_bf16

__all__ = [
    "span_logprobs",
    "proxy",
    "proxy_planned",
    "perturb",
    "zo_update",
    "track_best",
    "BestState",
    "randn",
    "interpreting",
    "cached_tensors",
    "bookkeep",
    "span_logprobs_rows",
    "norm_rows",
    "rope_rows",
    "gated_rows",
    "attention_rows",
    "residual_norm",
    "qk_rope",
    "gated",
    "softcap_",
    "prefix_attention",
    "split_bf16",

    "fp8_rows",
]
