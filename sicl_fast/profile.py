"""Where the time of one ascent step goes: `sicl-fast profile`.

Each phase of the static step (sicl_fast.static) is run on its own, on the step's own buffers, and timed
(best of `repeats`, synchronised on a GPU); "host overhead" is what the whole step takes beyond the phases.

    perturb           ops.perturb: the [B, b, d] batch, noise drawn in place
    prefix            the prefix rows' K/V (batch 1; every step when the projection may rescale them)
    decoder layers    the model's forward over rows [a, b) of the B batch rows
    span head         the LM head and log-sum-exp at the P span positions
    proxy             f, C, R, G from the [B, P] log-probs
    update            gradient estimate, clip, step, cosine projection
    host overhead     the whole step minus the phases above

FLOPs are counted from the shapes (2 per multiply-add of every product; attention's QK^T and PV over the keys
each query sees; the elementwise work is not counted). Achieved FLOP/s is compared with the machine's measured
product rate at the step's largest product shape in the model dtype. `kernels per step` counts the step's
dispatched torch operations that launch a kernel (not views, not allocations), plus every Triton launch and C++
extension call, in all and in the decoder's layers (on a GPU the profiler's kernel events are the count that
matters; this count, the same on any device, is its proxy). The fast backend's budget with impl 'triton' and
difference products off: at most 14 per decoder layer plus 40 for the rest (tests/test_fused_decoder.py).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from .benchmark import PeakMemory, native_stderr_silenced
from .checks import calibration_inputs
from .kernel_count import count_kernels, cuda_kernel_events
from .spec import resolve_scale
from .static import StaticStep

PHASES = ("perturb", "prefix", "decoder layers", "span head", "proxy", "update", "host overhead")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, repeats: int) -> float:
    """Best wall time of fn() in ms over `repeats` calls after one warm-up (the least disturbed by other work
    on the machine)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t))
    return min(times)


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


def decoder_call(st: StaticStep, prefix):
    """The decoder's forward over the batch of the static step `st`, as the step runs it (rows [a, b) on the
    prefix K/V `prefix` = st._prefix() when there is one, without autograd): a callable returning the hidden
    states [B, T, d]."""
    m, p = st.backend.model, st.prompt
    a, x = p.demo_start, st.batch[:, :p.demo_end].to(m.dtype)

    @torch.no_grad()
    def forward() -> torch.Tensor:
        return m.forward(x[:, a:], a, prefix, near_row0=True) if prefix is not None else m.forward(x, near_row0=True)
    return forward


def kernels_per_step(st: StaticStep) -> KernelCount:
    """The KernelCount of one call of the static step `st` (a step, then the decoder's forward of its batch on
    its own: the step's state moves on, the count is the same every step)."""
    total = count_kernels(st)
    layers = count_kernels(decoder_call(st, st._prefix()))
    events = cuda_kernel_events(st) if torch.device(st.backend.device).type == "cuda" else None
    return KernelCount(total=total, layers=layers, n_layers=len(st.backend.model.layers), cuda_events=events)


def step_flops(st: StaticStep) -> dict[str, float]:
    """FLOPs of each phase of one step of `st` (module docstring)."""
    m, spec, p = st.backend.model, st.spec, st.prompt
    B, a, b = spec.B, p.demo_start, p.demo_end
    d, H, Hk, hd = m.d, m.H, m.Hk, m.hd
    inter = m.layers[0].w_gate.shape[0]
    per_token = 2 * (d * (H + 2 * Hk) * hd + H * hd * d + 3 * d * inter)  # q, k, v, o, gate, up, down
    n_layers = len(m.layers)
    prefix_rows = a if st.use_prefix else 0
    rows = b - prefix_rows  # rows each batch row runs

    def attention(T: int, k0: int) -> float:  # T queries at positions k0.., causal over k0 + i + 1 keys each
        keys = T * k0 + T * (T + 1) / 2
        return 2 * 2 * H * hd * keys

    V = m.head.shape[0]
    P = int(p.positions.numel())
    return {
        "perturb": 0.0,
        "prefix": n_layers * (prefix_rows * per_token + attention(prefix_rows, 0)) if prefix_rows else 0.0,
        "decoder layers": B * n_layers * (rows * per_token + attention(rows, prefix_rows)),
        "span head": 2.0 * B * P * V * d,
        "proxy": 0.0,
        "update": 0.0,
        "host overhead": 0.0,
    }


def matmul_peak(m, rows: int, repeats: int = 5) -> tuple[float, str]:
    """GFLOP/s of the step's largest product shape ([rows, d] x [d, I]) in the model dtype, measured here."""
    dev, dt = m.device, m.dtype
    inter = m.layers[0].w_gate.shape[0]
    x = torch.randn(rows, m.d, device=dev, dtype=dt)
    w = torch.randn(inter, m.d, device=dev, dtype=dt)
    ms = time_ms(lambda: torch.nn.functional.linear(x, w), dev, repeats)
    return 2.0 * rows * m.d * inter / ms / 1e6, f"[{rows}, {m.d}] x [{m.d}, {inter}] {str(dt).replace('torch.', '')}"


