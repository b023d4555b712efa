"""Triton proxy kernel against sicl_fast.step.proxy.proxy (the reference): what only this kernel has (16-bit
inputs, the weights, ties). The float32 parity over odd shapes is tests/test_ops.py's, for every implementation.

Tolerance: float32 log-probs: rtol 1e-5 and atol 1e-7 on f, C, R, G and c (the kernel sums spans as a tree,
the reference sequentially); 16-bit inputs are upcast exactly, so the same bound holds against the reference on
the same 16-bit tensor.
"""

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sicl_fast.errors import NumericalError, SiclError  # noqa: E402
from sicl_fast.step.proxy import proxy as ref_proxy  # noqa: E402
from sicl_fast.formats.spans import span_offsets  # noqa: E402
from conftest import TRITON_DEVICE as DEV  # noqa: E402


def check(got, ref):
    for name in ("f", "C", "R", "G", "c"):
        g, r = getattr(got, name).cpu(), getattr(ref, name).cpu()
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_weights_ties_and_minus_inf(K):
    lp = torch.tensor([[-1.0, -1.0, -1.0, -2.0, -0.5], [float("-inf"), -3.0, -0.1, -0.1, -7.0]])
    offs = span_offsets([2, 3])
    for a, b, c in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.25, 0.5, 0.25)):
        check(K.proxy(lp.to(DEV), offs, a, b, c, 0.3), ref_proxy(lp, offs, a, b, c, 0.3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_logprobs(K, dtype):
    lp = (-torch.rand(3, 13, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    offs = span_offsets([5, 1, 7])
    check(K.proxy(lp.to(DEV), offs), ref_proxy(lp, offs))


def test_errors_are_clear(K):
    lp = -torch.rand(2, 5).to(DEV)
    with pytest.raises(SiclError, match="run from 0 to P=5"):
        K.proxy(lp, span_offsets([2, 2]))
    with pytest.raises(SiclError, match="has no tokens"):
        K.proxy(lp, torch.tensor([0, 2, 2, 5]))
    with pytest.raises(SiclError, match="q must be in"):
        K.proxy(lp, span_offsets([5]), q=1.5)
    with pytest.raises(SiclError, match=r"logprobs must be \[B, P\]"):
        K.proxy(lp[0], span_offsets([5]))
    bad = lp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(NumericalError):
        K.proxy(bad, span_offsets([5]))
