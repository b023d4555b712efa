"""The implementation layer end to end: `impl` is chosen once (make_backend / Engine), every calibration on that
backend runs on that one StepOps object, and a seeded calibration through the C++ and Triton implementations
matches the torch reference step for step.

Tolerance: the proxy history f0(step) to rtol 1e-5 / atol 1e-7 and the returned embeddings to atol 1e-5 on the
hf backend (float32 differences of ~1e-7 per step). On the fast backend in difference form, rtol 1e-3 and atol
5e-4 (a step moves an element by about 0.06 here; measured 1.5e-4): row 0 itself is a bf16 product of bf16-rounded
values there, and an implementation's float32 sum in another order can flip a value's bf16 rounding (2^-8 of that
element: f0 moved by up to 2.8e-4 relative, measured); the C++ activation's ~1 ulp can flip a difference term's
rounding, which moves that step's gradient estimate a little. The same steps, stop reason and projection count; the
same best step where the reference's best f0 leads the runner-up by more than the tolerance (on these random models
a step changes f0 by about 1e-6).
"""
import os
import subprocess
import sys

import pytest
import torch

from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.engine import Engine
from sicl_fast.errors import SiclError
from sicl_fast.models import from_transformers
from sicl_fast.ops import cpp_ops, make_ops
from sicl_fast.run.plan import resolve_impl
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from test_ops import device_of, why_unavailable

CONFIGS = {
    "forward-clip-prompt": CalibrationConfig(N=4, mu=0.01, eta=0.5, kappa=0.2, tau=0.0, patience=0, max_steps=4,
                                             seed=3, scale=1.0),
    # mu large enough that f(X + mu U) - f(X - mu U) stands well above float32 noise: the normalised gradient of a
    # difference made of a few ulps would amplify the paths' ~1e-9 proxy differences into visible steps
    "central-normalize-demos": CalibrationConfig(N=3, mu=0.1, eta=1.0, kappa=0.9, tau=0.0, patience=0, max_steps=4,
                                                 seed=11, scale=1.0, estimator="central", grad_mode="normalize",
                                                 projection_scope="demos"),
}


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    lm = from_transformers(LlamaForCausalLM(cfg), None, name="tiny-llama-128")
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(5))
    req = Request(id="synthetic", prompt="x" * 25, output_spans=((1, 2),))
    prompt = Prompt(request=req, input_ids=ids, token_spans=((5, 8), (12, 13), (17, 20)), demo_start=3, demo_end=20)
    return lm, prompt


_REFERENCE: dict = {}


def reference_run(lm, prompt, backend: str, cfg):
    """The torch implementation on `backend`, run once per (backend, config)."""
    key = (backend, cfg)
    if key not in _REFERENCE:
        _REFERENCE[key] = Calibrator(make_backend(backend, lm, diff_matmul="bf16" if backend == "fast" else "auto",
                                                  impl="torch"), cfg).run(prompt)
    return _REFERENCE[key]


def assert_same_run(got, ref, emb_atol=1e-5, rtol=1e-5):
    assert got.steps == ref.steps and got.stop_reason == ref.stop_reason and got.projections == ref.projections
    torch.testing.assert_close(torch.tensor(got.history), torch.tensor(ref.history), rtol=rtol, atol=1e-7)
    top = sorted(ref.history, reverse=True)
    if len(top) < 2 or top[0] - top[1] > 2 * rtol * abs(top[0]):
        assert got.best_step == ref.best_step
    torch.testing.assert_close(got.embeddings.cpu(), ref.embeddings, rtol=0, atol=emb_atol)


@pytest.mark.parametrize("impl", ["cpp", "triton"])
@pytest.mark.parametrize("backend", ["hf", "fast"])  # fast: with bf16 difference products (their epilogues)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_impl_matches_torch_reference(setup, impl, backend, name):
    reason = why_unavailable(impl)
    if reason:
        pytest.skip(reason)
    if impl == "triton" and device_of(impl) != "cpu":
        pytest.skip("the tiny model lives on the CPU; the CUDA run is the GPU suite's")
    lm, prompt = setup
    cfg = CONFIGS[name]
    ref = reference_run(lm, prompt, backend, cfg)
    assert ref.steps == 4 and len(set(ref.history)) > 1 and ref.impl == "torch"  # the run really moves
    if name.startswith("central"):
        assert ref.projections > 0
    be = make_backend(backend, lm, diff_matmul="bf16" if backend == "fast" else "auto", impl=impl)
    got = Calibrator(be, cfg).run(prompt)
    assert got.impl == impl and Calibrator(be, cfg).ops is be.ops
    assert_same_run(got, ref, *((5e-4, 1e-3) if backend == "fast" else (1e-5, 1e-5)))


