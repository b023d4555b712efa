"""The C++ path's kernel budget (impl 'cpp', the CPU's fast path): kernels per ascent step as sicl_fast.kernel_count
counts them (dispatched torch ops that launch a kernel + C++ extension calls), on the tiny models, the prefix fixed
(projection_scope 'demos'). A count over the budget is a regression: a fused op split again, or per-layer torch work
added (each costs host time per layer and step on the CPU).

Per decoder layer with difference products on (float32 model, N >= 1), at most 25: 7 float32 row-0 products and
4 bf16 difference products, 2 row-0 concatenations, 3 difference-row ops, 3 row additions, the gated difference,
2 residual norms, rotary and attention (one call each), and the views' copies; 14 with them off. The rest of the
step (perturbation, span head, proxy, update, bookkeeping): at most 107 (Llama 104). Measured at this budget
when it was set (bench/kernel_count.py compares two checkouts on SmolLM2).
"""
import pytest

from sicl_fast.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.ops import cpp_ops
from sicl_fast.profile import kernels_per_step
from sicl_fast.static import StaticStep
from test_fast_backend import make_prompt

CFG = CalibrationConfig(N=3, mu=0.05, eta=0.5, max_steps=4, tau=0.0, scale=1.0, projection_scope="demos")
BUDGET_PER_LAYER = {"bf16": 25, "off": 14}
BUDGET_REST = 107  # Gemma 2's soft-capped logits: 3 more than Llama's 104

pytestmark = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast._C is not built")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("diff", ["bf16", "off"])
def test_cpp_kernels_per_step_within_budget(models, family, diff):
    be = make_backend("fast", models[family], impl="cpp", diff_matmul=diff)
    assert be.model.attention.impl == "cpp"  # the plan's choice for impl 'cpp' on a float32 model
    p = make_prompt(6)
    st = StaticStep(be, Calibrator(be, CFG).config, p, be.embed(p))
    st()
    n = kernels_per_step(st)
    assert 0 < n.per_layer <= BUDGET_PER_LAYER[diff] and 0 < n.rest <= BUDGET_REST, n
    ref = make_backend("fast", models[family], impl="torch", diff_matmul=diff)
    st = StaticStep(ref, Calibrator(ref, CFG).config, p, ref.embed(p))
    st()
    assert kernels_per_step(st).per_layer > 2 * n.per_layer  # the count tells the fused path from the reference