@dataclass
class Profile:
    rows: list = field(default_factory=list)  # (phase, ms, share, GFLOP, GFLOP/s, % of peak)
    step_ms: float = 0.0
    peak_mb: float = 0.0
    peak_gflops: float = 0.0
    peak_shape: str = ""
    kernels: KernelCount | None = None
    info: dict = field(default_factory=dict)

    def markdown(self) -> str:
        i = self.info
        lines = [f"# one ascent step: {i['model']}, backend {i['backend']}, impl {i['impl']}, {i['dtype']}, "
                 f"{i['device']}; L {i['L']} (prefix {i['a']}, rows [{i['a']}, {i['b']})), P {i['P']}, N {i['N']}, "
                 f"B {i['B']}", "",
                 "| phase | ms | share | GFLOP | GFLOP/s | % of matmul peak |", "|---|---|---|---|---|---|"]
        for ph, ms, share, gf, rate, pct in self.rows:
            lines.append(f"| {ph} | {ms:.2f} | {100 * share:.1f}% | {gf:.3f} | "
                         f"{'-' if rate is None else f'{rate:.1f}'} | {'-' if pct is None else f'{pct:.1f}%'} |")
        total = sum(r[3] for r in self.rows)
        lines += ["", f"whole step: {self.step_ms:.2f} ms, {total:.3f} GFLOP, "
                      f"{total / self.step_ms * 1e3:.1f} GFLOP/s ({100 * total / self.step_ms * 1e3 / self.peak_gflops:.1f}% "
                      f"of the matmul peak)",
                  f"matmul peak (measured here): {self.peak_gflops:.1f} GFLOP/s at {self.peak_shape}",
                  f"peak extra memory of one step: {self.peak_mb:.1f} MiB",
                  self.kernels.line()]
        return "\n".join(lines)


@torch.no_grad()
def profile_step(backend, config, prompt, repeats: int = 5, trace: str | None = None, on_phase=None) -> Profile:
    """Profile one ascent step of `prompt` on `backend` (module docstring). trace: write a torch.profiler Chrome
    trace of one step there (with NVTX ranges per phase on CUDA). on_phase(name, ms): each phase's time as soon as
    it is measured (the command's progress; the table needs the whole step first)."""
    config = resolve_scale(config, backend.lm)
    st = StaticStep(backend, config, prompt, calibration_inputs(backend, prompt, config))
    dev, m, ops, spec, state = backend.device, backend.model, backend.ops, st.spec, st.state
    a = prompt.demo_start
    prefix = st._prefix()
    layers = decoder_call(st, prefix)
    h = layers()
    span = st.span
    idx = span.idx_suffix if prefix is not None and not span.from_prefix else span.idx
    hs = h.index_select(1, idx) if not (prefix is not None and span.from_prefix) else torch.cat(
        [prefix.hidden.expand(h.shape[0], -1, -1), h], 1).index_select(1, idx)
    lp = ops.span_head(hs, m.head, span.targets, softcap=m.final_softcap)
    f = ops.proxy_planned(lp, st.proxy_plan).f
    phases = {
        "perturb": lambda: ops.perturb(state.X, state.step_t, spec, out=st.batch),
        "prefix": (lambda: m.prefix_kv(state.X[:a].to(m.dtype))) if st.use_prefix and st.prefix is None else None,
        "decoder layers": layers,
        "span head": lambda: ops.span_head(hs, m.head, span.targets, softcap=m.final_softcap),
        "proxy": lambda: ops.proxy_planned(lp, st.proxy_plan),
        "update": lambda: ops.update(state.X, state.X0, f, state.step_t, spec, out=state.X_next),
    }
    times = {}
    for k, fn in phases.items():
        times[k] = time_ms(fn, dev, repeats) if fn is not None else 0.0
        if on_phase is not None:
            on_phase(k, times[k])
    step_ms = time_ms(st, dev, repeats)
    if on_phase is not None:
        on_phase("whole step", step_ms)
    times["host overhead"] = max(0.0, step_ms - sum(times.values()))
    flops = step_flops(st)
    rows = spec.B * (prompt.demo_end - (a if st.use_prefix else 0))
    peak, shape = matmul_peak(m, rows)
    out = Profile(step_ms=step_ms, peak_gflops=peak, peak_shape=shape)
    for ph in PHASES:
        gf = flops[ph] / 1e9
        rate = gf / times[ph] * 1e3 if gf and times[ph] else None
        out.rows.append((ph, times[ph], times[ph] / step_ms, gf, rate, None if rate is None else 100 * rate / peak))
    with PeakMemory(dev) as mem:
        st()
    out.peak_mb = mem.peak_mb
    out.kernels = kernels_per_step(st)
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
                if fn is not None:
                    with nvtx(name, dev), torch.profiler.record_function(name):
                        fn()
            with nvtx("whole step", dev), torch.profiler.record_function("whole step"):
                st()
        finally:
            with native_stderr_silenced():
                prof.__exit__(None, None, None)
        prof.export_chrome_trace(trace)
    return out


__all__ = ["Profile", "profile_step", "count_kernels", "kernels_per_step", "KernelCount", "step_flops", "PHASES"]
