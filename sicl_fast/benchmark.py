"""Timing and peak memory of one ascent step and of a whole calibration (used by `sicl-fast bench` and bench/).

Peak memory: extra tensor memory of one call (PeakMemory: CUDA's allocator statistics, or the torch profiler's
memory events on the CPU).
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
import statistics
import time

import torch

from .ascent import CalibrationConfig, Calibrator
from .errors import SiclError
from .requests import render_structured
from .spans import Prompt, tokenize

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


def one_step(cal: Calibrator, prompt: Prompt, X: torch.Tensor, X0: torch.Tensor, step: int = 0):
    """One ascent step: perturbation batch -> forward -> proxy -> gradient estimate (or: forward and backward of
    row 0 -> exact gradient), then clip, update, projection (Calibrator.evaluate / advance)."""
    spec = cal.step_spec(prompt, X0)
    f, g = cal.evaluate(X, prompt, spec, step)
    return cal.advance(X, X0, f, g, spec, step)[0]


def bench_step(backend, prompt: Prompt, config: CalibrationConfig, repeats: int = 3, warmup: int = 1) -> dict:
    """ms per ascent step (mean, min over `repeats`) and peak extra memory of one step."""
    cal = Calibrator(backend, config)
    X0 = backend.embed(prompt)
    for _ in range(warmup):
        one_step(cal, prompt, X0, X0)
    times = []
    with torch.no_grad():
        for r in range(repeats):
            _sync(backend.device)
            t = time.perf_counter()
            one_step(cal, prompt, X0, X0, r)
            _sync(backend.device)
            times.append(time.perf_counter() - t)
        with PeakMemory(backend.device) as mem:
            one_step(cal, prompt, X0, X0)
    return {"backend": backend.name, "impl": backend.ops.name, "L": prompt.length, "P": int(prompt.positions.numel()),
            "N": config.N,
            "B": config.batch, "ms_mean": 1e3 * statistics.mean(times), "ms_min": 1e3 * min(times),
            "peak_mb": mem.peak_mb}


def bench_calibration(backend, prompt: Prompt, config: CalibrationConfig) -> dict:
    """Wall time and peak extra memory of a whole calibration (use patience=0 for a fixed step count)."""
    with PeakMemory(backend.device) as mem:
        res = Calibrator(backend, config).run(prompt)
    return {"backend": backend.name, "impl": res.impl, "L": prompt.length, "N": config.N, "steps": res.steps,
            "seconds": res.seconds, "ms_per_step": 1e3 * res.seconds / max(res.steps, 1), "peak_mb": mem.peak_mb}
