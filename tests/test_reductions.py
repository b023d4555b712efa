"""cuBLAS's reduced-precision reductions off where the calibration reads a product's precision (issue 53, item 8:
sicl_fast.models.reductions): the difference form's products and the reference pass's bf16 pieces run inside
full_reductions, which turns torch's allow_bf16 / fp16_reduced_precision_reduction off for the pass (split-K left as
the user set it) and gives the user's settings back after it, nested or from two threads. torch holds the settings
on the CPU too (read when cuBLAS runs a product): a spy on each product reads them as the product would."""
import threading

import pytest
import torch

from sicl_fast.models import reductions, reference
from sicl_fast.models.reductions import full_reductions
from sicl_fast.models.weights import LowWeight
from test_fast_backend import build, make_prompt, perturbed
from test_ops import why_unavailable
from test_refresh import CPU_IMPL, step_of

OFF = {"bf16": (False, False), "fp16": (False, True)}  # reduced precision off, each split-K as USER has it
USER = {"bf16": (False, False), "fp16": (True, True)}  # a user's own: bf16 already off, without split-K


@pytest.fixture
def user_settings():
    """USER set for the test, torch's own put back after it."""
    before = reductions.settings()
    reductions._set(USER)
    yield
    reductions._set(before)


def test_the_scope_turns_reductions_off_and_gives_them_back(user_settings):
    assert reductions.settings() == USER
    with full_reductions():
        assert reductions.settings() == OFF
        with full_reductions():  # nested: still off, and not given back by the inner scope
            assert reductions.settings() == OFF
        assert reductions.settings() == OFF
    assert reductions.settings() == USER
    with pytest.raises(KeyError), full_reductions():  # an error in the block gives them back too
        {}["missing"]
    assert reductions.settings() == USER


def test_two_threads_share_one_scope(user_settings):
    """A thread that leaves while another is inside does not give the settings back under it."""
    inside, leave, seen = threading.Event(), threading.Event(), []

    def long_scope():
        with full_reductions():
            inside.set()
            leave.wait(5)
            seen.append(reductions.settings())

    t = threading.Thread(target=long_scope)
    t.start()
    inside.wait(5)
    with full_reductions():
        pass  # enters and leaves while the other thread is inside
    seen.append(reductions.settings())
    leave.set()
    t.join(5)
    assert seen == [OFF, OFF] and reductions.settings() == USER


def test_the_difference_products_and_the_reference_run_inside(user_settings, monkeypatch):
    """Every bf16 product of a difference-form pass (LowWeight.linear) and of the reference pass and head (a bf16
    weight's pieces, bf16_mm_f32: SPLIT 'on', CUDA's form, emulated here) sees the reductions off; after the pass the
    user's settings are back."""
    st = step_of(build("llama", dtype=torch.bfloat16, layers=2), CPU_IMPL)
    seen = []
    linear, mm = LowWeight.linear, reference.bf16_mm_f32
    monkeypatch.setattr(LowWeight, "linear", lambda self, *a, **k: seen.append(("rows", reductions.settings()))
                        or linear(self, *a, **k))
    monkeypatch.setattr(reference, "bf16_mm_f32", lambda a, w: seen.append(("ref", reductions.settings())) or mm(a, w))
    monkeypatch.setattr(reference, "SPLIT", "on")
    st.forward._reference(st.state.X)
    st()
    assert {kind for kind, _ in seen} == {"rows", "ref"} and len(seen) >= 2 * 4 + 4 + 1
    assert all(s == OFF for _, s in seen), seen
    assert reductions.settings() == USER


@pytest.mark.skipif(bool(why_unavailable("triton")), reason="needs triton")
def test_the_triton_forms_run_inside_too(user_settings, monkeypatch):
    """The same with the Triton ops (the GPU's; here under the interpreter): the pass's products inside the scope."""
    from sicl_fast.backends import make_backend

    lm = build("llama", layers=1)
    be = make_backend("fast", lm, diff_matmul="bf16", impl="triton")
    seen, linear = [], LowWeight.linear
    monkeypatch.setattr(LowWeight, "linear", lambda self, *a, **k: seen.append(reductions.settings())
                        or linear(self, *a, **k))
    p = make_prompt(6)
    be.span_logprobs(perturbed(be.embed(p), 6, B=3), p, near_row0=True)
    assert seen and all(s == OFF for s in seen) and reductions.settings() == USER
