"""The C++ path's kernel budget (impl 'cpp', the CPU's fast path): kernels per ascent step as
sicl_fast.diagnostics.kernel_count counts them (dispatched torch ops that launch a kernel + C++ extension calls), on the
tiny models of two families (Llama; Gemma 2: soft-capped attention and logits, post-norms, an embedding scale), with the
difference form (diff_matmul 'bf16') and both projection scopes ('prompt': the prefix rows run in every pass as its lead
rows; 'demos': their K/V kept). A count over the budget is a regression: a fused op split again, or torch work added
per layer or per step (each costs host time per layer and step on the CPU).

    per decoder layer   at most 9: the 4 bf16 products, rope_rows, attention_rows, gated_rows, 2 norm_rows
    the rest            at most 30: perturbation, the pass's input rows and input norm (Gemma: its embedding
                        scale), the span rows' gather, the span head (2 calls a vocabulary chunk: 1 here), proxy,
                        update, bookkeeping

A layer's count is measured, not assumed: the decoder pass of the model less its last layer counts one layer
fewer (sicl_fast.diagnostics.profile.kernels_per_step splits the step into the decoder's pass and the rest; the pass's
per-layer figure there includes its input norm, spread over the layers).
"""
import pytest

from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.kernel_count import count_kernels
from sicl_fast.ops import cpp_ops
from sicl_fast.diagnostics.profile import kernels_per_step, layers_call
from sicl_fast.calibration.static import StaticStep
from test_fast_backend import make_prompt

CFG = CalibrationConfig(N=3, mu=0.05, eta=0.5, max_steps=4, tau=0.0, scale=1.0)
BUDGET_PER_LAYER, BUDGET_REST = 9, 30

pytestmark = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")


def static_step(lm, impl: str, scope: str) -> StaticStep:
    be = make_backend("fast", lm, impl=impl, diff_matmul="bf16")
    p = make_prompt(6)
    st = StaticStep(be, Calibrator(be, CFG.replace(projection_scope=scope)).config, p, be.embed(p))
    st()
    return st


def one_layer(st: StaticStep) -> int:
    """The kernels of one decoder layer: the decoder pass's count less that of the same pass with its last layer
    taken out (restored after)."""
    m = st.backend.model
    run = layers_call(st)
    full = count_kernels(run)
    layers, dense = m.layers, m.rows_dense()
    try:
        m.layers, m._rows_dense = layers[:-1], dense[:-1]
        fewer = count_kernels(run)
    finally:
        m.layers, m._rows_dense = layers, dense
    return full - fewer


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("scope", ["prompt", "demos"])
def test_cpp_kernels_per_step_within_budget(models, family, scope):
    st = static_step(models[family], "cpp", scope)
    assert st.backend.model.attention.impl == "cpp"  # the plan's choice for impl 'cpp'
    assert st.forward.rows_on and st.forward.policy == {"prompt": "pass", "demos": "kept"}[scope]
    n, layer = kernels_per_step(st), one_layer(st)
    rest = n.total - layer * n.n_layers
    assert 0 < layer <= BUDGET_PER_LAYER and 0 < rest <= BUDGET_REST, (layer, rest, n)
    ref = static_step(models[family], "torch", scope)
    assert kernels_per_step(ref).per_layer > 2 * n.per_layer  # the count tells the fused path from the reference
