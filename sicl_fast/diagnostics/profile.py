"""Where the time of one ascent step goes: `sicl-fast profile`.

Each phase of the static step (sicl_fast.calibration.static) is run on its own, on the step's own buffers, and timed
(best of `repeats`, synchronised on a GPU; the phases and the whole step in turn, round after round, so that all
see the same machine load); "host overhead" is what the whole step takes beyond the phases.

    perturb           ops.perturb: the [B, b, d] batch, noise drawn in place
    decoder layers    the step forward's decoder (StepForward.decoder): the B batch rows [a, b) (or [0, b)), and the
                      prefix rows once (batch 1) where they run every step (the projection may rescale them)
    span head         the LM head and log-sum-exp at the P span positions
    proxy             f, C, R, G from the [B, P] log-probs
    update            gradient estimate, clip, step, cosine projection
    host overhead     the whole step minus the phases above

and, outside the step, the difference form's refresh of its value rows' float32 reference (StepForward.refresh,
every REFRESH_EVERY steps; on CUDA a graph of its own): its time, that time amortised over the steps between two
refreshes, and its kernels (a line below the table).

FLOPs are counted from the shapes (2 per multiply-add of every product; attention's QK^T and PV over the keys
each query sees; the elementwise work is not counted), split by the precision each product runs in: in the
difference form (sicl_fast.models.rows) every projection and the span head are bf16 products and the attention is
float32; in the plain forward everything is in the model dtype. Both product rates are measured here, at the step's
largest product shape (`measure_rates`), and each phase is compared with its floor: its FLOPs of each precision at
that precision's rate. The step's floor is the sum of its phases' floors (`step_floor`; `sicl-fast bench` prints it
too). `kernels per step` counts the step's
dispatched torch operations that launch a kernel (not views, not allocations), plus every Triton launch and C++
extension call, in all and in the decoder's layers (on a GPU the profiler's kernel events are the count that
matters; this count, the same on any device, is its proxy). The default step's budget (the difference form with the
fused C++ or Triton ops): at most 9 per decoder layer plus 30 for the rest (tests/test_fused_decoder.py,
tests/test_cpp_launch_budget.py).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from .benchmark import PeakMemory, native_stderr_silenced
from ..run.checks import calibration_inputs
from .kernel_count import count_kernels, cuda_kernel_events
from ..calibration.static import StaticStep

PHASES = ("perturb", "decoder layers", "span head", "proxy", "update", "host overhead")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def once_ms(fn, device) -> float:
    """Wall time of one fn() call in ms (synchronised on a GPU)."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t)


def time_ms(fn, device, repeats: int) -> float:
    """Best wall time of fn() in ms over `repeats` calls after one warm-up (the least disturbed by other work
    on the machine)."""
    fn()
    return min(once_ms(fn, device) for _ in range(repeats))


