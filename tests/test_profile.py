"""`sicl-fast profile` (sicl_fast.diagnostics.profile): the FLOP count against torch's own counter, the ops count,
the table."""
import json

import pytest
from torch.utils.flop_counter import FlopCounterMode

from conftest import reference_backend
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.profile import PHASES, count_kernels, kernels_per_step, layers_call, profile_step, step_flops
from sicl_fast.calibration.static import StaticStep
from test_fast_backend import make_prompt

CFG = CalibrationConfig(N=3, mu=0.05, eta=0.5, max_steps=4, tau=0.0, scale=1.0)


@pytest.mark.parametrize("family,a", [("llama", 0), ("qwen3", 6)])
def test_decoder_flops_match_torchs_counter(models, family, a):
    """The math attention path computes every key's score (masked afterwards), so torch's counter sees
    4 H hd T N for attention where the profile counts the causal keys only; the products must agree exactly."""
    be = reference_backend("fast", models[family], attn="math", diff_matmul="off")
    p = make_prompt(a)
    # scope 'demos': the prefix's K/V are kept, computed once before the steps
    st = StaticStep(be, Calibrator(be, CFG.replace(projection_scope="demos")).config, p, be.embed(p))
    m = be.model
    T, k0 = p.demo_end - a, a
    with FlopCounterMode(display=False) as fc:
        layers_call(st)()
    causal = 2 * 2 * m.H * m.hd * (T * k0 + T * (T + 1) / 2)
    full = 2 * 2 * m.H * m.hd * T * (T + k0)  # scores of every key, prefix keys included
    expected = step_flops(st)["decoder layers"] + st.spec.B * len(m.layers) * (full - causal)
    assert fc.get_total_flops() == pytest.approx(expected, rel=1e-12)


def test_flops_split_by_precision_and_the_floor(models):
    """In the difference form every projection (the prefix rows of the pass included) and the span head are bf16
    products and the attention stays float32; plain, everything is in the model dtype. The totals do not change,
    and a phase's floor is its FLOPs of each precision at that precision's rate."""
    from sicl_fast.diagnostics.profile import Rates, floor_of, step_flops_by_precision

    lm, p = models["llama"], make_prompt(6)
    splits = []
    for diff in ("off", "bf16"):
        be = make_backend("fast", lm, diff_matmul=diff, impl="torch")
        st = StaticStep(be, Calibrator(be, CFG).config, p, be.embed(p))
        splits.append((st, step_flops_by_precision(st)))
    (_, off), (st, on) = splits
    assert all(low == 0 for _, low in off.values()) and on["decoder layers"][1] > 0 and on["span head"][0] == 0
    assert all(on[ph] == (0.0, 0.0) for ph in on if ph not in ("decoder layers", "span head"))
    assert {ph: sum(v) for ph, v in on.items()} == pytest.approx({ph: sum(v) for ph, v in off.items()}, rel=1e-12)
    m, a, T = st.backend.model, p.demo_start, p.demo_end - p.demo_start
    per_token = 2 * (m.d * (m.H + 2 * m.Hk) * m.hd + m.H * m.hd * m.d + 3 * m.d * m.layers[0].w.inter)
    # scope 'prompt': the prefix rows run once in every step's pass, beside the B batch rows
    assert on["decoder layers"][1] == len(m.layers) * (st.spec.B * T + a) * per_token
    high, low = on["decoder layers"]
    floor = floor_of(st, Rates(high=10.0, low=40.0, shape="-", high_dtype="float32"))
    assert floor.phases["decoder layers"] == pytest.approx(high / 10e6 + low / 40e6, rel=1e-12)
    assert floor.ms == pytest.approx(sum(h / 10e6 + lo / 40e6 for h, lo in on.values()), rel=1e-12)


def test_profile_table_and_counts(models):
    be = make_backend("fast", models["gemma2"], diff_matmul="bf16", impl="torch")
    p = make_prompt(6)
    lines: list[str] = []
    prof = profile_step(be, CFG, p, repeats=2, progress=lines.append)
    assert [r[0] for r in prof.rows] == list(PHASES)
    # the progress: each round as it ends, then each phase's best (host overhead included), then the rates
    assert [ln.split(":")[0] for ln in lines[:-1]] == ["round 1/2", "round 2/2", *PHASES, "refresh"]
    assert lines[-1] == prof.floor.rates.line()
    assert lines[2 + PHASES.index("host overhead")].endswith(f"of the step's best, {prof.step_ms:.2f} ms)")
    assert all(r[1] >= 0 for r in prof.rows) and prof.step_ms > 0 and prof.peak_mb > 0 and prof.peak_gflops > 0
    assert abs(sum(r[2] for r in prof.rows) - 1.0) < 1e-9 or sum(r[1] for r in prof.rows[:-1]) > prof.step_ms
    st = StaticStep(be, Calibrator(be, CFG).config, p, be.embed(p))
    again = kernels_per_step(st)  # deterministic: the same kernels every step
    assert prof.kernels == again and again.layers > 10 * len(be.model.layers) and again.rest > 0
    text = prof.markdown()
    for phase in PHASES:
        assert f"| {phase} |" in text
    assert "kernels per step" in text and "product rates (measured here" in text and "floor" in text
    # the reference refresh outside the step: its time amortised over the steps between two, its kernels
    ref = prof.refresh
    assert ref.every == st.forward.refresh_every == 16 and ref.per_step_ms == ref.ms / 16 and ref.ms > 0
    assert ref.kernels == count_kernels(lambda: st.forward.refresh(st.state.X)) > 0
    assert f"reference refresh: {ref.ms:.2f} ms every 16 steps, {ref.per_step_ms:.3f} ms a step amortised" in text
    assert prof.as_json()["refresh"]["kernels"] == ref.kernels
    assert prof.floor.rates.low is not None and prof.floor.ms > 0  # bf16 difference products: both rates
    assert 0 < prof.floor.phases["decoder layers"] and prof.floor.phases["host overhead"] == 0


@pytest.mark.slow
def test_profile_command_on_smollm2(tmp_path, capsys):
    from sicl_fast.commands.cli import main

    trace = tmp_path / "trace.json"
    assert main(["profile", "--length", "48", "--repeats", "1", "--json", "--trace", str(trace)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "  round 1/1: whole step" in captured.err and "  host overhead: " in captured.err
    assert out["info"]["model"].startswith("smollm2") and out["info"]["backend"] == "fast"
    assert [ph["phase"] for ph in out["phases"]] == list(PHASES)
    assert out["kernels"]["total"] > out["kernels"]["rest"] > 0
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"decoder layers", "whole step"} <= names


def test_kernel_count_rules():
    """Views and allocations launch nothing; an elementwise op is one kernel; a Triton launch is one kernel,
    whatever tensor traffic Triton's CPU interpreter makes inside it."""
    import torch

    from sicl_fast.diagnostics.kernel_count import count_kernels

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