def test_auto_follows_the_model_device_and_names_are_checked():
    assert resolve_impl("auto", "cpu")[0] == ("cpp" if cpp_ops.available() else "torch")
    assert resolve_impl("auto", torch.device("cuda", 0))[0] == "triton"
    assert resolve_impl("torch", torch.device("cuda", 0))[0] == "torch"
    assert make_ops("torch").step.name == make_ops("torch").decoder.name == "torch"
    with pytest.raises(SiclError, match="unknown impl 'fast'"):
        resolve_impl("fast", "cpu")
    with pytest.raises(SiclError, match="unknown impl 'auto'"):
        make_ops("auto")  # make_ops builds a resolved implementation; the plan resolves 'auto'
    with pytest.raises(SiclError, match="impl 'cpp' runs on the CPU"):
        resolve_impl("cpp", "cuda")


def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "from sicl_fast.run.plan import resolve_impl\nfrom sicl_fast.errors import SiclError\n"
            "try:\n    resolve_impl('triton', 'cpu')\nexcept SiclError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR impl 'triton' runs on CUDA" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


class _Tripwire:
    """Stands in for the C++ extension: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the C++ extension was called ({name})")


@pytest.fixture
def no_compiled_code(monkeypatch):
    """Every C++ call and every Triton kernel launch raises."""
    monkeypatch.setattr(cpp_ops, "_C", _Tripwire())
    try:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
    except ImportError:
        return

    def launch(self, grid):
        raise AssertionError(f"a Triton kernel was launched ({getattr(self, 'fn', self)})")

    monkeypatch.setattr(jit.KernelInterface, "__getitem__", launch)
    if hasattr(interp, "InterpretedFunction"):
        monkeypatch.setattr(interp.InterpretedFunction, "__getitem__", launch, raising=False)


def test_impl_torch_runs_no_cpp_or_triton_code(setup, no_compiled_code):
    lm, prompt = setup
    cfg = CONFIGS["central-normalize-demos"]
    for backend in ("fast", "hf", "naive"):
        be = make_backend(backend, lm, diff_matmul="bf16" if backend == "fast" else "auto", impl="torch")
        res = Calibrator(be, cfg).run(prompt)
        assert res.impl == "torch" and res.steps == 4
    assert Engine(lm, backend="fast", diff_matmul="bf16", impl="torch").proxy(prompt).f.shape == (1,)
    # the tripwire itself works: the compiled implementations trip it
    for impl in ("cpp", "triton"):
        if why_unavailable(impl) or device_of(impl) != "cpu":
            continue
        with pytest.raises(AssertionError, match="C\\+\\+ extension was called|Triton kernel was launched"):
            be = make_backend("fast", lm, diff_matmul="bf16", impl=impl)
            Calibrator(be, cfg).run(prompt)


def test_imports_without_triton_or_extension():
    """With triton and sicl_fast.ops._C unimportable, sicl_fast imports, auto picks torch, and asking for the missing
    implementations explains how to get them."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['sicl_fast.ops._C'] = None\n"
        "import sicl_fast\n"
        "from sicl_fast.ops import cpp_ops\n"
        "from sicl_fast.run.plan import resolve_impl\n"
        "from sicl_fast.errors import SiclError\n"
        "assert resolve_impl('auto', 'cpu')[0] == 'torch' and not cpp_ops.available()\n"
        "for impl in ('triton', 'cpp'):\n"
        "    try:\n"
        "        resolve_impl(impl, 'cpu')\n"
        "    except SiclError as e:\n"
        "        print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 2
    assert "triton==3.6.0" in lines[0]
    assert "setup.py build_ext --inplace" in lines[1]
