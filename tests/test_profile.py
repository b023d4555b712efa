"""`sicl-fast profile` (sicl_fast.profile): the FLOP count against torch's own counter, the ops count, the table."""
import json

import pytest
from torch.utils.flop_counter import FlopCounterMode

from sicl_fast.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.profile import PHASES, kernels_per_step, profile_step, step_flops
from sicl_fast.static import StaticStep
from test_fast_backend import make_prompt

CFG = CalibrationConfig(N=3, mu=0.05, eta=0.5, max_steps=4, tau=0.0, scale=1.0)


@pytest.mark.parametrize("family,a", [("llama", 0), ("qwen3", 6)])
def test_decoder_flops_match_torchs_counter(models, family, a):
    """The math attention path computes every key's score (masked afterwards), so torch's counter sees
    4 H hd T N for attention where the profile counts the causal keys only; the products must agree exactly."""
    from sicl_fast.backends.fast import FastBackend

    be = FastBackend(models[family], attn="math", diff_matmul="off")
    p = make_prompt(a)
    st = StaticStep(be, Calibrator(be, CFG).config, p, be.embed(p))
    m = be.model
    T, k0 = p.demo_end - a, a
    x, prefix = st.batch[:, :p.demo_end], st._prefix()  # the prefix is its own phase
    with FlopCounterMode(display=False) as fc:
        m.forward(x[:, a:], a, prefix) if a else m.forward(x)
    causal = 2 * 2 * m.H * m.hd * (T * k0 + T * (T + 1) / 2)
    full = 2 * 2 * m.H * m.hd * T * (T + k0)  # scores of every key, prefix keys included
    expected = step_flops(st)["decoder layers"] + st.spec.B * len(m.layers) * (full - causal)
    assert fc.get_total_flops() == pytest.approx(expected, rel=1e-12)


def test_profile_table_and_counts(models):
    be = make_backend("fast", models["gemma2"], diff_matmul="bf16", impl="torch")
    p = make_prompt(6)
    prof = profile_step(be, CFG, p, repeats=1)
    assert [r[0] for r in prof.rows] == list(PHASES)
    assert all(r[1] >= 0 for r in prof.rows) and prof.step_ms > 0 and prof.peak_mb > 0 and prof.peak_gflops > 0
    assert abs(sum(r[2] for r in prof.rows) - 1.0) < 1e-9 or sum(r[1] for r in prof.rows[:-1]) > prof.step_ms
    st = StaticStep(be, Calibrator(be, CFG).config, p, be.embed(p))
    again = kernels_per_step(st)  # deterministic: the same kernels every step
    assert prof.kernels == again and again.layers > 10 * len(be.model.layers) and again.rest > 0
    text = prof.markdown()
    for phase in PHASES:
        assert f"| {phase} |" in text
    assert "kernels per step" in text and "matmul peak (measured here)" in text


@pytest.mark.slow
def test_profile_command_on_smollm2(tmp_path, capsys):
    from sicl_fast.cli import main

    trace = tmp_path / "trace.json"
    assert main(["profile", "--length", "48", "--repeats", "1", "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["info"]["model"].startswith("smollm2") and out["info"]["backend"] == "fast"
    assert [ph["phase"] for ph in out["phases"]] == list(PHASES) and out["kernels"]["total"] > out["kernels"]["rest"] > 0
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"decoder layers", "whole step"} <= names


def test_kernel_count_rules():
    """Views and allocations launch nothing; an elementwise op is one kernel; a Triton launch is one kernel,
    whatever tensor traffic Triton's CPU interpreter makes inside it."""
    import torch

    from sicl_fast.kernel_count import count_kernels

    x = torch.randn(4, 6)
    assert count_kernels(lambda: (x.view(6, 4), x.t(), x[1:], torch.empty(3), torch.empty_like(x))) == 0
    assert count_kernels(lambda: x + 1) == 1
    assert count_kernels(lambda: (x * 2).sum()) == 2
    from test_ops import device_of, why_unavailable

    if why_unavailable("triton"):
        pytest.skip(why_unavailable("triton"))
    from sicl_fast.kernels import residual_norm

    xd = x.to(device_of("triton"))
    w = torch.ones(6, device=xd.device)
    assert count_kernels(lambda: residual_norm(xd, None, None, w, 1e-6, False)) == 1
