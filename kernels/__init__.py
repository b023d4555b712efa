"""Triton kernels of sicl_fast, installed as `sicl_fast.kernels` (sicl_fast.ops.TritonOps uses them; the
implementation is chosen once, by sicl_fast.ops.make_ops).

One op a file, each a @triton.jit kernel plus a launcher that checks shapes / dtypes / devices:

    span_logprobs(hidden [B, P, d], weight [V, d], targets [P], softcap=None) -> [B, P] float32
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q) -> ProxyOut(f, C, R, G, c)
    proxy_planned(logprobs [B, P], plan: sicl_fast.proxy.ProxyPlan) -> ProxyOut   (no checks, no host reads)
    perturb(X [L, d] float32, step, spec: StepSpec) -> [B, b, d] float32
    zo_update(X, X0, f [B], step, spec) -> (X_new [L, d] float32, fired int32 [1] on the device)
    track_best(f, X, BestState) -> BestState            best-so-far X / f / patience on the device
    randn(seed, step, num, rows, d) -> [num, rows, d]   the directions U (= sicl_fast.rng.directions, bitwise)

Kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from ._utils import interpreting
from .best import BestState, track_best
from .perturb import perturb
from .proxy import proxy, proxy_planned
from .randn import randn
from .span_logprobs import span_logprobs
from .zo_update import zo_update

__all__ = ["span_logprobs", "proxy", "proxy_planned", "perturb", "zo_update", "track_best", "BestState", "randn", "interpreting"]
