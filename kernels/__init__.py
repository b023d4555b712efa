"""Triton kernels of sicl_fast, installed as `sicl_fast.kernels` (sicl_fast.fused decides when they are used).

One op a file, each a @triton.jit kernel plus a launcher that checks shapes / dtypes / devices:

    span_logprobs(hidden [B, P, d], weight [V, d], targets [P], softcap=None) -> [B, P] float32
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q) -> ProxyOut(f, C, R, G, c)
    perturb(X [L, d], seed, step, N, mu, a, b, estimator) -> [B, b, d] float32
    zo_update(X, X0, f [B], seed, step, N, a, b, mu, eta, kappa, estimator, grad_mode, clip_norm,
              projection_scope) -> (X_new [L, d], fired int32 [1] on the device)
    track_best(f, X, BestState) -> BestState            best-so-far X / f / patience on the device
    randn(seed, step, num, rows, d) -> [num, rows, d]   the directions U (= sicl_fast.rng.directions, bitwise)
    TritonOps                                           perturb / update for sicl_fast.ascent.Calibrator

Kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from .best import BestState, track_best
from .ops import TritonOps
from .perturb import perturb
from .proxy import proxy
from .randn import randn
from .span_logprobs import span_logprobs
from .zo_update import zo_update

__all__ = ["span_logprobs", "proxy", "perturb", "zo_update", "track_best", "BestState", "randn", "TritonOps"]
