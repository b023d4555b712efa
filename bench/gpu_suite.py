"""The GPU suite of the GPU-engine issue: one command, under 8 minutes on one H100, every figure beside its
references in the same run, the table appended to bench/RESULTS.md.

    python bench/gpu_suite.py                                   # full suite (CUDA); bench/RESULTS.md + JSON
    python bench/gpu_suite.py --models llama-3.1-8b --lengths 600 --N 8 16
    python bench/gpu_suite.py --smoke --out /tmp/s.json --results /tmp/s.md    # CPU: tiny shapes, seconds

(sicl_fast installed: `pip install -e .`. No network: the models are random weights at the real shapes of
bench/models/*.json, built with transformers' AutoConfig + from_config on the device, in bf16.)

One ascent step, per (model, prompt length L, directions N); prompts of random token ids with about 15 % of
the tokens in output spans over several demonstrations, a 4-token demonstration-free prefix and a query:

    naive        the reference form: transformers forward of the full prompt [N+1, L], full [B, L, V] logits,
                 log_softmax, gather, the proxy (step.proxy), `.item()` of f0 every step, torch.randn
                 directions, the torch update (step.zo)                                   (naive_step)
    hf           Engine(backend="hf"): one step of the eager loop (sicl_fast.diagnostics.benchmark.one_step)
    fast eager   Engine(backend="fast", loop="static", graphs="off"): the sync-free StaticStep, no graph
    fast graphs  Engine(backend="fast", loop="static", graphs="on"): the same step captured in a CUDA graph, as
                 Engine.calibrate replays it (the engine's StepCache); CUDA only
    anchor       torch.compile(mode="reduce-overhead", dynamic=False) (Inductor + CUDA graphs) of the plain
                 transformers forward of the full prompt + full logits + log_softmax + gather at the span
                 positions; CUDA only. It is timed on the forward alone (no perturbation, proxy or update), so
                 our ratio to it is a lower bound. Its first call is its compile latency (cold Inductor cache).

Columns: ms per step (CUDA: triton.testing.do_bench, median; steps over 200 ms: best of 2 synchronised calls;
CPU: best of a few perf_counter repeats), the speed-up over naive and over the anchor, model TFLOP/s and % of
the bf16 dense peak (FLOPs of the step as `sicl-fast profile` counts them, sicl_fast.diagnostics.profile.step_flops, the
same count for every row of a cell; the peak from bench/gpu_kernels.py's PEAKS), the build + first calls in s,
and the peak extra memory (CUDA only: max_memory_allocated after reset_peak_memory_stats, minus what was
allocated before the row was built, which holds the weights), and f0, the proxy of the prompt's own
embeddings each row computed (so the rows are seen to compute the same thing).

Then: the first calibrate call at a new prompt length (a warm engine), a whole 50-step calibration + a 32-token
answer (SmolLM2 shape) with the calibration's seconds for each --sync-every k in (1, 4, 8, 16, 32) (the
measurement that chooses the default k), decode ms per token warm and on a new length, and the packed mode (64
prompts of 128..2100 tokens, 20 steps each, Gemma-2-2B shape: Engine(pack=k) against one by one). Last, the
targets of the issue, each met or missed and by how much.

Budget: cells run most important first (the targets' cells, then the rest of the grid); once --budget-s have
passed, the remaining cells are skipped and listed as skipped. A failing row (out of memory, a missing package)
prints its error and the suite goes on; the exit status is nonzero only for an error that looks like a bug of
the suite itself (NameError, TypeError, AttributeError, ...) or a CUDA run with TRITON_INTERPRET set.
"""
from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts from here, imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))  # bench/ (already first when run as a script): gpu_kernels.PEAKS

import torch  # noqa: E402

from gpu_kernels import PEAKS  # noqa: E402
from sicl_fast.step import zo  # noqa: E402
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator  # noqa: E402
from sicl_fast.diagnostics.benchmark import one_step  # noqa: E402
from sicl_fast.engine import Engine  # noqa: E402
from sicl_fast.models import from_transformers  # noqa: E402
from sicl_fast.diagnostics.profile import step_flops  # noqa: E402
from sicl_fast.diagnostics.profile import time_ms as best_of_ms  # noqa: E402
from sicl_fast.step.proxy import proxy  # noqa: E402
from sicl_fast.formats.requests import Request  # noqa: E402
from sicl_fast.formats.spans import Prompt  # noqa: E402
from sicl_fast.step.spec import StepSpec  # noqa: E402
from sicl_fast.calibration.static import StaticStep  # noqa: E402
from sicl_fast.calibration.step_plan import plan_step  # noqa: E402

MODELS_DIR = HERE / "models"
SMOL, LLAMA, GEMMA, QWEN = "smollm2-135m", "llama-3.1-8b", "gemma-2-2b", "qwen3-4b"
MODEL_ORDER = (SMOL, LLAMA, GEMMA, QWEN)
PREFIX = 4  # demonstration-free prefix tokens of every synthetic prompt
PACKED_CAP_S = 90.0  # the most one packed mode may take, so the rest of the grid keeps some budget
# exceptions that mean the suite itself is wrong, not the machine or the library's limits
BUG_TYPES = (NameError, TypeError, AttributeError, KeyError, IndexError, AssertionError, ZeroDivisionError)


# ------------------------------------------------------------------------------------------------ settings


@dataclass
class Plan:
    """What one run measures. Full: the issue's grid; smoke: tiny shapes that run on a 2-core CPU."""

    smoke: bool
    models: list
    lengths: list
    Ns: list
    L_small: int  # the SmolLM2 step / whole-run / decode length
    L_mid: int  # the Llama / Gemma target cells and the first-call measurement
    new_length_delta: int  # a "new prompt length" is the cell's length plus this
    cal_steps: int  # the whole run's calibration steps
    answer_tokens: int  # the whole run's answer, and the decode measurement
    packed_prompts: int
    packed_lengths: tuple  # (shortest, longest)
    packed_steps: int
    packed_N: int
    pack: int
    anchor: set  # (model, L, N) cells that get the compiled anchor
    budget_s: float
    sync_everys: tuple = (1, 4, 8, 16, 32)  # the whole run's sweep of the steps between two host reads
    do_bench_warmup_ms: int = 10
    do_bench_rep_ms: int = 50
    cpu_repeats: int = 3