def best_in_turn(fns: dict, device, repeats: int, on_round=None) -> dict:
    """Best wall time in ms of each callable of `fns` after one warm-up each, timed in turn round after round (so
    that all of them see the same machine load). on_round(r, rounds, times): after round r (1-based), that round's
    times."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    rounds = max(1, repeats)
    for r in range(rounds):
        times = {k: once_ms(fn, device) for k, fn in fns.items()}
        best = {k: min(best[k], t) for k, t in times.items()}
        if on_round is not None:
            on_round(r + 1, rounds, times)
    return best


@contextlib.contextmanager
def nvtx(name: str, device):
    """An NVTX range on CUDA (for Nsight and the profiler's trace); nothing elsewhere."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


@dataclass(frozen=True)
class KernelCount:
    """Kernels of one step: in all, in the decoder's forward over the batch (its layers), and per layer."""

    total: int
    layers: int
    n_layers: int
    cuda_events: int | None = None  # on CUDA: the profiler's kernel events of one step

    @property
    def per_layer(self) -> float:
        return self.layers / self.n_layers

    @property
    def rest(self) -> int:  # embedding rows, perturbation, span head, proxy, update, bookkeeping
        return self.total - self.layers

    def line(self) -> str:
        cuda = "" if self.cuda_events is None else f"; CUDA kernel events: {self.cuda_events}"
        return (f"kernels per step: {self.total} ({self.per_layer:.1f} per decoder layer x {self.n_layers} layers "
                f"+ {self.rest} for the rest; dispatched torch ops that launch a kernel + Triton launches + C++ "
                f"calls{cuda})")


def layers_call(st: StaticStep):
    """The decoder's layers alone on the batch of the static step `st`, as its forward runs them: a callable (the
    difference form's forward_rows on the step's input rows; or the plain forward of the batch rows, after the
    prefix rows' own forward where they run every step)."""
    fwd, m = st.forward, st.backend.model
    if fwd.rows_on:
        x = fwd.rows_input(st.batch)
        return lambda: fwd.layers(x)
    x, a = st.batch[:, :st.prompt.demo_end].to(m.dtype), st.prompt.demo_start
    if fwd.policy == "none":
        return lambda: m.forward(x)
    if fwd.policy == "kept":
        return lambda: m.forward(x[:, a:], a, fwd.prefix)
    return lambda: m.forward(x[:, a:], a, m.prefix_kv(x[0, :a]))  # 'pass': the prefix's own batch-1 forward too


def kernels_per_step(st: StaticStep) -> KernelCount:
    """The KernelCount of one call of the static step `st` (a step, then the decoder's layers on its batch on
    their own: the step's state moves on, the count is the same every step)."""
    total = count_kernels(st)
    layers = count_kernels(torch.no_grad()(layers_call(st)))
    events = cuda_kernel_events(st) if torch.device(st.backend.device).type == "cuda" else None
    return KernelCount(total=total, layers=layers, n_layers=len(st.backend.model.layers), cuda_events=events)


def step_flops(st: StaticStep) -> dict[str, float]:
    """FLOPs of each phase of one step of `st` (module docstring)."""
    return {ph: high + low for ph, (high, low) in step_flops_by_precision(st).items()}


def step_flops_by_precision(st: StaticStep) -> dict[str, tuple[float, float]]:
    """Per phase of one step of `st`, (FLOPs at the high precision: the model dtype's plain products, float32
    attention; FLOPs of the difference form's bf16 products)."""
    m, spec, p, fwd = st.backend.model, st.spec, st.prompt, st.forward
    B, a, b = spec.B, p.demo_start, p.demo_end
    d, H, Hk, hd = m.d, m.H, m.Hk, m.hd
    inter = m.layers[0].w.inter
    per_token = 2 * (d * (H + 2 * Hk) * hd + H * hd * d + 3 * d * inter)  # q, k, v, o, gate, up, down
    n_layers = len(m.layers)
    start = fwd.start  # the first row each batch row runs
    T = b - start
    prefix_rows = a if fwd.policy == "pass" else 0  # the prefix rows that run every step, once

    def attention(T: int, k0: int) -> float:  # T queries at positions k0.., causal over k0 + i + 1 keys each
        keys = T * k0 + T * (T + 1) / 2
        return 2 * 2 * H * hd * keys

    V = m.head.shape[0]
    P = int(p.positions.numel())
    att = n_layers * (B * attention(T, start) + (attention(prefix_rows, 0) if prefix_rows else 0.0))
    products = n_layers * (B * T + prefix_rows) * per_token
    head = 2.0 * B * P * V * d
    rows = fwd.rows_on
    return {
        "perturb": (0.0, 0.0),
        "decoder layers": (att, products) if rows else (att + products, 0.0),
        "span head": (0.0, head) if rows else (head, 0.0),
        "proxy": (0.0, 0.0),
        "update": (0.0, 0.0),
        "host overhead": (0.0, 0.0),
    }


@dataclass(frozen=True)
class Rates:
    """Product rates measured on the spot (GFLOP/s) at one shape: at the high precision (`high`: float32 in the
    difference form, else the model dtype) and in bf16 (`low`, None when the step has no difference-form
    products)."""

    high: float
    low: float | None
    shape: str
    high_dtype: str

    def line(self) -> str:
        low = "" if self.low is None else f", bf16 {self.low:.1f} ({self.low / self.high:.2f}x)"
        return f"product rates (measured here, {self.shape}): {self.high_dtype} {self.high:.1f}{low} GFLOP/s"


def measure_rates(m, rows: int, low: bool, repeats: int = 5) -> Rates:
    """The Rates of the step's largest product shape ([rows, d] x [d, I], F.linear) on the model m's device, at
    the high precision (float32 when `low`, else the model dtype) and, when `low`, in bf16: the two timed
    alternately, so both see the same machine load."""
    dev, dt = m.device, (torch.float32 if low else m.dtype)
    inter = m.layers[0].w.inter
    x = torch.randn(rows, m.d, device=dev, dtype=dt)
    w = torch.randn(inter, m.d, device=dev, dtype=dt)
    fns = {"high": lambda: torch.nn.functional.linear(x, w)}
    if low:
        xb, wb = x.bfloat16(), w.bfloat16()
        fns["low"] = lambda: torch.nn.functional.linear(xb, wb)
    best = best_in_turn(fns, dev, repeats)
    flop = 2.0 * rows * m.d * inter
    name = str(dt).replace("torch.", "")
    return Rates(high=flop / best["high"] / 1e6, low=flop / best["low"] / 1e6 if low else None,
                 shape=f"[{rows}, {m.d}] x [{m.d}, {inter}]", high_dtype=name)


@dataclass(frozen=True)
class Floor:
    """The least time one step could take at the measured product rates: per phase, its FLOPs of each precision at
    that precision's rate (ms), and their sum."""

    phases: dict
    rates: Rates

    @property
    def ms(self) -> float:
        return sum(self.phases.values())


def floor_of(st: StaticStep, rates: Rates) -> Floor:
    phases = {}
    for ph, (high, low) in step_flops_by_precision(st).items():
        phases[ph] = high / rates.high / 1e6 + (low / rates.low / 1e6 if low else 0.0)
    return Floor(phases=phases, rates=rates)


def step_rows(st: StaticStep) -> int:
    """Token rows of the step's decoder forward over the batch (the product shape the rates are measured at)."""
    return st.spec.B * (st.prompt.demo_end - st.forward.start)


@torch.no_grad()
def step_floor(backend, config, prompt, repeats: int = 5) -> Floor | None:
    """The Floor of one ascent step of `prompt` on the fast backend `backend` (rates measured here); None for the
    other backends (their forward is not ours to count)."""
    if not hasattr(getattr(backend, "model", None), "layers"):
        return None
    config = config.resolve_scale(backend.lm)
    st = StaticStep(backend, config, prompt, calibration_inputs(backend, prompt, config))
    return floor_of(st, measure_rates(backend.model, step_rows(st), st.forward.rows_on, repeats))


@dataclass(frozen=True)
class Refresh:
    """The value rows' reference refresh of the difference form (module docstring): its best time, the steps
    between two refreshes, its kernels."""

    ms: float
    every: int
    kernels: int

    @property
    def per_step_ms(self) -> float:
        return self.ms / self.every

    def line(self, step_ms: float, step_kernels: int) -> str:
        return (f"reference refresh: {self.ms:.2f} ms every {self.every} steps, {self.per_step_ms:.3f} ms a step "
                f"amortised ({100 * self.per_step_ms / step_ms:.1f}% of the step); {self.kernels} kernels "
                f"({self.kernels / step_kernels:.2f} steps' worth)")


@dataclass
class Profile:
    rows: list = field(default_factory=list)  # (phase, ms, share, GFLOP, GFLOP/s, floor ms, % of floor)
    step_ms: float = 0.0
    peak_mb: float = 0.0
    floor: Floor | None = None
    kernels: KernelCount | None = None
    refresh: Refresh | None = None  # None: no reference to refresh (plain products)
    info: dict = field(default_factory=dict)

    @property
    def peak_gflops(self) -> float:  # the model dtype's measured product rate
        return self.floor.rates.high

    def markdown(self) -> str:
        i = self.info
        lines = [f"# one ascent step: {i['model']}, backend {i['backend']}, impl {i['impl']}, {i['dtype']}, "
                 f"{i['device']}; L {i['L']} (prefix {i['a']}, rows [{i['a']}, {i['b']})), P {i['P']}, N {i['N']}, "
                 f"B {i['B']}", "",
                 "| phase | ms | share | GFLOP | GFLOP/s | floor ms | floor / ms |", "|---|---|---|---|---|---|---|"]
        for ph, ms, share, gf, rate, floor, pct in self.rows:
            lines.append(f"| {ph} | {ms:.2f} | {100 * share:.1f}% | {gf:.3f} | "
                         f"{'-' if rate is None else f'{rate:.1f}'} | {floor:.2f} | "
                         f"{'-' if pct is None else f'{pct:.1f}%'} |")
        total = sum(r[3] for r in self.rows)
        fl = self.floor
        lines += ["", f"whole step: {self.step_ms:.2f} ms, {total:.3f} GFLOP, "
                      f"{total / self.step_ms * 1e3:.1f} GFLOP/s; floor {fl.ms:.2f} ms (the step is "
                      f"{self.step_ms / fl.ms:.2f}x its floor)",
                  fl.rates.line() + "; a phase's floor: its FLOPs of each precision at that precision's rate "
                  "(bf16: the difference form's products and span head)",
                  f"peak extra memory of one step: {self.peak_mb:.1f} MiB",
                  self.kernels.line()]
        if self.refresh is not None:
            lines.append(self.refresh.line(self.step_ms, self.kernels.total))
        return "\n".join(lines)

    def as_json(self) -> dict:
        r = self.floor.rates
        return {"info": self.info, "step_ms": self.step_ms, "peak_mb": self.peak_mb, "floor_ms": self.floor.ms,
                "kernels": {"total": self.kernels.total, "per_layer": self.kernels.per_layer,
                            "rest": self.kernels.rest},
                "rates": {"shape": r.shape, r.high_dtype: r.high, **({"bfloat16": r.low} if r.low else {})},
                "refresh": None if self.refresh is None else {
                    "ms": self.refresh.ms, "every": self.refresh.every, "per_step_ms": self.refresh.per_step_ms,
                    "kernels": self.refresh.kernels},
                "phases": [dict(zip(("phase", "ms", "share", "gflop", "gflops", "floor_ms", "pct_floor"), row))
                           for row in self.rows]}


@torch.no_grad()
def profile_step(backend, config, prompt, repeats: int = 5, trace: str | None = None, progress=None) -> Profile:
    """Profile one ascent step of `prompt` on `backend` (module docstring). trace: write a torch.profiler Chrome
    trace of one step there (with NVTX ranges per phase on CUDA). progress(line): what is measured, as it is (the
    command's progress): each round's whole step, then each phase's best time and the host overhead, then the
    product rates."""
    say = progress or (lambda line: None)
    config = config.resolve_scale(backend.lm)
    st = StaticStep(backend, config, prompt, calibration_inputs(backend, prompt, config))
    dev, m, ops, spec, state = backend.device, backend.model, backend.ops, st.spec, st.state
    a, fwd = prompt.demo_start, st.forward
    hs = fwd.decoder(st.batch)
    lp = fwd.head(hs)
    f = ops.proxy_planned(lp, st.proxy_plan).f
    phases = {
        "perturb": lambda: ops.perturb(state.X, state.step_t, spec, out=st.batch),
        "decoder layers": lambda: fwd.decoder(st.batch),
        "span head": lambda: fwd.head(hs),
        "proxy": lambda: ops.proxy_planned(lp, st.proxy_plan),
        "update": lambda: ops.update(state.X, state.X0, f, state.step_t, spec, out=state.X_next),
    }
    # the refresh of the value rows' reference, outside the step (the X it reads: the state's, as run_static's)
    refresh = {"refresh": lambda: fwd.refresh(state.X)} if fwd.refresh_every else {}
    # the phases and the whole step timed in turn, round after round (best of each): the step minus its phases is
    # then not a difference of timings taken under different machine loads
    best = best_in_turn({**phases, "whole step": st, **refresh}, dev, repeats,
                        on_round=lambda r, n, t: say(f"round {r}/{n}: whole step {t['whole step']:.2f} ms, its "
                                                     f"phases {sum(t[k] for k in phases):.2f} ms"))
    step_ms = best.pop("whole step")
    times = {k: best.get(k, 0.0) for k in phases}
    times["host overhead"] = max(0.0, step_ms - sum(times.values()))
    for k in PHASES:
        say(f"{k}: {times[k]:.2f} ms ({100 * times[k] / step_ms:.1f}% of the step's best, {step_ms:.2f} ms)")
    if refresh:
        ms = best.pop("refresh")
        say(f"refresh: {ms:.2f} ms every {fwd.refresh_every} steps ({ms / fwd.refresh_every:.3f} ms a step)")
    flops = step_flops(st)
    floor = floor_of(st, measure_rates(m, step_rows(st), fwd.rows_on))
    say(floor.rates.line())
    out = Profile(step_ms=step_ms, floor=floor)
    for ph in PHASES:
        gf, fl = flops[ph] / 1e9, floor.phases[ph]
        rate = gf / times[ph] * 1e3 if gf and times[ph] else None
        pct = 100 * fl / times[ph] if gf and times[ph] else None
        out.rows.append((ph, times[ph], times[ph] / step_ms, gf, rate, fl, pct))
    with PeakMemory(dev) as mem:
        st()
    out.peak_mb = mem.peak_mb
    out.kernels = kernels_per_step(st)
    if refresh:
        out.refresh = Refresh(ms=ms, every=fwd.refresh_every, kernels=count_kernels(refresh["refresh"]))
    out.info = dict(model=backend.lm.name, backend=backend.name, impl=ops.name,
                    dtype=str(m.dtype).replace("torch.", ""), device=str(dev), L=prompt.length, a=a,
                    b=prompt.demo_end, P=int(prompt.positions.numel()), N=spec.N, B=spec.B)
    if trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(dev).type == "cuda" else [])
        prof = profile(activities=acts, record_shapes=True)
        with native_stderr_silenced():  # the profiler's own start / stop lines
            prof.__enter__()
        try:
            for name, fn in phases.items():
                with nvtx(name, dev), torch.profiler.record_function(name):
                    fn()
            with nvtx("whole step", dev), torch.profiler.record_function("whole step"):
                st()
        finally:
            with native_stderr_silenced():
                prof.__exit__(None, None, None)
        prof.export_chrome_trace(trace)
    return out


__all__ = ["Profile", "Refresh", "profile_step", "count_kernels", "kernels_per_step", "layers_call", "KernelCount",
           "step_flops", "step_flops_by_precision", "Rates", "measure_rates", "Floor", "floor_of", "step_floor",
           "PHASES"]
