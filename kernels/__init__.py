"""Triton kernels of sicl_fast, installed as `sicl_fast.kernels` (sicl_fast.ops.triton_ops uses them; the
implementation is chosen once, by the run plan, sicl_fast.plan).

One op a file, each a @triton.jit kernel plus a launcher that checks shapes / dtypes / devices and launches through
_utils.launch (the warps from the block size; on CUDA, on the tensors' own device):

    span_logprobs(hidden [B, P, d], weight [V, d], targets [P], softcap=None) -> [B, P] float32
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q) -> ProxyOut(f, C, R, G, c)
    proxy_planned(logprobs [B, P], plan: sicl_fast.proxy.ProxyPlan) -> ProxyOut   (no checks, no host reads)
    perturb(X [L, d] float32, step, spec: StepSpec) -> [B, b, d] float32
    zo_update(X, X0, f [B], step, spec) -> (X_new [L, d] float32, fired int32 [1] on the device)
    track_best(f, X, BestState) -> BestState            best-so-far X / f / patience on the device
    advance(st, f, fired, cfg)                          the static step's bookkeeping on its StepState
                                                        (sicl_fast.step_state)
    randn(seed, step, num, rows, d) -> [num, rows, d]   the directions U (= sicl_fast.rng.directions, bitwise)
    cached_tensors() -> list                            device constants the launchers cache (a graph keeps them)

The decoder's fused kernels (references in sicl_fast.models.elementwise and sicl_fast.models.attention):

    residual_norm(x, y, post_w, w, eps, gemma) -> (x + y', rms_norm(x + y', w))   RMSNorm + residual
    qk_rope(q, k, v, cos, sin, q_norm, k_norm, eps, gemma, k_out, v_out)           rotary (q / k norms) in place
    gated(gate, up, act_name) -> act(gate) * up                                    SwiGLU / GeGLU
    softcap_(x, cap)                                                               logit soft-cap in place
    prefix_attention(q, k, v, prefix, pos0, window, scale, softcap) -> o           shared-prefix attention
    diff_rows, add_rows, gated_diff                      the difference products' epilogues (models/diff.py)

Kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from ._utils import interpreting
from .best import BestState, track_best
from .perturb import perturb
from .proxy import proxy, proxy_planned
from .randn import randn
from .span_logprobs import span_logprobs
from .zo_update import cached_tensors, zo_update
from .advance import advance
from .attention import prefix_attention
from .diff_epilogues import add_rows, diff_rows, gated_diff
from .gated import gated
from .rms_norm import residual_norm
from .rope import qk_rope
from .softcap import softcap_

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
    "advance",
    "diff_rows",
    "add_rows",
    "gated_diff",
    "residual_norm",
    "qk_rope",
    "gated",
    "softcap_",
    "prefix_attention",
]