def make_plan(args) -> Plan:
    """The Plan of the command line (module docstring; --smoke swaps in the tiny grid)."""
    if args.smoke:
        base = dict(models=[SMOL, GEMMA], lengths=[32, 48], Ns=[2], L_small=32, L_mid=48, new_length_delta=5,
                    cal_steps=3, answer_tokens=4, packed_prompts=3, packed_lengths=(16, 48), packed_steps=2,
                    packed_N=2, pack=2, cpu_repeats=2, sync_everys=(1, 2))
    else:
        base = dict(models=list(MODEL_ORDER), lengths=[256, 600, 2100], Ns=[8, 16], L_small=256, L_mid=600,
                    new_length_delta=37, cal_steps=50, answer_tokens=32, packed_prompts=64,
                    packed_lengths=(128, 2100), packed_steps=20, packed_N=8, pack=8)
    for key in ("models", "lengths", "Ns"):
        given = getattr(args, key.lower() if key != "Ns" else "N")
        if given:
            base[key] = list(given)
    if args.pack:
        base["pack"] = args.pack
    if args.anchor is None:  # the cells the anchor target needs: Llama at the middle length, every N
        anchor = {(LLAMA, base["L_mid"], n) for n in base["Ns"]}
    elif args.anchor == ["all"]:
        anchor = {(m, L, n) for m in base["models"] for L in base["lengths"] for n in base["Ns"]}
    elif args.anchor == ["none"]:
        anchor = set()
    else:
        anchor = set()
        for spec in args.anchor:
            m, L, n = spec.split(":")
            anchor.add((m, int(L), int(n)))
    return Plan(smoke=args.smoke, anchor=anchor, budget_s=args.budget_s, **base)


# ------------------------------------------------------------------------------------------------ models


class IdTokenizer:
    """The tokenizer a random-weight model gets: decoding (sicl_fast.backends.generate) only spells the new token ids
    as text and looks for an EOS id; there is no vocabulary, so ids are written as numbers, and there is no EOS
    (a random model would emit one at an arbitrary step: the answers are timed at a fixed length)."""

    eos_token_id = None
    all_special_ids: tuple = ()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def model_config(name: str) -> tuple[dict, str]:
    """(transformers config fields, HF repo id they come from) of bench/models/NAME.json."""
    spec = json.loads((MODELS_DIR / f"{name}.json").read_text())
    return {k: v for k, v in spec.items() if k != "_source"}, spec["_source"]


def shrink(cfg: dict) -> dict:
    """The smoke form of a real config: same family, rope, soft-caps and tying, 2 layers of width 64 (4 heads of
    16, 2 KV heads), a 4096-token vocabulary and a 16-token sliding window (shorter than the smoke prompts, so
    windowed layers are exercised). initializer_range 0.3 makes the random logits vary by a few nats, so a row
    that read the wrong span positions would show a different f0."""
    small = dict(cfg, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=4096, initializer_range=0.3)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        small.pop(key, None)
    if cfg.get("sliding_window"):
        small["sliding_window"] = 16
    if "query_pre_attn_scalar" in cfg:
        small["query_pre_attn_scalar"] = 16
    return small


