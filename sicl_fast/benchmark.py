"""Timing and peak memory of one ascent step and of a whole calibration (used by `sicl-fast bench` and bench/).

Peak memory: on CUDA, torch.cuda.max_memory_allocated; on the CPU, the resident set size sampled every
millisecond by a background thread (torch releases the GIL inside its ops), minus the RSS just before the step.
"""
from __future__ import annotations

import random
import statistics
import threading
import time

import torch

from .ascent import CalibrationConfig, Calibrator
from .requests import render_structured
from .spans import Prompt, tokenize

_WORDS = ("river stone light paper green quiet seven market window garden silver morning table yellow north "
          "winter coffee letter bridge forest candle orange music rocket planet school doctor animal").split()


def synthetic_prompt(lm, length: int, output_fraction: float = 0.15, seed: int = 0) -> Prompt:
    """A structured few-shot prompt of `length` tokens (or a few fewer), about `output_fraction` of them in output
    spans, made of random common words; deterministic for a seed. The query is padded to reach the length."""
    rng = random.Random(seed)
    demos: list[dict] = []
    query: list[str] = []

    def render():
        return tokenize(render_structured("bench", demos, " ".join(query)), lm.tokenizer)

    # a demonstration is ~6 template tokens + inputs + 3 output words (~1 token a word)
    in_words = max(1, round(3 / output_fraction - 3 - 6))
    while True:
        demos.append({"input": " ".join(rng.choices(_WORDS, k=in_words)), "output": " ".join(rng.choices(_WORDS, k=3))})
        if render().length > length:
            demos.pop()
            break
    if not demos:
        raise ValueError(f"length {length} is too short for one demonstration")
    while True:
        query.append(rng.choice(_WORDS))
        if render().length > length:
            query.pop()
            break
    return render()


class PeakMemory:
    """Context manager: .peak_mb = peak extra memory (MiB) inside the block (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.peak_mb = 0.0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = self._peak = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, self._rss())
        self.peak_mb = (peak - self._base) / 2**20


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def one_step(cal: Calibrator, prompt: Prompt, X: torch.Tensor, X0: torch.Tensor, step: int = 0):
    """One ascent step: perturbation batch -> forward -> proxy -> gradient, clip, update, projection."""
    cfg = cal.config
    a, b = prompt.demo_start, prompt.demo_end
    batch = cal.ops.perturb(X, step, cfg, a, b)
    f = cal.proxy_of(batch, prompt).f
    return cal.ops.update(X, X0, f, step, cfg, a, b)[0]


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
    return {"backend": backend.name, "L": prompt.length, "P": int(prompt.positions.numel()), "N": config.N,
            "B": config.batch, "ms_mean": 1e3 * statistics.mean(times), "ms_min": 1e3 * min(times),
            "peak_mb": mem.peak_mb}


def bench_calibration(backend, prompt: Prompt, config: CalibrationConfig) -> dict:
    """Wall time and peak extra memory of a whole calibration (use patience=0 for a fixed step count)."""
    with PeakMemory(backend.device) as mem:
        res = Calibrator(backend, config).run(prompt)
    return {"backend": backend.name, "L": prompt.length, "N": config.N, "steps": res.steps,
            "seconds": res.seconds, "ms_per_step": 1e3 * res.seconds / max(res.steps, 1), "peak_mb": mem.peak_mb}
