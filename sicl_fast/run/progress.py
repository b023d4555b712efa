"""Progress a person can see on a long command: one bar of requests (records) on stderr, and the step within the
calibration running now on the bar's postfix.

    with progress_bar(total, "calibrate") as bar:
        workers.watch_steps(StepProgress(bar, cfg.max_steps))   # "step 7/250 proxy 0.4123 0.84 s/step"
        ...                                                      # bar.update(1) per record, as before

StepProgress is an on_step(step, proxy) hook (Engine.step_hook): the loops call it only where they read the proxy
back anyway (the static loop at each read of its state, the eager loop once per step), so it adds no host read.
"""
from __future__ import annotations

import sys
import time


def progress_bar(total: int, desc: str, unit: str = "req", disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=disable)


class StepProgress:
    """on_step(step, proxy) -> 'step k/K proxy f s/step' on `bar`'s postfix. step: 0-based (step 0's proxy is the
    prompt's own); a step count that does not grow is a new calibration, and the clock restarts there. s/step is
    measured from the first report of the calibration (the static loop reports a read's steps together). The line
    is redrawn at most every `every` seconds (a log file is not flooded by fast steps); the bar's own update
    draws the latest text too."""

    def __init__(self, bar, max_steps: int, every: float = 0.5) -> None:
        self.bar, self.max_steps, self.every = bar, max_steps, every
        self.last: int | None = None
        self.t0 = self.shown = 0.0
        self.first = 0

    def __call__(self, step: int, proxy: float) -> None:
        now = time.perf_counter()
        if self.last is None or step <= self.last:
            self.t0, self.first = now, step
        self.last = step
        rate = f"{(now - self.t0) / (step - self.first):.2f} s/step" if step > self.first else "- s/step"
        show = now - self.shown >= self.every
        self.bar.set_postfix_str(f"step {step + 1}/{self.max_steps} proxy {proxy:.4f} {rate}", refresh=show)
        if show:
            self.shown = now


__all__ = ["progress_bar", "StepProgress"]