def build_model(name: str, smoke: bool, dtype: torch.dtype, device: torch.device):
    """A LoadedModel of random weights at the shape of bench/models/NAME.json (shrunk for --smoke), dtype on
    device, initialised there directly (no CPU copy). Gemma 2 runs transformers' eager attention: its SDPA path
    drops the attention soft-cap, and the naive / hf / anchor rows must compute the model the fast rows do."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    fields, source = model_config(name)
    if smoke:
        fields = shrink(fields)
    fields = dict(fields)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    attn = "eager" if cfg.model_type == "gemma2" else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.generation_config.eos_token_id = None  # fixed-length answers (IdTokenizer)
    label = f"{name} (tiny: 2 layers, d 64)" if smoke else name
    lm = from_transformers(model, IdTokenizer(), name=label)
    lm.extra["source"] = source
    _ = lm.embedding_scale  # computed once now, not inside a row's memory window
    return lm


def span_prompt(L: int, vocab: int, seed: int, output_fraction: float = 0.15) -> Prompt:
    """A Prompt of L random token ids in [0, vocab) (no tokenizer): a PREFIX-token demonstration-free prefix,
    T = clamp(L // 40, 2, 64) demonstrations of equal length, each ending in an output span, the spans holding
    about output_fraction of the L tokens, then a query of max(4, L // 25) tokens."""
    query = max(4, L // 25)
    T = min(64, max(2, L // 40))
    per_demo = (L - PREFIX - query) // T
    out = max(1, min(per_demo - 1, round(output_fraction * L / T)))
    spans = tuple((PREFIX + (i + 1) * per_demo - out, PREFIX + (i + 1) * per_demo) for i in range(T))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (L,), generator=g)
    # the Request only names the prompt; its text and character span are never read on this path
    req = Request(id=f"L{L}-seed{seed}", prompt="x" * (L + 1), output_spans=((1, 2),))
    return Prompt(request=req, input_ids=ids, token_spans=spans, demo_start=PREFIX, demo_end=spans[-1][1])


def step_config(lm, N: int, max_steps: int = 10_000) -> CalibrationConfig:
    """The model's preset with N directions, no gate (tau 0), no early stop (patience 0) and its embedding
    scale resolved, so every row of a cell runs the same steps with the same mu and eta."""
    return CalibrationConfig.for_model(lm, N=N, tau=0.0, patience=0, max_steps=max_steps,
                                       scale=lm.embedding_scale)


# ------------------------------------------------------------------------------------------------ timing


def fast_engine(lm, graphs: bool, **kw) -> Engine:
    """The fast backend's static loop, with CUDA graphs ('on') or without ('off')."""
    return Engine(lm, backend="fast", loop="static", graphs="on" if graphs else "off", **kw)


class Clock:
    """The device's timing and memory, decided once: CUDA (do_bench, allocator statistics) or the CPU
    (perf_counter repeats, no memory figures)."""

    def __init__(self, device: torch.device, plan: Plan) -> None:
        self.device, self.plan = device, plan
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def clean(self) -> None:
        """Free what the last row left (its engine, graphs, buffers) before the next row's baseline."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def start(self) -> int:
        """Bytes allocated now (the row's baseline), with the peak counter reset; 0 on the CPU."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_mib(self, base: int) -> float | None:
        """MiB allocated above `base` at the peak since start(); None on the CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def ms(self, fn, first_ms: float) -> float:
        """Steady-state ms of fn() (already warm). CUDA: do_bench's median (small warm-up and rep, so the whole
        suite fits its budget); a call over 200 ms: the best of 2 synchronised calls. CPU: best of a few."""
        if not self.cuda:
            return best_of_ms(fn, self.device, self.plan.cpu_repeats)
        if first_ms > 200:
            return best_of_ms(fn, self.device, 2)
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=self.plan.do_bench_warmup_ms, rep=self.plan.do_bench_rep_ms,
                              return_mode="median"))

    def seconds(self, fn):
        """(fn()'s result, wall seconds of that one call, synchronised)."""
        self.sync()
        t = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t


# ------------------------------------------------------------------------------------------------ the rows


@dataclass
class Cell:
    """One (model, L, N) cell: its prompt, config (scale resolved), X0 [L, d] float32 and the step's FLOPs
    (sicl_fast.diagnostics.profile.step_flops of the fast StaticStep, filled by the first fast row)."""

    lm: object
    prompt: Prompt
    cfg: CalibrationConfig
    X0: torch.Tensor
    flops: float | None = None


def full_batch(X: torch.Tensor, U: torch.Tensor, spec: StepSpec) -> torch.Tensor:
    """The perturbation batch of the whole prompt: zo.perturb's rows [0, b) [B, b, d] float32 with the query rows
    [b, L) of X appended to every row -> [B, L, d] float32 (the reference runs the full prompt)."""
    batch = zo.perturb(X, U, spec)
    return torch.cat([batch, X[spec.b:].unsqueeze(0).expand(spec.B, -1, -1)], dim=1)


def naive_step(c: Cell):
    """The reference form of one step (module docstring), as (step(), f0 of X0). Its directions come from
    torch.randn, as the reference draws them (the counter-based stream would cost it time no reference pays)."""
    lm, p, cfg = c.lm, c.prompt, c.cfg
    dev = lm.device
    spec = StepSpec.build(cfg, p.length, lm.hidden_size, p.demo_start, p.demo_end)
    pos, tgt = (p.positions - 1).to(dev), p.targets.to(dev)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    state = {"X": c.X0.clone(), "f0": []}

    @torch.no_grad()
    def step() -> None:
        X = state["X"]
        U = torch.randn(spec.N, spec.rows, spec.d, generator=gen, device=dev)
        x = full_batch(X, U, spec).to(lm.dtype)  # [B, L, d]
        logits = lm.model(inputs_embeds=x, use_cache=False).logits.float()  # [B, L, V]
        lp = torch.log_softmax(logits, dim=-1)[:, pos, tgt]  # [B, P]
        f = proxy(lp, p.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q).f
        state["f0"].append(f[0].item())  # the reference's host read of every step
        state["X"] = zo.update(X, c.X0, f, U, spec)[0]

    return step, lambda: state["f0"][0]


def hf_step(c: Cell):
    """Engine(backend='hf'): one eager-loop step (sicl_fast.diagnostics.benchmark.one_step, as bench/grad_step.py
    times it); f0 from the engine's own proxy of X0."""
    eng = Engine(c.lm, backend="hf")
    cal = Calibrator(eng.backend, c.cfg)
    state = {"X": c.X0.clone(), "step": 0}

    @torch.no_grad()
    def step() -> None:
        state["X"] = one_step(cal, c.prompt, state["X"], c.X0, state["step"])
        state["step"] += 1

    return step, lambda: float(eng.proxy(c.prompt, c.cfg).f[0])


def _static(c: Cell, eng: Engine, st: StaticStep | None = None) -> StaticStep:
    """A StaticStep of the cell on the engine's backend (or `st`); the cell's FLOPs counted on the first one."""
    st = st if st is not None else StaticStep(eng.backend, c.cfg, c.prompt, c.X0)
    if c.flops is None:
        c.flops = float(sum(step_flops(st).values()))
    return st


def fast_eager_step(c: Cell):
    """Engine(backend='fast', loop='static', graphs='off'): the sync-free StaticStep called eagerly."""
    st = _static(c, fast_engine(c.lm, graphs=False))
    return st, lambda: float(st.state.history[0])


def fast_graphs_step(c: Cell):
    """Engine(backend='fast', loop='static', graphs='on'): the step as Engine.calibrate replays it, taken from the
    engine's per-shape step cache (a StaticStep and its captured CUDA graph, sicl_fast.calibration.static.StepCache)."""
    eng = fast_engine(c.lm, graphs=True)
    st, run = eng.steps.get(eng.backend, *plan_step(eng.backend, c.cfg, c.prompt, c.X0, eng.steps.buckets))
    _static(c, eng, st)
    return run, lambda: float(st.state.history[0])


def anchor_step(c: Cell):
    """torch.compile(mode='reduce-overhead', dynamic=False) of the plain transformers forward of the full
    prompt + full logits + log_softmax + gather at the span positions, on a fixed bf16 batch [B, L, d] (the
    step-0 perturbation batch); its first call compiles. f0 from the first call's log-probs."""
    lm, p, cfg = c.lm, c.prompt, c.cfg
    dev = lm.device
    spec = StepSpec.build(cfg, p.length, lm.hidden_size, p.demo_start, p.demo_end)
    pos, tgt = (p.positions - 1).to(dev), p.targets.to(dev)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    x = full_batch(c.X0, torch.randn(spec.N, spec.rows, spec.d, generator=gen, device=dev), spec).to(lm.dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        logits = lm.model(inputs_embeds=x, use_cache=False).logits.float()
        return torch.log_softmax(logits, dim=-1)[:, pos, tgt]

    compiled = torch.compile(forward, mode="reduce-overhead", dynamic=False)
    state = {}

    @torch.no_grad()
    def step() -> None:
        lp = compiled(x)
        if "f0" not in state:  # the outputs of a CUDA-graph replay are overwritten by the next one: read now
            state["f0"] = float(proxy(lp, p.offsets, cfg.alpha, cfg.beta, cfg.gamma, cfg.q).f[0])

    return step, lambda: state["f0"]


BUILDERS = {"naive": naive_step, "hf": hf_step, "fast eager": fast_eager_step, "fast graphs": fast_graphs_step,
            "anchor": anchor_step}
CUDA_ONLY = ("fast graphs", "anchor")
ROW_ORDER = ("fast eager", "fast graphs", "hf", "naive", "anchor")  # naive (the biggest) late, the compile last


# ------------------------------------------------------------------------------------------------ the suite


@dataclass
class Results:
    meta: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    first_call: list = field(default_factory=list)
    whole_run: list = field(default_factory=list)
    decode: list = field(default_factory=list)
    packed: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def as_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Suite:
    """Runs the tasks of a Plan on one device, most important first, within the budget (module docstring)."""

    def __init__(self, plan: Plan, device: torch.device, dtype: torch.dtype) -> None:
        self.plan, self.device, self.dtype = plan, device, dtype
        self.clock = Clock(device, plan)
        self.out = Results()
        self.bug = False
        self._lm = None  # (name, LoadedModel or the exception that building it raised)
        self.rate: dict = {}  # model -> seconds per token-row of its last cell (cell_estimate)
        name = torch.cuda.get_device_name(device) if self.clock.cuda else None
        self.peak_tflops = next((v[0] for k, v in PEAKS.items() if k in name), None) if name else None

    # -------------------------------------------------------------------------------------- bookkeeping

    def elapsed(self) -> float:
        return time.perf_counter() - T_START

    def over_budget(self, what: str, need_s: float = 0.0) -> bool:
        """True (and `what` listed as skipped) when the budget is spent, or fewer than need_s seconds are left."""
        left = self.plan.budget_s - self.elapsed()
        if left > need_s:
            return False
        why = "budget spent" if left <= 0 else f"{left:.0f} s left, it needs about {need_s:.0f} s"
        self.out.skipped.append(f"{what} ({why} at {self.elapsed():.0f} s)")
        print(f"[{self.elapsed():6.1f} s] skipped: {what} ({why})", flush=True)
        return True

    def failed(self, what: str, exc: BaseException) -> str:
        """Record a row's exception; returns the one-line message for the row."""
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        if isinstance(exc, BUG_TYPES):
            self.bug = True
        self.out.errors.append(f"{what}: {msg}")
        print(f"[{self.elapsed():6.1f} s] ERROR in {what}: {msg}", flush=True)
        traceback.print_exc(file=sys.stderr)
        return msg

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def model(self, name: str):
        """The LoadedModel of `name` (built once while its tasks run; the previous one is freed first)."""
        if self._lm is not None and self._lm[0] == name:
            if isinstance(self._lm[1], BaseException):
                raise RuntimeError(f"model {name} could not be built: {self._lm[1]}")
            return self._lm[1]
        self._lm = None
        self.clock.clean()
        t = time.perf_counter()
        try:
            lm = build_model(name, self.plan.smoke, self.dtype, self.device)
        except Exception as exc:  # noqa: BLE001 (the rows of this model report it)
            self._lm = (name, exc)
            self.failed(f"building {name}", exc)
            raise RuntimeError(f"model {name} could not be built: {exc}") from None
        self._lm = (name, lm)
        n = sum(p.numel() for p in lm.model.parameters())
        self.out.meta.setdefault("models", {})[name] = {"source": lm.extra["source"], "params": n,
                                                        "build_s": round(time.perf_counter() - t, 2)}
        self.log(f"built {lm.name}: {n / 1e6:.1f} M parameters in {time.perf_counter() - t:.1f} s")
        return lm

    # -------------------------------------------------------------------------------------- step cells

    def cell_estimate(self, name: str, L: int, N: int) -> float:
        """Seconds the cell will take without its anchor: the model's last finished cell's seconds per token-row
        (L x (N + 1)) times this cell's; 0 before a cell of this model finished. Fixed costs make it an
        overestimate for a longer cell: near the end of the budget a cell is skipped rather than run late."""
        return self.rate[name] * L * (N + 1) if name in self.rate else 0.0

    def cell(self, name: str, L: int, N: int) -> None:
        """Every row of one (model, L, N) cell (module docstring), each guarded on its own."""
        what = f"{name} L={L} N={N}"
        if self.over_budget(f"step cell {what}", need_s=self.cell_estimate(name, L, N)):
            self.out.steps.extend(dict(model=name, L=L, N=N, variant=v, status="skipped", note="budget")
                                  for v in ROW_ORDER)
            return
        try:
            lm = self.model(name)
            t_cell = time.perf_counter()  # after the model's build: cell_estimate's rate is the cell's own
            prompt = span_prompt(L, int(lm.head_weight.shape[0]), seed=L * 100 + N)
            cfg = step_config(lm, N)
            with torch.no_grad():
                X0 = lm.model.get_input_embeddings()(prompt.input_ids.to(lm.device)).float()
            c = Cell(lm=lm, prompt=prompt, cfg=cfg, X0=X0)
        except Exception as exc:  # noqa: BLE001
            msg = self.failed(f"step cell {what}", exc)
            self.out.steps.extend(dict(model=name, L=L, N=N, variant=v, status="error", note=msg) for v in ROW_ORDER)
            return
        head = dict(model=name, L=L, N=N, P=int(prompt.positions.numel()), B=cfg.batch, a=prompt.demo_start,
                    b=prompt.demo_end)
        rows, t_anchor = [], 0.0
        for v in ROW_ORDER:
            row = dict(head, variant=v)
            rows.append(row)
            if v in CUDA_ONLY and not self.clock.cuda:
                row.update(status="n/a", note="CUDA only")
                continue
            if v == "anchor" and (name, L, N) not in self.plan.anchor:
                row.update(status="n/a", note="not run for this cell (--anchor)")
                continue
            if v == "anchor" and self.over_budget(f"anchor {what}", need_s=60):
                row.update(status="skipped", note="budget: the compile needs about 30-60 s")
                continue
            t = time.perf_counter()
            self.row(c, v, row, what)
            if v == "anchor":
                t_anchor = time.perf_counter() - t
        self.rate[name] = (time.perf_counter() - t_cell - t_anchor) / (L * (N + 1))
        del c
        self.clock.clean()
        self._ratios(rows)
        self.out.steps.extend(rows)
        fast = next((r for r in rows if r["variant"] == "fast graphs" and r.get("status") == "ok"),
                    next((r for r in rows if r["variant"] == "fast eager" and r.get("status") == "ok"), None))
        naive = next((r for r in rows if r["variant"] == "naive" and r.get("status") == "ok"), None)
        if fast and naive:
            self.log(f"  {what}: {fast['variant']} {fast['ms']:.2f} ms, {naive['ms'] / fast['ms']:.2f}x naive")

    def row(self, c: Cell, v: str, row: dict, what: str) -> None:
        """Build, first calls (f0, peak memory), steady-state ms of one variant, into `row`."""
        self.clock.clean()
        fn = None
        try:
            base = self.clock.start()
            t = time.perf_counter()
            fn, f0_of = BUILDERS[v](c)
            fn()  # the anchor compiles here; the fast graphs row captured while being built
            self.clock.sync()
            first_s = time.perf_counter() - t
            for _ in range(2):  # cudagraph trees record on a later call: its pool belongs in the peak too
                fn()
            peak = self.clock.peak_mib(base)
            f0 = f0_of()
            _, one = self.clock.seconds(fn)
            ms = self.clock.ms(fn, 1e3 * one)
            row.update(status="ok", ms=ms, first_s=first_s, peak_mib=peak, f0=f0, note=_note(v))
            if c.flops is not None:
                row["gflop"] = c.flops / 1e9
            self.log(f"{what} {v}: {ms:.3f} ms/step, build + first call {first_s:.2f} s"
                     + (f", peak extra {peak:.0f} MiB" if peak is not None else "") + f", f0 {f0:.6g}")
        except torch.OutOfMemoryError as exc:  # e.g. naive's full logits at 2100 tokens: a finding, not a failure
            row.update(status="out of memory", note=self.failed(f"{what} {v}", exc).split(". ")[0])
        except Exception as exc:  # noqa: BLE001 (a missing package, ...: this row only)
            row.update(status="error", note=self.failed(f"{what} {v}", exc))
        finally:
            fn = f0_of = None  # the row's step and its buffers go before the next row
            if v == "anchor":  # its CUDA-graph pool lives in Inductor's global cudagraph trees until reset
                from torch import _dynamo

                _dynamo.reset()
            self.clock.clean()

    def _ratios(self, rows: list) -> None:
        """Speed-up over naive and the anchor, TFLOP/s and % of the bf16 peak, f0's relative gap to naive."""
        ok = {r["variant"]: r for r in rows if r.get("status") == "ok"}
        gflop = next((r["gflop"] for r in rows if r.get("gflop")), None)
        for r in ok.values():
            if "naive" in ok:
                r["vs_naive"] = ok["naive"]["ms"] / r["ms"]
                n0 = ok["naive"]["f0"]
                r["f0_rel_naive"] = abs(r["f0"] - n0) / abs(n0) if n0 else None
            if "anchor" in ok:
                r["vs_anchor"] = ok["anchor"]["ms"] / r["ms"]
            if gflop:
                r["gflop"] = gflop
                r["tflops"] = gflop / r["ms"]  # GFLOP / ms = TFLOP/s
                if self.peak_tflops:
                    r["pct_peak"] = 100 * r["tflops"] / self.peak_tflops

    # -------------------------------------------------------------------------------------- whole runs

    def graphs_engine(self, lm, **kw) -> tuple[Engine, str]:
        """The engine the end-to-end rows use: graphs 'on' on CUDA (the product's fast path), else without graphs.
        Returns (engine, which)."""
        return fast_engine(lm, self.clock.cuda, **kw), "graphs on" if self.clock.cuda else "no graphs (CPU)"

    def guarded(self, what: str, row: dict, body) -> None:
        """body(row) fills one result row: skipped (and listed) when the budget is spent, its exception recorded
        in the row, and what it built (an engine, its graphs and buffers) freed before the next row."""
        if self.over_budget(what):
            row.update(status="skipped")
            return
        try:
            body(row)
        except Exception as exc:  # noqa: BLE001 (this row only)
            row.update(status="error", note=self.failed(what, exc))
        finally:
            self.clock.clean()

    def first_call(self, name: str, L: int, N: int) -> None:
        """Seconds of the first calibrate call (1 step) at a new prompt length L + delta, on an engine already warm
        at L: with graphs (CUDA) and without."""
        L2 = L + self.plan.new_length_delta
        for label, graphs in (("fast graphs", True), ("fast eager", False)):
            what = f"first call {name} L={L2} {label}"
            row = dict(model=name, L=L2, N=N, variant=label)
            self.out.first_call.append(row)
            if graphs and not self.clock.cuda:
                row.update(status="n/a", note="CUDA only")
                continue

            def body(row, graphs=graphs, what=what):
                lm = self.model(name)
                V = int(lm.head_weight.shape[0])
                eng = fast_engine(lm, graphs)
                cfg = step_config(lm, N)
                eng.calibrate(span_prompt(L, V, seed=1), cfg.replace(max_steps=2))  # warm at L
                new, one = span_prompt(L2, V, seed=2), cfg.replace(max_steps=1)
                res, s = self.clock.seconds(lambda: eng.calibrate(new, one))
                row.update(status="ok", seconds=s, steps=res.steps)
                self.log(f"{what}: {s:.3f} s")

            self.guarded(what, row, body)

    def whole_run(self, name: str, L: int, N: int) -> None:
        """A whole calibration (plan.cal_steps steps, every one run) + a plan.answer_tokens-token answer: the first
        run on a new engine, then warm (best of 2)."""
        what = f"whole run {name} L={L} N={N}"
        row = dict(model=name, L=L, N=N, steps_asked=self.plan.cal_steps, tokens_asked=self.plan.answer_tokens)
        self.out.whole_run.append(row)

        def body(row):
            lm = self.model(name)
            eng, which = self.graphs_engine(lm)
            prompt = span_prompt(L, int(lm.head_weight.shape[0]), seed=3)
            cfg = step_config(lm, N, max_steps=self.plan.cal_steps)

            def run():
                res = eng.calibrate(prompt, cfg)
                gen = eng.generate(prompt, res.embeddings, max_new_tokens=self.plan.answer_tokens, stop_strings=())
                return res.steps, len(gen.token_ids)

            (steps, tokens), first = self.clock.seconds(run)
            warm = min(self.clock.seconds(run)[1] for _ in range(2))
            row.update(status="ok", engine=which, first_s=first, warm_s=warm, steps=steps, tokens=tokens)
            self.log(f"{what}: first {first:.3f} s, warm {warm:.3f} s ({steps} steps, {tokens} tokens, {which})")
            # the calibration alone (warm, best of 2) for each number of steps between two reads of the state: the
            # measurement that chooses the default (sicl_fast.run.plan.default_sync_every)
            row["sync_every_s"] = {}
            for k in self.plan.sync_everys:
                eng.plan = dataclasses.replace(eng.plan, sync_every=k)
                row["sync_every_s"][k] = min(self.clock.seconds(lambda: eng.calibrate(prompt, cfg))[1]
                                             for _ in range(2))
            self.log(f"{what}: calibration seconds by sync_every {row['sync_every_s']}")

        self.guarded(what, row, body)

    def decode(self, name: str, L: int) -> None:
        """Greedy decoding ms per token: warm, (T(n) - T(1)) / (n - 1) with T(k) the best time of a k-token
        answer at L; on a new length L2 = L + delta, (first n-token call at L2 - warm T(1) at L2) / (n - 1), so
        anything a new length costs once (a capture, a compile) is charged to its tokens."""
        n = self.plan.answer_tokens
        L2 = L + self.plan.new_length_delta
        what = f"decode {name} L={L}"
        row = dict(model=name, L=L, new_L=L2, tokens_asked=n)
        self.out.decode.append(row)

        def body(row):
            lm = self.model(name)
            eng, which = self.graphs_engine(lm)
            V = int(lm.head_weight.shape[0])
            p, p2 = span_prompt(L, V, seed=4), span_prompt(L2, V, seed=5)

            def answer(prompt, k):
                return lambda: len(eng.generate(prompt, max_new_tokens=k, stop_strings=()).token_ids)

            answer(p, n)()  # warm at L
            tokens, _ = self.clock.seconds(answer(p, n))
            t_n = min(self.clock.seconds(answer(p, n))[1] for _ in range(3))
            t_1 = min(self.clock.seconds(answer(p, 1))[1] for _ in range(3))
            tokens2, first2 = self.clock.seconds(answer(p2, n))  # the first call at the new length
            t2_1 = min(self.clock.seconds(answer(p2, 1))[1] for _ in range(3))
            row.update(status="ok", engine=which, tokens=tokens, tokens_new=tokens2,
                       warm_ms_per_token=1e3 * (t_n - t_1) / (n - 1), prefill_ms=1e3 * t_1,
                       new_ms_per_token=1e3 * (first2 - t2_1) / (n - 1), new_first_s=first2)
            self.log(f"{what}: {row['warm_ms_per_token']:.3f} ms/token warm, {row['new_ms_per_token']:.3f} ms/token "
                     f"on the new length {L2} ({which})")

        self.guarded(what, row, body)

    def packed(self, name: str) -> None:
        """Prompts per second of Engine(pack=k).calibrate_many against one by one (pack 1), the same prompts
        (lengths spread geometrically over plan.packed_lengths, in a shuffled order), plan.packed_steps steps each
        (patience off, tau 0). Each mode gets at most PACKED_CAP_S and half the budget left; one that runs out stops
        and counts the prompts it finished (marked partial)."""
        pl = self.plan
        what = f"packed {name}"
        if self.over_budget(what, need_s=20):
            self.out.packed.append(dict(model=name, mode="both", status="skipped"))
            return
        try:
            lm = self.model(name)
            V = int(lm.head_weight.shape[0])
            lo, hi = pl.packed_lengths
            n = pl.packed_prompts
            lengths = [round(lo * (hi / lo) ** (i / max(1, n - 1))) for i in range(n)]
            random.Random(0).shuffle(lengths)
            prompts = [span_prompt(L, V, seed=1000 + i) for i, L in enumerate(lengths)]
            cfg = step_config(lm, pl.packed_N, max_steps=pl.packed_steps)
        except Exception as exc:  # noqa: BLE001
            self.out.packed.append(dict(model=name, mode="both", status="error", note=self.failed(what, exc)))
            return
        modes = (("one by one", 1), (f"packed {pl.pack}", pl.pack))
        for i, (mode, k) in enumerate(modes):
            row = dict(model=name, mode=mode, pack=k, prompts=n, steps_asked=pl.packed_steps, N=pl.packed_N,
                       lengths=f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / n:.0f})")
            self.out.packed.append(row)
            left = pl.budget_s - self.elapsed()
            cap = min(PACKED_CAP_S, left / (len(modes) - i))
            if cap <= 5:
                self.out.skipped.append(f"{what} {mode} (budget: {left:.0f} s left at {self.elapsed():.0f} s)")
                row.update(status="skipped")
                continue
            eng = None
            try:
                # graphs as the engine decides ('auto'); pack 1 then runs what calibrate runs
                eng = Engine(lm, backend="fast", loop="static", pack=k)
                row["graphs"] = f"auto: {'on' if eng.plan.graphs else 'off'}"
                eng.calibrate_many(prompts[:2], cfg.replace(max_steps=2))  # kernels compiled outside the timing
                done, steps = [], []
                deadline = time.perf_counter() + cap

                class Deadline(Exception):
                    pass

                def on_result(j, res):
                    done.append(j)
                    steps.append(res.steps)
                    if time.perf_counter() > deadline and len(done) < n:
                        raise Deadline

                self.clock.sync()
                t = time.perf_counter()
                try:
                    eng.calibrate_many(prompts, cfg, on_result=on_result)
                    partial = False
                except Deadline:
                    partial = True
                self.clock.sync()
                s = time.perf_counter() - t
                row.update(status="ok", seconds=s, done=len(done), prompts_per_s=len(done) / s, partial=partial,
                           all_steps_run=all(x == pl.packed_steps for x in steps))
                self.log(f"{what} {mode}: {len(done)} prompts in {s:.1f} s = {len(done) / s:.2f} prompts/s"
                         + (" (partial: the budget ran out)" if partial else ""))
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", note=self.failed(f"{what} {mode}", exc))
            finally:
                eng = None  # the engine, its graphs and buffers go before the next row
                self.clock.clean()
        one, pk = (next((r for r in self.out.packed if r.get("mode") == m and r.get("status") == "ok"), None)
                   for m, _ in modes)
        if one and pk:
            pk["vs_one_by_one"] = pk["prompts_per_s"] / one["prompts_per_s"]

    # -------------------------------------------------------------------------------------- schedule

    def tasks(self) -> list:
        """(callable, args) in the order they run: the targets' cells and whole runs first (SmolLM2 whole, Llama
        and Gemma at the middle length, the packed mode), then the rest of the grid (module docstring)."""
        pl = self.plan
        grid = [(L, n) for L in pl.lengths for n in pl.Ns]
        mid = [(L, n) for L, n in grid if L == pl.L_mid]
        rest = [(L, n) for L, n in grid if L != pl.L_mid]
        out = []
        if SMOL in pl.models:
            first = [(L, n) for L, n in grid if (L, n) == (pl.L_small, pl.Ns[0])]
            out += [(self.cell, (SMOL, L, n)) for L, n in first]
            out += [(self.first_call, (SMOL, pl.L_small, pl.Ns[0])), (self.whole_run, (SMOL, pl.L_small, pl.Ns[0])),
                    (self.decode, (SMOL, pl.L_small))]
            out += [(self.cell, (SMOL, L, n)) for L, n in grid if (L, n) not in first]
        if LLAMA in pl.models:
            out += [(self.cell, (LLAMA, L, n)) for L, n in mid]
            out += [(self.first_call, (LLAMA, pl.L_mid, pl.Ns[0]))]
        if GEMMA in pl.models:
            out += [(self.cell, (GEMMA, L, n)) for L, n in mid]
            out += [(self.packed, (GEMMA,))]
            out += [(self.cell, (GEMMA, L, n)) for L, n in rest]
        if LLAMA in pl.models:
            out += [(self.cell, (LLAMA, L, n)) for L, n in rest]
        if QWEN in pl.models:
            out += [(self.cell, (QWEN, L, n)) for L, n in grid]
        return out

    def run(self) -> Results:
        for fn, args in self.tasks():
            try:
                fn(*args)
            except RuntimeError as exc:  # a model that could not be built: its rows say so, the rest goes on
                if "could not be built" not in str(exc):
                    raise
                self.log(f"skipped {fn.__name__}{args}: {exc}")
        self._lm = None
        self.clock.clean()
        self.out.targets = targets(self.out, self.plan)
        return self.out


def _note(v: str) -> str:
    return {"fast eager": "StaticStep, no graph", "fast graphs": "StaticStep in one CUDA graph",
            "anchor": "forward + logits + log_softmax + gather only", "naive": "full prompt + full logits",
            "hf": "benchmark.one_step"}[v]


# ------------------------------------------------------------------------------------------------ targets


def _find(rows, **kw):
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items()) and r.get("status") == "ok"), None)


def _ours(rows, model, L, N):
    """Our best row of a cell: fast graphs when it ran, else fast eager."""
    return _find(rows, model=model, L=L, N=N, variant="fast graphs") or _find(rows, model=model, L=L, N=N,
                                                                              variant="fast eager")


def _target(name, value, threshold, upper: bool, unit: str = "", note: str = "") -> dict:
    """A target row: met when value <= threshold (upper) or >= threshold; margin in % of the threshold, positive
    when met."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return dict(target=name, value=None, threshold=threshold, unit=unit, status="not measured", margin=None,
                    note=note)
    met = value <= threshold if upper else value >= threshold
    margin = 100 * ((threshold - value) if upper else (value - threshold)) / threshold
    return dict(target=name, value=value, threshold=threshold, unit=unit, status="met" if met else "missed",
                margin=margin, note=note)


def targets(out: Results, pl: Plan) -> list:
    """The issue's targets on this run's rows (the smoke run maps them onto its tiny shapes)."""
    s, t = out.steps, []
    ours = _ours(s, SMOL, pl.L_small, pl.Ns[0])
    t.append(_target(f"SmolLM2 L={pl.L_small} N={pl.Ns[0]} whole step <= 2.5 ms", ours and ours["ms"], 2.5, True,
                     "ms", ours and ours["variant"]))
    d = _find(out.decode, model=SMOL)
    t.append(_target("decode <= 1.5 ms/token (warm)", d and d["warm_ms_per_token"], 1.5, True, "ms/token"))
    t.append(_target("decode <= 1.5 ms/token on a new prompt length (first call)", d and d["new_ms_per_token"], 1.5,
                     True, "ms/token"))
    w = _find(out.whole_run, model=SMOL)
    t.append(_target(f"{pl.cal_steps}-step calibration + {pl.answer_tokens}-token answer < 0.3 s (warm)",
                     w and w["warm_s"], 0.3, True, "s", w and f"first run {w['first_s']:.3f} s"))
    for n in pl.Ns:
        o, a = _ours(s, LLAMA, pl.L_mid, n), _find(s, model=LLAMA, L=pl.L_mid, N=n, variant="anchor")
        t.append(_target(f"Llama-3.1-8B L={pl.L_mid} N={n} >= 1.5x naive", o and o.get("vs_naive"), 1.5, False, "x",
                         o and o["variant"]))
        t.append(_target(f"Llama-3.1-8B L={pl.L_mid} N={n} >= 1.2x anchor", o and a and o.get("vs_anchor"), 1.2,
                         False, "x", o and o["variant"]))
    for n in pl.Ns:
        o = _ours(s, GEMMA, pl.L_mid, n)
        t.append(_target(f"Gemma-2-2B L={pl.L_mid} N={n} >= 1.5x naive", o and o.get("vs_naive"), 1.5, False, "x",
                         o and o["variant"]))
    pk = next((r for r in out.packed if r.get("vs_one_by_one")), None)
    t.append(_target("packed >= 1.5x one-by-one prompts/s", pk and pk["vs_one_by_one"], 1.5, False, "x",
                     pk and ("partial run" if pk.get("partial") else "")))
    worst = None  # the largest ratio of our peak extra memory to naive's over the cells with both
    for r in s:
        if r["variant"] != "naive" or r.get("status") != "ok" or r.get("peak_mib") is None:
            continue
        o = _ours(s, r["model"], r["L"], r["N"])
        if o and o.get("peak_mib") is not None and r["peak_mib"] > 0:
            ratio = o["peak_mib"] / r["peak_mib"]
            if worst is None or ratio > worst[0]:
                worst = (ratio, f"worst cell {r['model']} L={r['L']} N={r['N']}: {o['peak_mib']:.0f} vs "
                                f"{r['peak_mib']:.0f} MiB")
    t.append(_target("peak extra memory <= 1/10 of naive's", worst and worst[0], 0.1, True, "x naive",
                     worst and worst[1]))
    for model in dict.fromkeys(r["model"] for r in out.first_call):  # ours: with graphs where it ran
        r = _find(out.first_call, model=model, variant="fast graphs") or _find(out.first_call, model=model,
                                                                                variant="fast eager")
        t.append(_target(f"first call at a new prompt length < 1 s ({model})", r and r["seconds"], 1.0, True, "s",
                         r and r["variant"]))
    return t


# ------------------------------------------------------------------------------------------------ report


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(header: list, rows: list, key: list, cells) -> list:
    """Markdown table lines: `key` columns of every row, then cells(row) for an ok row, or its status and note
    in the first value column for any other."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        head = [str(r.get(k, "-")) for k in key]
        tail = cells(r) if r.get("status") == "ok" else [f"{r.get('status')}: {r.get('note', '')}".rstrip(": ")]
        tail += [""] * (len(header) - len(key) - len(tail))
        lines.append("| " + " | ".join(head + tail) + " |")
    return lines


STEP_NOTE = ("naive: transformers forward of the full prompt, full logits, log_softmax, gather, `.item()` every "
             "step; hf: Engine(backend='hf'), sicl_fast.diagnostics.benchmark.one_step; fast eager: the StaticStep of "
             "Engine(backend='fast', loop='static', graphs='off'); fast graphs: the same step captured in a CUDA graph "
             "(Engine(graphs='on'), as calibrate replays it); anchor: torch.compile(mode='reduce-overhead') of the "
             "transformers forward + log_softmax + gather, timed on that forward alone. TFLOP/s: the step's FLOPs as "
             "`sicl-fast profile` counts them (the same for every row of a cell) over its time. f0: the proxy of the "
             "prompt's own embeddings as the row computed it; 'f0 vs naive' its relative gap (bf16 rounding).")


def markdown(out: Results) -> str:
    """The Markdown section appended to the results file."""
    m = out.meta
    models = ", ".join(f"{k}: {v['source']}, {v['params'] / 1e6:.4g} M parameters"
                       for k, v in m.get("models", {}).items())
    peak = f"{m['peak_tflops']:.0f} TFLOP/s (bench/gpu_kernels.py PEAKS)" if m["peak_tflops"] else "none (CPU)"
    lines = [f"## GPU suite (bench/gpu_suite.py{', smoke' if m['smoke'] else ''}): {m['device_name']}, {m['date']}",
             "",
             f"Device: {m['device_name']} ({m['device']}); bf16 dense peak used: {peak}. torch {m['torch']}, "
             f"triton {m['triton']}, transformers {m['transformers']}, Python {m['python']}; model dtype {m['dtype']}.",
             "", "```bash", m["command"], "```", "",
             f"Elapsed {m['elapsed_s']:.0f} s of the {m['budget_s']:.0f} s budget. Random weights at the shapes of "
             f"bench/models/*.json ({models}).", ""]
    if m["smoke"]:
        lines += ["CPU smoke run: tiny shapes, so the timings say nothing about the GPU; the targets below are the "
                  "H100 thresholds, evaluated only to exercise the machinery.", ""]
    lines += ["### One ascent step", ""] + _table(
        ["model", "L", "P", "N", "variant", "ms/step", "vs naive", "vs anchor", "TFLOP/s", "% bf16 peak",
         "peak extra MiB", "build + first call s", "f0", "f0 vs naive", "note"],
        out.steps, ["model", "L", "P", "N", "variant"],
        lambda r: [f"{r['ms']:.3f}", _f(r.get("vs_naive")), _f(r.get("vs_anchor")), _f(r.get("tflops"), "{:.3g}"),
                   _f(r.get("pct_peak"), "{:.1f} %"), _f(r.get("peak_mib"), "{:.0f}"), f"{r['first_s']:.2f}",
                   f"{r['f0']:.6g}", _f(r.get("f0_rel_naive"), "{:.1e}"), r.get("note", "")])
    lines += ["", STEP_NOTE, "", "### First call at a new prompt length (a warm engine, one calibrate call)", ""]
    anchors = [dict(r, variant="anchor (compile + first call)", seconds=r["first_s"]) for r in out.steps
               if r["variant"] == "anchor" and r.get("status") == "ok"]
    lines += _table(["model", "L", "N", "engine", "seconds"], out.first_call + anchors, ["model", "L", "N", "variant"],
                    lambda r: [f"{r['seconds']:.3f}"])
    lines += ["", "### Whole run: calibration + answer", ""] + _table(
        ["model", "L", "N", "engine", "steps", "tokens", "first run s", "warm s"], out.whole_run, ["model", "L", "N"],
        lambda r: [r["engine"], str(r["steps"]), str(r["tokens"]), f"{r['first_s']:.3f}", f"{r['warm_s']:.3f}"])
    ks = [r for r in out.whole_run if r.get("sync_every_s")]
    if ks:
        cols = list(ks[0]["sync_every_s"])
        lines += ["", "### Steps between two reads of the state (`--sync-every`): whole calibration, warm s", ""]
        lines += _table(["model", "L", "N"] + [f"k = {k}" for k in cols] + ["best k"], ks, ["model", "L", "N"],
                        lambda r: [f"{r['sync_every_s'][k]:.4f}" for k in cols]
                        + [str(min(r["sync_every_s"], key=r["sync_every_s"].get))])
    lines += ["", "### Decode (greedy, static KV cache)", ""] + _table(
        ["model", "L", "engine", "tokens", "prefill + first token ms", "ms/token warm", "new L",
         "ms/token at the new L (first call)"], out.decode, ["model", "L"],
        lambda r: [r["engine"], str(r["tokens"]), f"{r['prefill_ms']:.2f}", f"{r['warm_ms_per_token']:.3f}",
                   str(r["new_L"]), f"{r['new_ms_per_token']:.3f}"])
    lines += ["", "ms/token warm: (T(n) - T(1)) / (n - 1), T(k) the best time of a k-token answer; at a new length: "
              "(the first n-token call there - warm T(1) there) / (n - 1).", "", "### Packed throughput", ""]
    lines += _table(
        ["model", "mode", "prompts done", "lengths", "N", "steps each", "graphs", "seconds", "prompts/s",
         "vs one by one"], out.packed, ["model", "mode"],
        lambda r: [f"{r['done']}" + (f" of {r['prompts']} (partial)" if r["partial"] else ""), r["lengths"],
                   str(r["N"]), f"{r['steps_asked']}" + ("" if r["all_steps_run"] else " (not all ran!)"),
                   r.get("graphs", ""), f"{r['seconds']:.2f}", f"{r['prompts_per_s']:.3f}",
                   _f(r.get("vs_one_by_one"))])
    lines += ["", "### Targets", "", "| target | measured | threshold | status | margin | note |",
              "|---|---|---|---|---|---|"]
    for r in out.targets:
        val = "-" if r["value"] is None else f"{r['value']:.4g} {r['unit']}"
        margin = "-" if r["margin"] is None else (
            f"{'by' if r['status'] == 'met' else 'short by'} {abs(r['margin']):.0f} %")
        lines.append(f"| {r['target']} | {val} | {r['threshold']:g} {r['unit']} | {r['status']} | {margin} | "
                     f"{r.get('note') or ''} |")
    if out.skipped:
        lines += ["", "Skipped: " + "; ".join(out.skipped) + "."]
    if out.errors:
        lines += ["", "Errors: " + "; ".join(out.errors) + "."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main


def versions() -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    return {"torch": torch.__version__, "triton": tv, "transformers": transformers.__version__,
            "python": platform.python_version()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps: the CPU check of the suite")
    ap.add_argument("--models", nargs="+", choices=MODEL_ORDER, help="default: all four (smoke: SmolLM2, Gemma 2)")
    ap.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default 256 600 2100; smoke 32 48)")
    ap.add_argument("--N", type=int, nargs="+", help="directions per step (default 8 16; smoke 2)")
    ap.add_argument("--anchor", nargs="+", help="cells that get the compiled anchor, MODEL:L:N ..., or all, or "
                                                "none (default: Llama-3.1-8B at the middle length, every N)")
    ap.add_argument("--pack", type=int, help="the packed mode's pack width (default 8; smoke 2)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="after this many seconds the remaining cells are skipped and listed (default 450)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the models' dtype (default bfloat16, as the issue asks; float32: a tight f0 check)")
    ap.add_argument("--out", default=None, help="the rows as JSON (default: bench/results_gpu_suite.json; smoke: "
                                                "none)")
    ap.add_argument("--results", default=None, help="append the Markdown section here (default: bench/RESULTS.md; "
                                                    "smoke: none)")
    args = ap.parse_args(argv)
    args_given = list(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to time the compiled kernels.")
        return 1
    if device.type == "cuda":  # the anchor's compile latency is a cold compile, not a read of an earlier run's cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_suite_inductor_")
        from torch import _dynamo

        for knob in ("cache_size_limit", "recompile_limit"):  # one compile per anchor cell (fixed shapes)
            if hasattr(_dynamo.config, knob):
                setattr(_dynamo.config, knob, 64)
    plan = make_plan(args)
    out_json = args.out if args.out else (None if args.smoke else str(HERE / "results_gpu_suite.json"))
    out_md = args.results if args.results else (None if args.smoke else str(HERE / "RESULTS.md"))
    suite = Suite(plan, device, getattr(torch, args.dtype))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()})")
    suite.out.meta.update(device=str(device), device_name=name, peak_tflops=suite.peak_tflops,
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), smoke=plan.smoke,
                          dtype=args.dtype, budget_s=plan.budget_s,
                          command=" ".join(["python"] + [shlex.quote(a) for a in sys.argv[:1] + args_given]),
                          plan={k: (sorted(v) if isinstance(v, set) else v) for k, v in plan.__dict__.items()},
                          **versions())
    print(f"# GPU suite on {name}; budget {plan.budget_s:.0f} s", flush=True)
    suite.run()
    suite.out.meta["elapsed_s"] = suite.elapsed()
    md = markdown(suite.out)
    print()
    print(md)
    if out_json:
        Path(out_json).write_text(json.dumps(suite.out.as_json(), indent=1, default=str) + "\n")
    if out_md:
        path = Path(out_md)
        prev = path.read_text() if path.exists() else ""
        path.write_text(prev + ("\n" if prev and not prev.endswith("\n\n") else "") + md)
    if suite.bug:
        print("A row failed with an error that looks like a bug of the suite (see Errors above).", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
