"""The ops protocols on the Triton kernels (`sicl_fast.kernels`): TritonStepOps (perturb, update, proxy, span head,
best tracking and the static step's bookkeeping, with the noise regenerated in the kernels, bit-identical to
sicl_fast.step.rng's; the span heads of plain and difference-form passes) and TritonDecoderOps (the
decoder's fused elementwise kernels: norm + residual, rotary, gated activation, soft-cap; and the difference form's row
epilogues norm_rows, rope_rows, gated_rows, one launch each). The fused attention kernels (prefix_attention,
attention_rows) are the run plan's attention 'triton' (sicl_fast.models.attention).

The kernels run on CUDA, or on the CPU through Triton's interpreter when TRITON_INTERPRET=1 was set before
triton was first imported (slow: for tests). Nothing here synchronises with the host except the proxy's
optional value check (check_values=True).
"""
from __future__ import annotations

import torch

from ..errors import SiclError
from ..step.logprobs import vocab_chunked_logprobs
from ..step.spec import StepSpec
from .torch_ops import TorchStepOps


def load_kernels(device=None, what: str = "impl 'triton'", instead: str = "impl 'torch' / 'cpp'"):
    """The installed `sicl_fast.kernels` package; a SiclError that says what to do when triton is missing, or
    when `device` (if given) is neither CUDA nor the CPU under Triton's interpreter (`what` needs the kernels;
    `instead` names what to use otherwise)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise SiclError(f"{what} needs the `triton` package (pip install triton==3.6.0): {exc}") from None
    from .. import kernels

    if device is not None and torch.device(device).type != "cuda" and not kernels.interpreting():
        raise SiclError(f"{what} runs on CUDA; for {torch.device(device)} tensors set TRITON_INTERPRET=1 before "
                        f"triton is imported (Triton's interpreter, slow) or use {instead}")
    return kernels


class TritonStepOps(TorchStepOps):
    """The step ops on the Triton kernels (module docstring); the kernel functions themselves where the op adds
    nothing to them. device: where the tensors will live."""

    name = "triton"

    def __init__(self, device="cuda") -> None:
        self.K = K = load_kernels(device)
        self.proxy_planned, self.track_best, self.bookkeep = K.proxy_planned, K.track_best, K.bookkeep
        self.cached_tensors = K.cached_tensors

    def perturb(self, X: torch.Tensor, step, spec: StepSpec, out=None, rows_end=None) -> torch.Tensor:
        return self.K.perturb(X.float(), step, spec, out=out, rows_end=rows_end)

    def update(self, X, X0, f, step, spec: StepSpec, out=None, rows_end=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.K.zo_update(X.float(), X0.float(), f, step, spec, out=out, rows_end=rows_end)

    def span_head(self, hidden, weight, targets, softcap=None, bias=None) -> torch.Tensor:
        if bias is not None:  # an output module's bias (the hf backend's head of Phi-2, GPT-J): the reference's
            return vocab_chunked_logprobs(hidden, weight, targets, softcap, bias=bias)
        # a prompt's targets: checked once by sicl_fast.run.checks.check_tokens, never read back per step
        return self.K.span_logprobs(hidden, weight, targets, softcap=softcap, check_targets=False)

    def span_head_rows(self, hidden, weight, targets, anchor, softcap=None, z_ref=None, value_slot=None
                       ) -> torch.Tensor:
        # the difference form's span head (kernels/span_logprobs.py: span_logprobs_rows; z_ref [Vb, P, V] float32
        # with value_slot [B]: the value rows' reference logits, or None); targets as span_head's
        return self.K.span_logprobs_rows(hidden, weight, targets, anchor, softcap=softcap, z_ref=z_ref,
                                         value_slot=value_slot, check_targets=False)


class TritonDecoderOps:
    """The decoder ops: the fused kernels themselves (module docstring)."""

    name = "triton"
    kv_in_place = True  # qk_rope writes K / V straight into the decoder's buffers

    def __init__(self, device="cuda") -> None:
        K = load_kernels(device)
        self.residual_norm, self.qk_rope, self.gated, self.softcap_ = K.residual_norm, K.qk_rope, K.gated, K.softcap_
        self.norm_rows, self.rope_rows, self.gated_rows = K.norm_rows, K.rope_rows, K.gated_rows  # the rows' epilogues
        self.split_bf16 = K.split_bf16  # the reference pass's bf16 pieces (sicl_fast.models.reference)

        self.fp8_rows = K.fp8_rows  # FP8 differences' quantisation


__all__ = ["TritonStepOps", "TritonDecoderOps", "load_kernels"]
