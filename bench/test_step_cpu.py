"""pytest-benchmark: one ascent step (N=8) of SmolLM2 on the CPU, fast (bf16 difference products), fast-fp32 and hf
backends vs the naive form, L in {128, 512, 1024}.

    pytest bench/test_step_cpu.py --benchmark-only --benchmark-columns=mean,min,max,rounds [--impl cpp]

Peak extra tensor memory of one step (torch profiler memory events, see sicl_fast.diagnostics.benchmark.PeakMemory) is
stored in each benchmark's extra_info (MiB), with the implementation of the hot ops that ran (`--impl`, default auto).
"""
import pytest

from sicl_fast import CalibrationConfig
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.benchmark import PeakMemory, one_step, synthetic_prompt
from sicl_fast.calibration.ascent import Calibrator
from sicl_fast.models import load

CFG = CalibrationConfig(N=8, tau=0.0)


@pytest.fixture(scope="module")
def smol():
    return load()


@pytest.mark.parametrize("length", [128, 512, 1024])
@pytest.mark.parametrize("backend", ["fast", "fast-fp32", "hf", "naive"])
def test_ascent_step(benchmark, smol, impl, backend, length):
    be = make_backend(backend, smol, impl=impl)
    prompt = synthetic_prompt(smol, length)
    cal = Calibrator(be, CFG)
    X0 = be.embed(prompt)
    one_step(cal, prompt, X0, X0)  # warm-up: lazy set-up is not part of a step's memory
    with PeakMemory(be.device) as mem:
        one_step(cal, prompt, X0, X0)
    benchmark.extra_info.update(peak_mb=round(mem.peak_mb), L=prompt.length, P=int(prompt.positions.numel()),
                                impl=be.ops.name)
    benchmark.group = f"step L={length}"
    benchmark.pedantic(one_step, args=(cal, prompt, X0, X0), rounds=3, warmup_rounds=1)
