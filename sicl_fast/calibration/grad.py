"""The proxy's exact gradient in the prompt embeddings (estimator "grad"): one forward and one backward of row 0.

    out, g = proxy_gradient(backend, prompt, X, config, spec)
        X [L, d] float32 (float64 for a float64 model's checks) -> out: ProxyOut of X (detached, [1] entries),
        g [R, d] in X's dtype: df/dX on the step's rows [a, b) (R = b - a)

The forward is the backend's own (`Backend.differentiable_logprobs`: `hf`, or the `fast` decoder's float32 plain
products without the prefix cache), the proxy is the torch reference (sicl_fast.step.proxy, through the
backend's TorchStepOps; torch.quantile's gradient included: the linear interpolation between two order statistics passes
its weights to those two), and the backward is autograd's. The model's weights stay detached: only X gets a gradient.

Where this cannot run is said once, up front, by the run plan (sicl_fast.run.plan.grad_refusal, checked by
`RunPlan.check_grad`): forward-only ops (C++, Triton), a backend without a differentiable forward (`naive`), weights
autograd cannot go through (integer / quantized tensors, tensors made under torch.inference_mode).
"""
from __future__ import annotations

import torch

from ..errors import NumericalError
from ..step.proxy import ProxyOut
from ..formats.spans import Prompt
from ..step.spec import StepSpec


def proxy_gradient(backend, prompt: Prompt, X: torch.Tensor, config, spec: StepSpec) -> tuple[ProxyOut, torch.Tensor]:
    """f(X) and its gradient on rows [a, b) (module docstring). config: the CalibrationConfig (proxy weights,
    checkpoint); spec: the prompt's StepSpec (rows [a, b)). Raises NumericalError on a non-finite f or gradient."""
    a, b = spec.a, spec.b
    x = X[:b].detach().clone().unsqueeze(0).requires_grad_(True)  # [1, b, d]; nothing after b changes f
    with torch.enable_grad():
        lp = backend.differentiable_logprobs(x, prompt, checkpoint=config.checkpoint)  # [1, P]
        out = backend.ops.proxy(lp, prompt.offsets, config.alpha, config.beta, config.gamma, config.q)
        (gx,) = torch.autograd.grad(out.f[0], x)
    g = gx[0, a:b]  # rows past demo_end (perturb_query) get 0: the forward never reads them
    if not bool(torch.isfinite(g).all()):
        raise NumericalError(f"request {prompt.id!r}: the proxy's gradient is not finite")
    detached = ProxyOut(*(t.detach() for t in (out.f, out.C, out.R, out.G, out.c)))
    return detached, g.to(X.dtype)


__all__ = ["proxy_gradient"]
