"""Triton span_logprobs (LM head + online log-sum-exp over vocabulary chunks) against the torch reference.

Tolerances (absolute, on log-probabilities of magnitude ~5-15):
    float32 inputs:           2e-5 against the definition (conftest's span_logprobs_oracle)
    bfloat16 / float16 inputs: 2e-5 against the reference on the inputs upcast to float32 (the kernel multiplies the
                              16-bit values exactly and accumulates in float32); 0.05 (bf16) / 5e-3 (fp16) against
                              the reference run in the 16-bit dtype, which rounds its logits to that dtype
"""

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sicl_fast.errors import SiclError  # noqa: E402
from conftest import TRITON_DEVICE as DEV  # noqa: E402
from conftest import span_logprobs_oracle  # noqa: E402


def make(B, P, d, V, dtype, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, P, d, generator=g)
    w = torch.randn(V, d, generator=g) * scale
    t = torch.randint(0, V, (P,), generator=g)
    return h.to(dtype).to(DEV), w.to(dtype).to(DEV), t


@pytest.mark.parametrize(
    "B,P,d,V,softcap,kw",
    [
        (2, 5, 40, 1000, None, {}),  # P, d odd; V < one chunk
        (3, 7, 33, 49152, None, {}),  # the SmolLM2 vocabulary
        (1, 1, 24, 5003, None, {"splits": 3}),  # single position; V not a multiple of the chunk; 3 vocab splits
        (2, 3, 40, 5003, 30.0, {}),  # Gemma-2 soft-capping
        (2, 9, 37, 777, None, {"config": {"BLOCK_M": 16, "BLOCK_V": 128, "BLOCK_K": 16}, "splits": 2}),  # many tiles
    ],
)
def test_float32_matches_reference(K, B, P, d, V, softcap, kw):
    h, w, t = make(B, P, d, V, torch.float32)
    got = K.span_logprobs(h, w, t, softcap=softcap, **kw)
    ref = span_logprobs_oracle(h.cpu(), w.cpu(), t, softcap=softcap)
    assert got.dtype == torch.float32 and got.shape == (B, P)
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype,atol_same", [(torch.bfloat16, 0.05), (torch.float16, 5e-3)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_16bit_accumulates_in_float32(K, dtype, atol_same, softcap):
    h, w, t = make(2, 6, 40, 3001, dtype, seed=1)
    got = K.span_logprobs(h, w, t, softcap=softcap, splits=2).cpu()
    exact = span_logprobs_oracle(h.cpu().float(), w.cpu().float(), t, softcap=softcap)
    torch.testing.assert_close(got, exact, rtol=0, atol=2e-5)
    same = span_logprobs_oracle(h.cpu(), w.cpu(), t, softcap=softcap)
    torch.testing.assert_close(got, same, rtol=0, atol=atol_same)


def test_large_logits_are_stable(K):
    """Logits in the hundreds: the online log-sum-exp must not overflow (softcap keeps them at <= 30)."""
    h, w, t = make(2, 3, 16, 2000, torch.float32, seed=2, scale=20.0)
    for cap in (None, 30.0):
        got = K.span_logprobs(h, w, t, softcap=cap).cpu()
        ref = span_logprobs_oracle(h.cpu(), w.cpu(), t, softcap=cap)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-3)


def test_non_contiguous_hidden(K):
    h, w, t = make(3, 8, 40, 500, torch.float32, seed=3)
    hs = h[:, ::2]  # [3, 4, 40], strided along P
    got = K.span_logprobs(hs, w, t[::2]).cpu()
    ref = span_logprobs_oracle(hs.cpu(), w.cpu(), t[::2])
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


def test_errors_are_clear(K):
    h, w, t = make(2, 3, 16, 100, torch.float32)
    with pytest.raises(SiclError, match="weight must have shape"):
        K.span_logprobs(h, w[:, :8], t)
    with pytest.raises(SiclError, match="same dtype"):
        K.span_logprobs(h, w.to(torch.bfloat16), t)
    with pytest.raises(SiclError, match="targets must have shape"):
        K.span_logprobs(h, w, t[:2])
    with pytest.raises(SiclError, match=r"targets must be in \[0, V=100\)"):
        K.span_logprobs(h, w, torch.tensor([0, 5, 100]))
    with pytest.raises(SiclError, match="hidden must be float32, bfloat16, float16"):
        K.span_logprobs(h.double(), w.double(), t)
    with pytest.raises(SiclError, match="softcap must be > 0"):
        K.span_logprobs(h, w, t, softcap=0.0)
