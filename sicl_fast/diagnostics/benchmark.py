"""Timing and peak memory of one ascent step and of a whole calibration (used by `sicl-fast bench` and bench/).

Peak memory: extra tensor memory of one call (PeakMemory: CUDA's allocator statistics, or the torch profiler's
memory events on the CPU).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from ..calibration.ascent import CalibrationConfig, Calibrator
from ..run.checks import calibration_inputs
from ..errors import SiclError
from ..calibration.packed import PackedStep, run_packed
from ..formats.requests import render_structured
from ..formats.spans import Prompt, tokenize
from ..calibration.static import StaticStep, StepCache, run_static
from ..calibration.step_plan import plan_step

_WORDS = ("river stone light paper green quiet seven market window garden silver morning table yellow north "
          "winter coffee letter bridge forest candle orange music rocket planet school doctor animal").split()


def synthetic_prompt(lm, length: int, output_fraction: float = 0.15, seed: int = 0, prefix: int = 0) -> Prompt:
    """A structured few-shot prompt of `length` tokens (or a few fewer), about `output_fraction` of the
    demonstration tokens in output spans, made of random common words; deterministic for a seed. `prefix` > 0
    puts an instruction of about that many tokens before the demonstrations (the fixed prefix). The query is
    padded to reach the length."""
    rng = random.Random(seed)
    demos: list[dict] = []
    query: list[str] = []
    instruction = " ".join(rng.choices(_WORDS, k=prefix)) if prefix else None

    def render():
        return tokenize(render_structured("bench", demos, " ".join(query), instruction=instruction), lm.tokenizer)

    # a demonstration is ~6 template tokens + inputs + 3 output words (~1 token a word)
    in_words = max(1, round(3 / output_fraction - 3 - 6))
    while True:
        demos.append({"input": " ".join(rng.choices(_WORDS, k=in_words)), "output": " ".join(rng.choices(_WORDS, k=3))})
        if render().length > length:
            demos.pop()
            break
    if not demos:
        raise SiclError(f"synthetic_prompt: length {length} is too short for one demonstration")
    while True:
        query.append(rng.choice(_WORDS))
        if render().length > length:
            query.pop()
            break
    return render()


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 goes to /dev/null inside the block. The torch profiler's C++ side (kineto) writes
    "USDT ... profiler_start / profiler_stop" lines straight to fd 2 whatever the log level; they would land in
    the middle of `sicl-fast bench`'s table."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class PeakMemory:
    """Context manager: .peak_mb = peak extra tensor memory (MiB) allocated inside the block.

    CUDA: torch.cuda.max_memory_allocated above the level at entry. CPU: the torch profiler's memory events: the
    highest running sum of tensor allocations minus frees, in time order (tensors only; not the allocator's
    cached pages or a C++ op's own small scratch buffers).
    """

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.peak_mb = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with native_stderr_silenced():
                self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
            return
        with native_stderr_silenced():
            self._prof.__exit__(*exc)
        events = sorted((e for e in self._prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
        cur = peak = 0
        for e in events:
            cur += e.self_cpu_memory_usage
            peak = max(peak, cur)
        self.peak_mb = peak / 2**20


def peak_mb(fn, device="cpu") -> float:
    """Peak extra tensor memory (MiB) of one call of fn() (see PeakMemory)."""
    with PeakMemory(device) as mem:
        fn()
    return mem.peak_mb


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def one_step(cal: Calibrator, prompt: Prompt, X: torch.Tensor, X0: torch.Tensor, step: int = 0, forward=None):
    """One ascent step: perturbation batch -> forward -> proxy -> gradient estimate (or: forward and backward of
    row 0 -> exact gradient), then clip, update, projection (Calibrator.evaluate / move). forward: the run's
    step forward (Calibrator.forward; None: one made for this step)."""
    spec = cal.step_spec(prompt, X0)
    f, g = cal.evaluate(X, prompt, spec, step, forward)
    return cal.move(X, X0, f, g, spec, step)[0]


def step_runner(backend, prompt: Prompt, config: CalibrationConfig) -> tuple[Callable[[], None], str]:
    """(one ascent step of `prompt` as the backend's run plan runs a calibration, what it is): the eager loop's
    step from X0 (one_step); the static step, replayed from its CUDA graph when the plan's graphs are on; with pack
    > 1, the packed step of `pack` copies of the prompt (one call steps them all)."""
    plan = backend.plan
    config = config.resolve_scale(backend.lm)
    X0 = calibration_inputs(backend, prompt, config)
    if plan.loop_for(config.estimator) == "eager":
        cal, steps = Calibrator(backend, config), itertools.count()
        spec = cal.step_spec(prompt, X0)
        forward = None if spec.grad else cal.forward(prompt, spec, X0)

        @torch.no_grad()
        def eager() -> None:
            one_step(cal, prompt, X0, X0, next(steps), forward)
        return eager, "eager"
    plan.check_pack(config.estimator)
    if plan.pack > 1:
        slots = [StaticStep(backend, config, prompt, X0, use_prefix=False, own_forward=False)
                 for _ in range(plan.pack)]
        return PackedStep(backend, slots), f"packed x{plan.pack}"
    if plan.graphs:
        return StepCache(backend.device, 1).get(backend, *plan_step(backend, config, prompt, X0))[1], "static, graph"
    return StaticStep(backend, config, prompt, X0), "static"


def bench_step(backend, prompt: Prompt, config: CalibrationConfig, repeats: int = 3, warmup: int = 1) -> dict:
    """ms per ascent step (mean, min over `repeats`) and peak extra memory of one step, as the backend's run plan
    steps (step_runner; `loop` says which)."""
    step, loop = step_runner(backend, prompt, config)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(backend.device)
        t = time.perf_counter()
        step()
        _sync(backend.device)
        times.append(time.perf_counter() - t)
    with PeakMemory(backend.device) as mem:
        step()
    return {"backend": backend.name, "impl": backend.ops.name, "loop": loop, "L": prompt.length,
            "P": int(prompt.positions.numel()), "N": config.N, "B": config.batch,
            "ms_mean": 1e3 * statistics.mean(times), "ms_min": 1e3 * min(times), "peak_mb": mem.peak_mb}


def bench_calibration(backend, prompt: Prompt, config: CalibrationConfig) -> dict:
    """Wall time and peak extra memory of a whole calibration as the backend's run plan runs it (use patience=0 for
    a fixed step count): the eager loop, the static step (read every sync_every steps; from its CUDA graph when the
    plan's graphs are on) or, with pack > 1, `pack` copies of the prompt packed (steps and time of all)."""
    plan = backend.plan
    with PeakMemory(backend.device) as mem:
        t0 = time.perf_counter()
        if plan.loop_for(config.estimator) == "eager":
            results = [Calibrator(backend, config).run(prompt)]
        elif plan.pack > 1:
            plan.check_pack(config.estimator)
            results = run_packed(backend, [(prompt, config)] * plan.pack, plan.pack, plan.sync_every)
        else:
            steps = StepCache(backend.device, 1) if plan.graphs else None
            results = [run_static(backend, config, prompt, sync_every=plan.sync_every, steps=steps)]
        seconds = time.perf_counter() - t0
    n = sum(r.steps for r in results)
    return {"backend": backend.name, "impl": results[0].impl, "L": prompt.length, "N": config.N, "steps": n,
            "seconds": seconds, "ms_per_step": 1e3 * seconds / max(n, 1), "peak_mb": mem.peak_mb}
