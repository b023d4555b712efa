"""The ops protocols: every hot tensor operation that has several implementations, behind two objects of one
implementation, made once where the engine is built (`sicl_fast.ops.make_ops(impl, device)`, the impl resolved by
the run plan, sicl_fast.run.plan) and passed down; nothing below decides again or reads the environment.

    StepOps      the ascent's step: perturbation, update, proxy, span head, best X and the static step's bookkeeping
                 (the backend holds it as `backend.ops`; Calibrator and the static / packed steps run it)
    DecoderOps   the fast decoder's elementwise work and the difference products' epilogues (the model holds it)

Implementations: torch (sicl_fast.ops.torch_ops, the reference, any device; the oracle of the others), cpp
(sicl_fast.ops.cpp_ops, the C++ extension sicl_fast.ops._C, float32 CPU tensors), triton (sicl_fast.ops.triton_ops,
the kernels sicl_fast.kernels: CUDA or the CPU interpreter). An implementation without its own form of an op
inherits the reference's; where it adds nothing to a kernel, the kernel function itself is bound as the op.

StepOps (shapes and dtypes):
    perturb(X [L, d] f32, step, spec, out=None, rows_end=None) -> batch [B, b, d] f32
    update(X, X0 [L, d] f32, f [B], step, spec, out=None, rows_end=None) -> (X_new [L, d] f32, fired int32 [1] on
        X's device)
        step: an int, or an int64 [1] tensor on X's device that the op reads there (device-resident loop state:
        no host read, so a CUDA graph can replay the step); out: a preallocated result buffer; rows_end: None, or
        an int64 [1] tensor on X's device, read there: a length bucket's padded block ends there instead of at
        spec.b (sicl_fast.step.zo)
    ascend(X, X0 [L, d] f32, g [R, d] f32, spec) -> (X_new, fired)      the step from a given (exact) gradient
    proxy(logprobs [B, P], offsets [T+1], alpha, beta, gamma, q, check_values=True) -> ProxyOut (f32)
    proxy_planned(logprobs [B, W], plan: ProxyPlan) -> ProxyOut    no checks, no host reads (step.proxy; W the
                                                                    plan's width, its count of positions read)
    span_head(hidden [B, P, d], weight [V, d], targets [P], softcap=None, bias=None) -> [B, P] f32 log p(target)
    span_head_rows(hidden [B, P, d] low, weight [V, d] low, targets [P], anchor [B], softcap=None, z_ref=None,
                   value_slot=None) -> [B, P] f32
                                the span head of a difference-form pass: hidden as changes over the batch
                                (sicl_fast.models.rows), the value rows' against their reference logits z_ref
                                [Vb, P, V] f32 (value_slot [B]: each value row's), the logits made float32 rows
                                before the log-sum-exp (sicl_fast.step.logprobs.rows_logprobs)
    track_best(f [B], X [L, d] f32, state: BestState) -> state            (sicl_fast.step.best)
    bookkeep(state: StepState, f [B], fired int32 [1], cfg) -> None       the static step's bookkeeping, in place
                                                                          (sicl_fast.step.step_state.bookkeep_reference)
    cached_tensors() -> list    device tensors the ops cache between calls; a captured CUDA graph reads them by
                                address, so it holds these references (sicl_fast.run.graphs)

DecoderOps (sicl_fast.models.elementwise and sicl_fast.models.rows hold the references; the plain ops in the model
dtype, the row epilogues on float32 rows and the difference form's low dtype):
    residual_norm(x [.., d], y [.., d] or None, post_w [d] or None, w [d] or None, eps, gemma, y_scale=None)
              -> (x', h)
        x' = x + y_scale (rms_norm(y, post_w) or y) (y_scale None: 1), h = rms_norm(x', w), or x' itself when w
        is None; y None: (x, rms_norm(x, w) or x)
    qk_rope(q [B, T, H, hd], k, v [B, T, Hk, hd], cos, sin [T, 1, rot], q_norm, k_norm, eps, gemma,
            k_out=None, v_out=None) -> (q', k', v')   k' / v' are k_out / v_out when given (written in place);
            a fused implementation may overwrite q; the q / k norms per head ([hd]) or over the whole projection
            ([H hd] / [Hk hd]); the first rot elements of each head rotated (rot <= hd)
    gated(gate [.., I], up [.., I], act_name) -> act(gate) * up
    softcap_(x, cap) -> cap tanh(x / cap)                 a fused implementation overwrites x
    norm_rows(x [R, d] f32, y [R, d] low or None, bias, post_w, w or None, eps, gemma, rows, y_ref=None,
              h_ref=None, y_scale=None) -> (x' [R, d] f32, h [R, d] low)
    rope_rows(qkv [R, (H + 2 Hk) hd] low, bias, rows, cos, sin [n, rot] f32, q_norm, k_norm, eps, gemma, H, Hk,
              k_out, v_out [R, Hk, hd] f32, qkv_ref=None) -> q [R, H, hd] f32
    gated_rows(y [R, 2I] low, bias, act_name, rows, y_ref=None, a_ref=None) -> [R, I] low
        (the difference form's epilogues, one launch each where fused: sicl_fast.models.rows; rows a RowLayout; the
        *_ref the value rows' float32 references [V, k]: a product's output one to read its rows against, the next
        product's input one to write them against; None: none)
    split_bf16(x [n, k] f32, pieces) -> [pieces, n, k] bf16
        float32 rows as bf16 pieces whose sum is x (the reference pass's bf16 products with float32 accumulation,
        sicl_fast.models.reference; one launch where fused)

    fp8_rows(x [M, k] low) -> (q [M, k] float8 e4m3, scale [M, 1] f32)
        the difference rows of an FP8 product, a scale a row (sicl_fast.models.weights.fp8_rows; one launch fused)
    kv_in_place: qk_rope writes k_out / v_out as it rotates (else they would cost a copy)
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..step.best import BestState
from ..step.proxy import ProxyOut, ProxyPlan
from ..step.spec import StepSpec


class StepOps(Protocol):
    name: str  # "torch", "cpp" or "triton": what CalibrationResult and benchmark records report

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out: torch.Tensor | None = None,
                rows_end: torch.Tensor | None = None) -> torch.Tensor: ...

    def update(self, X: torch.Tensor, X0: torch.Tensor, f: torch.Tensor, step, spec: StepSpec,
               out: torch.Tensor | None = None, rows_end: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def ascend(self, X: torch.Tensor, X0: torch.Tensor, g: torch.Tensor,
               spec: StepSpec) -> tuple[torch.Tensor, torch.Tensor]: ...

    def proxy(self, logprobs: torch.Tensor, offsets: torch.Tensor, alpha: float = 0.6, beta: float = 0.3,
              gamma: float = 0.1, q: float = 0.1, check_values: bool = True) -> ProxyOut: ...

    def proxy_planned(self, logprobs: torch.Tensor, plan: ProxyPlan) -> ProxyOut: ...

    def span_head(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def span_head_rows(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       anchor: torch.Tensor, softcap: float | None = None, z_ref: torch.Tensor | None = None,
                       value_slot: torch.Tensor | None = None) -> torch.Tensor: ...

    def track_best(self, f: torch.Tensor, X: torch.Tensor, state: BestState) -> BestState: ...

    def bookkeep(self, state, f: torch.Tensor, fired: torch.Tensor, cfg) -> None: ...

    def cached_tensors(self) -> list: ...


class DecoderOps(Protocol):
    name: str
    kv_in_place: bool

    def residual_norm(self, x, y, post_w, w, eps: float, gemma: bool,
                      y_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qk_rope(self, q, k, v, cos, sin, q_norm, k_norm, eps: float, gemma: bool, k_out=None,
                v_out=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def gated(self, gate: torch.Tensor, up: torch.Tensor, act_name: str) -> torch.Tensor: ...

    def softcap_(self, x: torch.Tensor, cap: float) -> torch.Tensor: ...

    def norm_rows(self, x, y, bias, post_w, w, eps: float, gemma: bool, rows, y_ref=None, h_ref=None,
                  y_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_rows(self, qkv, bias, rows, cos, sin, q_norm, k_norm, eps: float, gemma: bool, H: int, Hk: int, k_out,
                  v_out, qkv_ref=None) -> torch.Tensor: ...

    def gated_rows(self, y: torch.Tensor, bias, act_name: str, rows, y_ref=None, a_ref=None) -> torch.Tensor: ...

    def split_bf16(self, x: torch.Tensor, pieces: int = 3) -> torch.Tensor: ...

    def fp8_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Ops(NamedTuple):
    """One implementation's two halves (make_ops)."""

    step: StepOps
    decoder: DecoderOps


def fired_tensor(fired: bool, device) -> torch.Tensor:
    """A projection decision made on the host, as the int32 [1] device tensor every update returns."""
    return torch.full((1,), int(fired), dtype=torch.int32, device=device)


__all__ = ["StepOps", "DecoderOps", "Ops", "fired_tensor"]
