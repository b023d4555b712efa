"""The fused paths end to end: a seeded calibration on a tiny random-weight Llama through the Triton kernels
(SICL_TRITON=1, TRITON_INTERPRET=1) and through the C++ ops matches the torch reference path step for step.

Tolerance: the proxy history f0(step) to rtol 1e-5 / atol 1e-7, the returned embeddings to atol 1e-5, and the
same steps, best step, stop reason and projection count (float32 differences of ~1e-7 per step).
"""
import os
import subprocess
import sys
from pathlib import Path


import pytest  # noqa: E402
import torch  # noqa: E402

from sicl_fast import cpp_ops, fused, zo  # noqa: E402
from sicl_fast.ascent import CalibrationConfig, Calibrator  # noqa: E402
from sicl_fast.backends.hf import HFBackend  # noqa: E402
from sicl_fast.models import from_transformers  # noqa: E402
from sicl_fast.requests import Request  # noqa: E402
from sicl_fast.spans import Prompt  # noqa: E402

TRITON_OK = True
try:
    import triton  # noqa: F401
except ImportError:
    TRITON_OK = False
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    TRITON_OK = False

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
    return HFBackend(lm), prompt


_REFERENCE: dict = {}


def reference_run(backend, prompt, cfg, monkeypatch):
    """The torch path (TorchOps, chunked torch LM head), run once per config."""
    monkeypatch.delenv("SICL_TRITON", raising=False)
    if cfg not in _REFERENCE:
        _REFERENCE[cfg] = Calibrator(backend, cfg, ops=zo.TorchOps()).run(prompt)
    return _REFERENCE[cfg]


def assert_same_run(got, ref):
    assert got.steps == ref.steps and got.stop_reason == ref.stop_reason
    assert got.best_step == ref.best_step and got.projections == ref.projections
    torch.testing.assert_close(torch.tensor(got.history), torch.tensor(ref.history), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.embeddings, ref.embeddings, rtol=0, atol=1e-5)


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_path_matches_torch_reference(setup, monkeypatch, name):
    backend, prompt = setup
    cfg = CONFIGS[name]
    ref = reference_run(backend, prompt, cfg, monkeypatch)
    assert ref.steps == 4 and len(set(ref.history)) > 1  # the run really moves
    if name.startswith("central"):
        assert ref.projections > 0
    monkeypatch.setenv("SICL_TRITON", "1")
    cal = Calibrator(backend, cfg)
    assert cal.ops.name == "triton"
    assert_same_run(cal.run(prompt), ref)


@pytest.mark.skipif(not cpp_ops.available(), reason="sicl_fast._C is not built")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpp_path_matches_torch_reference(setup, monkeypatch, name):
    backend, prompt = setup
    cfg = CONFIGS[name]
    ref = reference_run(backend, prompt, cfg, monkeypatch)
    monkeypatch.delenv("SICL_CPP", raising=False)
    cal = Calibrator(backend, cfg)
    assert cal.ops.name == "cpp"
    assert_same_run(cal.run(prompt), ref)


@pytest.mark.skipif(not (TRITON_OK and cpp_ops.available()), reason="needs Triton and sicl_fast._C")
def test_perturbation_batches_identical_on_every_path(setup):
    """Seeded: the batches the three paths feed the model are bit-identical at every step."""
    backend, prompt = setup
    cfg = CONFIGS["central-normalize-demos"]
    X = backend.embed(prompt)
    a, b = prompt.demo_start, prompt.demo_end
    K = fused.kernels()
    for step in (0, 1, 7):
        ref = zo.TorchOps().perturb(X, step, cfg, a, b)
        assert torch.equal(cpp_ops.CppOps().perturb(X, step, cfg, a, b), ref)
        assert torch.equal(K.TritonOps().perturb(X, step, cfg, a, b).cpu(), ref)


def test_default_ops_choice(monkeypatch):
    monkeypatch.delenv("SICL_TRITON", raising=False)
    monkeypatch.delenv("SICL_CPP", raising=False)
    expected = "cpp" if cpp_ops.available() else "torch"
    assert fused.default_ops("cpu").name == expected
    monkeypatch.setenv("SICL_CPP", "0")
    assert fused.default_ops("cpu").name == "torch"
    if TRITON_OK:
        monkeypatch.setenv("SICL_TRITON", "1")
        assert fused.default_ops("cpu").name == "triton"
        assert fused.triton_wanted("cpu")
    assert fused.triton_wanted(torch.device("cuda", 0))


def test_imports_without_triton_or_extension():
    """With triton and sicl_fast._C unimportable, sicl_fast imports, picks TorchOps, and explains what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['sicl_fast._C'] = None\n"
        "import sicl_fast\n"
        "from sicl_fast import fused, cpp_ops\n"
        "from sicl_fast.errors import SiclError\n"
        "assert fused.default_ops('cpu').name == 'torch' and not cpp_ops.available()\n"
        "for fn in (fused.kernels, lambda: cpp_ops.randn(0, 0, 1, 1, 4), cpp_ops.CppOps):\n"
        "    try:\n"
        "        fn()\n"
        "    except SiclError as e:\n"
        "        print('ERR', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    env.pop("SICL_TRITON", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 3
    assert "triton" in lines[0]
    assert "setup.py build_ext --inplace" in lines[1] and "setup.py build_ext --inplace" in lines[2]
