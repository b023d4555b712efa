"""pytest-benchmark: the eager reference loop vs the static (sync-free) step vs the packed multi-prompt step, on
the CPU, SmolLM2-135M, N = 8 (one run, side by side).

    python -m pytest bench/test_loops_cpu.py --benchmark-only --benchmark-columns=mean,min,max,rounds [--impl cpp]

test_step: one prompt of L tokens, a whole 3-step calibration (patience off), per step; the packed rows time
8 copies of the prompt calibrated together (pack 8) and report the time per prompt-step.
test_prompts: 8 few-shot prompts of mixed lengths (64 to 320 tokens, ~15 % output tokens), 3 steps each,
one by one (eager, static) vs packed 4 and 8 at once; extra_info holds prompts per minute.
On the CPU the difference between eager and static is the host overhead (reads of the device every step), and
the packed step's gain is the larger products; record what it is.
"""
import pytest

from sicl_fast import CalibrationConfig
from sicl_fast.calibration.ascent import Calibrator
from sicl_fast.backends import make_backend
from sicl_fast.diagnostics.benchmark import synthetic_prompt
from sicl_fast.models import load
from sicl_fast.calibration.packed import run_packed
from sicl_fast.calibration.static import run_static

STEPS = 3
CFG = CalibrationConfig(N=8, tau=0.0, patience=0, max_steps=STEPS)
MIXED = (64, 96, 128, 160, 192, 224, 256, 320)


@pytest.fixture(scope="module")
def smol():
    return load()


def calibrate(loop: str, be, prompts, pack: int = 1):
    if loop == "eager":
        return [Calibrator(be, CFG).run(p) for p in prompts]
    if loop == "static":
        return [run_static(be, CFG, p) for p in prompts]
    return run_packed(be, [(p, CFG) for p in prompts], pack=pack)


@pytest.mark.parametrize("length", [128, 512])
@pytest.mark.parametrize("loop", ["eager", "static", "packed"])
def test_step(benchmark, smol, impl, loop, length):
    # plain products everywhere so the three loops do the same arithmetic (packed has no difference products)
    be = make_backend("fast-fp32", smol, impl=impl)
    p = synthetic_prompt(smol, length)
    prompts = [p] * (8 if loop == "packed" else 1)
    calibrate(loop, be, prompts[:1], pack=1)  # warm-up
    benchmark.group = f"per step L={length}"
    benchmark.extra_info.update(impl=be.ops.name, L=p.length, prompt_steps=len(prompts) * STEPS)
    benchmark.pedantic(calibrate, args=(loop, be, prompts, 8), rounds=1, warmup_rounds=0)
    benchmark.extra_info["s_per_prompt_step"] = benchmark.stats.stats.mean / (len(prompts) * STEPS)


@pytest.mark.parametrize("mode", ["eager", "static", "packed-4", "packed-8"])
def test_prompts(benchmark, smol, impl, mode):
    be = make_backend("fast-fp32", smol, impl=impl)
    prompts = [synthetic_prompt(smol, n, seed=i) for i, n in enumerate(MIXED)]
    loop, pack = (mode.split("-")[0], int(mode.split("-")[1])) if "-" in mode else (mode, 1)
    benchmark.group = "8 mixed prompts, 3 steps each"
    benchmark.extra_info.update(impl=be.ops.name, lengths=[p.length for p in prompts])
    benchmark.pedantic(calibrate, args=(loop, be, prompts, pack), rounds=1, warmup_rounds=0)
    benchmark.extra_info["prompts_per_minute"] = 60 * len(prompts) / benchmark.stats.stats.mean
