"""The prepared device check: what the GPU verification issues (#49, #53) measure first, within 9 minutes on one H100 /
H200 from a plain copy of the tree (nothing installed, no model files, no variables set), each step a child process
under its own time limit, its output streamed to OUT/<step>.log and its figures to OUT/<step>.json as they are
measured, then one table of the targets beside the figures of the steps that ran to their end. The first call on a
GPU machine (docs/gpu_runbook.md section 3).

    python bench/gpu_check.py --out $OUT                    # CUDA: about 9 minutes; OUT new or empty
    python bench/gpu_check.py --out /tmp/check --dry-run    # the CPU form: tiny shapes, in one process (a test)

The steps, most important first, each with its time limit on the GPU (s) and what the limit is sized from (the
figures' models: random weights at the shapes of bench/models/*.json, built by bench/gpu_suite.py on the device;
--dry-run: its two-layer smoke shapes; a child's start, torch and CUDA, is taken as 10 s of each; the limits add up
to 530 s, within the 540 s budget, the 9 minutes of a 15-minute lease that the machine's start leaves):
    cuda_tests   CUDA_TESTS (below) on the device (conftest's TRITON_DEVICE is CUDA there; the tests that need the
                 real SmolLM2 skip without its files), pytest --maxfail MAXFAIL; 120 s. A cold Triton cache compiles
                 each kernel specialisation at its first launch, one at a time: bench/cold_compiles.py counts 194
                 distinct ones in this selection (92 of them test_cuda.py's engine work), 56 s of CPU for their
                 sm_90 compiles and launchers on the 2-core machine here (bench/RESULTS.md section 29); with the
                 child's start, pytest's collection (2 s) and the tests' own run (the 365 GPU tests of RESULTS
                 section 4 took 131 s with their compiles), about 100 s. Left out: tests/test_rows_ops.py and
                 tests/test_ops.py, whose Triton cases (the parity contract the suite runs on every CPU run) would add
                 334 specialisations and 92 s (all nine files: 528, 148 s); MAXFAIL bounds what a kernel that fails
                 on the device costs (a failed compile is not cached: each test that launches it compiles it again)
                 and still names every kernel it reaches; --dry-run: the command only (the suite runs them on the CPU)
    kernels      bench/gpu_kernels.py --quick: parity (PASS / FAIL) and timing at Llama-3.1-8B's shapes; 45 s: about
                 30 launch decisions at one shape set (kernels/_configs.family_cases: 23 a bf16 Llama step), 10-15
                 s of cold compiles at cold_compiles.py's 0.24 s a specialisation (median; 1.2 s the longest), about
                 20 do_bench rows of a fraction of a second; --dry-run: its difference-form parity checks
                 (rows_section) at tiny shapes under Triton's interpreter
    bf16_pieces  the bf16-piece reference product (sicl_fast.models.reference.reference_product: float32 rows as 3
                 bf16 pieces through one bf16 product with float32 accumulation, kernels/split_bf16 on CUDA) and the
                 plain float32 product, each against the float64 product of the same values at Llama-3.1-8B's inner
                 sizes (x [600, 4096] @ W [14336, 4096]^T and x [600, 14336] @ W [4096, 14336]^T, W bf16), with
                 torch's allow_bf16_reduced_precision_reduction as the library leaves it (its value is a figure) and
                 with it forced on and off; 20 s: one split_bf16 compile and 10 products of 70 GFLOP (the float64
                 ones at the H200's 60 TFLOP/s), a second, after the child's start
    smollm2      the default step at SmolLM2 L 256 N 8 with float32 weights (what --dtype auto gives the registry's GGUF
                 models; every other choice the plan's default: bf16 difference products, Triton, graphs, buckets): ms
                 a step over a whole calibration (its reads and reference refreshes amortised), the kernels a step
                 (the profiler), one refresh's ms; decode ms a token (gpu_suite's Suite.decode); 65 s: the step's
                 about 21 launch decisions compiled cold (5-10 s), 2 x 64 steps of 3.6 ms and a capture of 1.6 s
                 (RESULTS section 4), the profiler's passes, decode's answers of 32 tokens at 2.5 ms a token at two
                 lengths with their captures
    llama        Llama-3.1-8B at L 600 N 8, bf16 weights: the default step, the plain bf16 step (diff_matmul 'off'),
                 FP8 differences; peak memory over 12 length buckets (one engine, prompts of 12 buckets' lengths, 2
                 steps each); 100 s: the 8B model's build on the device, 3 modes x 2 x 16 steps of about 125 ms
                 (RESULTS section 4: 123 ms captured; 15 s) with their first calls' compiles (23 launch decisions)
                 and captures (0.7 s), 12 bucket builds and captures of 2 steps each
    gemma2       Gemma-2-2B at L 600 N 8, bf16: the default and the plain bf16 step; 45 s: 2 x 2 x 16 steps of about
                 45 ms (RESULTS section 4), the compiles of its soft-cap and window variants (24 launch decisions),
                 captures
    length_mix   bench/length_mix.measure: 24 prompts of 200-600 tokens with length buckets against one repeated
                 length (SmolLM2 shape); 45 s: 2 x 24 prompts x 50 steps at 3.6-5.7 ms (RESULTS section 4: 227 ms a
                 prompt repeated, 11 s a mode), a few bucket captures of 1.6 s
    anchor       last, its compiles the longest: torch.compile of the plain bf16 forward (bench/gpu_suite.anchor_step)
                 at SmolLM2 L 256 N 8 and Llama-3.1-8B L 600 N 8; 90 s: the compiles took 32.7 s and 26.8 s on an
                 H200 (RESULTS section 4), the Llama model's build, do_bench's timings; --dry-run: n/a (it compiles
                 with CUDA graphs)

Each run starts from an empty (or new) OUT and refuses one that holds files, so no figure of an earlier run is read as
this run's. OUT holds <step>.log (the child's output and its own children's, as it runs), <step>.json (its figures,
rewritten after each), check.json (every step's status; the figures of the steps that ran to their end, those a step
cut short or failed had under "_partial") and check.md (the table: a target whose step did not end shows no figure
and says why). A step is stopped at its limit as `timeout -s INT` does: SIGINT to its process group (pytest then
prints its summary of what ran), SIGKILL GRACE_S later. Exit status 0 when every step ran (a missed target is a
finding, not a failure), 1 when a step failed, timed out or was skipped, 2 for a usage error (one line). Ctrl-C or
SIGTERM stops the check where it is: the running step's child and its own children are stopped as at its limit (they
run in a session of their own, which a terminal's Ctrl-C does not reach), that step reads 'interrupted', the steps
after it are not run, and the table of what ran is written; exit status 130.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the tree's own package: a plain copy runs without an install
sys.path.insert(1, str(HERE))

from sicl_fast.commands.cli import _Parser  # noqa: E402 - after the tree is on the path
from sicl_fast.run.knobs import arg_type  # noqa: E402

# cuda_tests: what runs on the device, most important first (module docstring: sized by bench/cold_compiles.py)
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_kernel_rng.py", "tests/test_kernel_proxy.py",
              "tests/test_kernel_span_logprobs.py", "tests/test_rows_triton.py", "tests/test_fused_decoder.py",
              "tests/test_launch.py"]
MAXFAIL = 20  # failures before pytest stops (module docstring)
# step -> its time limit on the GPU (s; module docstring): 530 in all, within the default 540 s budget
STEPS = {"cuda_tests": 120, "kernels": 45, "bf16_pieces": 20, "smollm2": 65, "llama": 100, "gemma2": 45,
         "length_mix": 45, "anchor": 90}
GRACE_S = 15  # after a step's SIGINT, before its SIGKILL: pytest's summary, the figures so far
MIN_STEP_S = 10  # a step is not started with less of the budget left
DRY_TIMEOUT = 120  # --dry-run: each step in this process under an alarm
INTERRUPTED = 3  # a child's exit status when its time was up (SIGINT)


class Figures:
    """The figures of one step, written to OUT/<step>.json after each one (a step cut short keeps what it had)."""

    def __init__(self, out: Path, step: str) -> None:
        self.path, self.data = out / f"{step}.json", {}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)
        print(f"  {key}: {value}", flush=True)


def stream(cmd: list, env: dict | None = None) -> tuple[int, list[str]]:
    """Run cmd from the tree's root, its output copied line by line to this process's stdout (the step's log) as it
    comes: (exit status, its lines). When the step's time is up, the SIGINT that interrupts this process reaches cmd
    too (one process group): its last words (pytest's summary of what ran) are still read, then KeyboardInterrupt
    goes on up."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines, interrupted = [], False
    while True:
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line.rstrip("\n"))
            break
        except KeyboardInterrupt:
            interrupted = True
    rc = proc.wait()
    if interrupted:
        raise KeyboardInterrupt(lines)
    return rc, lines


# ------------------------------------------------------------------------------------------------ the steps


def step_cuda_tests(fig: Figures, dry: bool) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda or not cuda",
           f"--maxfail={MAXFAIL}", "-rfE", "--durations=10", *CUDA_TESTS]
    fig["command"] = " ".join(cmd[1:])
    if dry:
        fig["summary"] = "n/a (cpu): the suite runs these on the CPU"
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        rc, lines = stream(cmd, env)
    except KeyboardInterrupt as exc:  # what ran before the time was up, for the log and the partial figures
        fig["summary"] = _pytest_summary(exc.args[0] if exc.args else [], None)
        raise
    fig["summary"] = summary = _pytest_summary(lines, rc)
    if summary.startswith("no summary"):  # pytest ran no test (not installed, a collection error): no figure of it
        raise RuntimeError(f"pytest ran no test (exit status {rc}): {_last(lines)}")
    fig["failed"] = _count(summary, "failed") + _count(summary, "error")


def _last(lines: list[str]) -> str:
    """The last non-blank line a child wrote (what it said when it ended), or 'no output'."""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")[:200]


def _pytest_summary(lines: list[str], rc: int | None) -> str:
    """pytest's last summary line ("3 failed, 120 passed, 4 skipped in 99.1s"), or what stands for it."""
    found = [ln for ln in lines if " in " in ln and any(w in ln for w in ("passed", "failed", "error", "skipped"))]
    return found[-1].strip("= ") if found else f"no summary (exit status {rc})"


def step_kernels(fig: Figures, dry: bool) -> None:
    if dry:  # the difference form's parity checks as gpu_kernels runs them, tiny shapes, one call for a timing
        import torch

        from gpu_kernels import rows_section
        from sicl_fast.kernels._configs import FAMILIES

        tiny = {"tests": dict(FAMILIES["tests"], V=500, softcap=None, attn_cap=None, qk_norm=False)}
        checks = rows_section(lambda *a: None, torch.device("cpu"), lambda fn: (fn(), 0.0)[1], tiny, (2,), (8,),
                              torch_too=False)
    else:
        try:
            rc, lines = stream([sys.executable, str(HERE / "gpu_kernels.py"), "--quick"])
        except KeyboardInterrupt as exc:
            fig["parity_passed"] = sum(ln.startswith("- PASS: ") for ln in (exc.args[0] if exc.args else []))
            raise
        checks = [(ln[8:], True) for ln in lines if ln.startswith("- PASS: ")]
        checks += [(ln[8:], False) for ln in lines if ln.startswith("- FAIL: ")]
        fig["exit_status"] = rc
        if rc != 0 or not checks:  # it ended early or checked nothing: its parity is not measured, not "met"
            fig["parity_passed"], fig["parity_failed"] = sum(ok for _, ok in checks), [w for w, ok in checks if not ok]
            raise RuntimeError(f"gpu_kernels.py --quick ran {len(checks)} parity checks (exit status {rc}): "
                               f"{_last(lines)}")
    fig["parity_passed"] = sum(ok for _, ok in checks)
    fig["parity_failed"] = [what for what, ok in checks if not ok]


# Llama-3.1-8B's inner sizes (d, I) and the value rows of a reference pass at L 600; --dry-run: tiny ones
PIECE_SHAPES = {False: (4096, 14336, 600), True: (64, 224, 8)}


def step_bf16_pieces(fig: Figures, dry: bool) -> None:
    """The bf16-piece reference product and the plain float32 one against float64 (module docstring): max and mean
    relative error (|got - ref| over the largest and over the mean |ref|) of the MLP's products at Llama-3.1-8B's
    d and I, with the reduced-precision flag as the library leaves it, then forced on and off."""
    import torch

    from sicl_fast.models import reference
    from sicl_fast.ops import make_ops

    _, dev = _models(dry)
    d, inner, n = PIECE_SHAPES[dry]
    fig["shape"] = f"x [{n}, k] float32 @ W [o, k]^T bf16, (k, o) = ({d}, {inner}) and ({inner}, {d})"
    ops = make_ops("triton", dev).decoder  # the run's ops on CUDA (the interpreter's on the CPU)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"up": (d, inner), "down": (inner, d)}
    data = {k: (torch.randn(n, i, generator=g, device=dev),
                (0.02 * torch.randn(o, i, generator=g, device=dev)).to(torch.bfloat16)) for k, (i, o) in shapes.items()}
    flag = torch.backends.cuda.matmul
    before, split_was = flag.allow_bf16_reduced_precision_reduction, reference.SPLIT
    reference.SPLIT = "on" if dry else split_was  # the CPU emulates the pieces' product (reference.bf16_mm_f32)
    try:
        fig["split"] = reference.splits(dev)
        for label, value in (("as_left", None), ("reduction_on", True), ("reduction_off", False)):
            if value is not None:
                flag.allow_bf16_reduced_precision_reduction = value
            got = {}
            for k, (x, w) in data.items():
                ref = torch.mm(x.double(), w.double().t())
                got[f"{k}_pieces"] = _rel_errors(reference.reference_product(ops, x, w), ref)
                if label == "as_left":  # the float32 product's rounding: the floor the pieces are measured against
                    got[f"{k}_float32"] = _rel_errors(torch.mm(x, w.float().t()), ref)
            if label == "as_left":  # the flags the products ran under (TF32 would make the float32 floor 10-bit)
                got["allow_bf16_reduced_precision_reduction"] = flag.allow_bf16_reduced_precision_reduction
                got["float32_matmul_precision"] = torch.get_float32_matmul_precision()
            fig[label] = got
    finally:
        flag.allow_bf16_reduced_precision_reduction, reference.SPLIT = before, split_was


def _rel_errors(got, ref) -> dict:
    """{"max": max |got - ref| / max |ref|, "mean": mean |got - ref| / mean |ref|} in float64."""
    err, mag = (got.double() - ref).abs(), ref.abs()
    return {"max": float(err.max() / mag.max()), "mean": float(err.mean() / mag.mean())}


def _models(dry: bool):
    """gpu_suite's names, builder and device for this run (the smoke shapes on the CPU)."""
    import torch

    import gpu_suite

    return gpu_suite, torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")


def _step_ms(gs, eng, lm, L: int, N: int, steps: int, seed: int = 7) -> tuple[float, object]:
    """(ms a step of a whole calibration on `eng` (warm: its second run; every step run, the reads and reference
    refreshes of the plan's loop amortised), the StaticStep of that prompt: the engine's own where it keeps one)."""
    import torch

    prompt = gs.span_prompt(L, int(lm.head_weight.shape[0]), seed=seed)
    cfg = gs.step_config(lm, N, max_steps=steps)
    eng.calibrate(prompt, cfg)
    res, s = gs.Clock(lm.device, None).seconds(lambda: eng.calibrate(prompt, cfg))
    with torch.no_grad():
        X0 = lm.model.get_input_embeddings()(prompt.input_ids.to(lm.device)).float()
    st = (eng.steps.get(eng.backend, *gs.plan_step(eng.backend, cfg, prompt, X0, eng.steps.buckets))[0]
          if eng.steps is not None
          else gs.StaticStep(eng.backend, cfg, prompt, X0))
    return 1e3 * s / res.steps, st


def _refresh_ms(st, clock) -> float | None:
    """One refresh of the step's float32 reference (its forward's refresh), best of 3; None where it has none."""
    refresh = getattr(getattr(st, "forward", None), "refresh", None)
    if refresh is None or not getattr(st.forward, "refresh_every", 0):
        return None
    return 1e3 * min(clock.seconds(lambda: refresh(st.state.X))[1] for _ in range(3))


def step_smollm2(fig: Figures, dry: bool) -> None:
    import torch

    from sicl_fast.diagnostics.profile import kernels_per_step

    gs, dev = _models(dry)
    L, N, steps = (32, 2, 2) if dry else (256, 8, 64)
    fig["shape"] = f"L {L} N {N}, {steps} steps a calibration"
    lm = gs.build_model(gs.SMOL, dry, torch.float32, dev)
    eng = gs.Engine(lm)  # the plan's defaults, as a user gets them
    fig["plan"] = {k: str(getattr(eng.plan, k)) for k in ("impl", "attention", "diff_matmul", "graphs",
                                                          "length_buckets", "pack")}
    ms, st = _step_ms(gs, eng, lm, L, N, steps)
    fig["step_ms"] = ms
    clock = gs.Clock(dev, None)
    fig["refresh_ms"] = _refresh_ms(st, clock)
    count = kernels_per_step(st)
    fig["kernels"] = count.total
    fig["cuda_kernel_events"] = count.cuda_events
    plan = gs.make_plan(argparse.Namespace(smoke=dry, models=[gs.SMOL], lengths=[L], N=[N], pack=None, anchor=["none"],
                                           budget_s=1e9))
    suite = gs.Suite(plan, dev, torch.float32)
    suite._lm = (gs.SMOL, lm)  # the model built above: Suite.decode measures on it
    suite.decode(gs.SMOL, L)
    row = suite.out.decode[-1]
    fig["decode"] = {k: row.get(k) for k in ("status", "warm_ms_per_token", "new_ms_per_token", "note")}


def _anchor_ms(gs, lm, L: int, N: int) -> tuple[float, float]:
    """(ms of the compiled plain forward (gpu_suite.anchor_step) at L, N, seconds of its compile and first call)."""
    prompt = gs.span_prompt(L, int(lm.head_weight.shape[0]), seed=L * 100 + N)
    cfg = gs.step_config(lm, N)
    import torch

    with torch.no_grad():
        X0 = lm.model.get_input_embeddings()(prompt.input_ids.to(lm.device)).float()
    step, _ = gs.anchor_step(gs.Cell(lm=lm, prompt=prompt, cfg=cfg, X0=X0))
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    clock = gs.Clock(lm.device, gs.make_plan(argparse.Namespace(smoke=False, models=None, lengths=None, N=None,
                                                                pack=None, anchor=["none"], budget_s=1e9)))
    return clock.ms(step, 1e3 * clock.seconds(step)[1]), first


def _big(fig: Figures, dry: bool, name: str, fp8: bool) -> object:
    """The default, plain bf16 (and FP8) step of `name` at L 600 N 8: ms a step of a whole calibration each."""
    import torch

    gs, dev = _models(dry)
    L, N, steps = (48, 2, 2) if dry else (600, 8, 16)
    fig["shape"] = f"L {L} N {N}, {steps} steps a calibration"
    lm = gs.build_model(name, dry, torch.bfloat16, dev)
    modes = [("default", {}), ("plain_bf16", dict(diff_matmul="off"))] + ([("fp8", dict(diff_matmul="fp8"))]
                                                                         if fp8 else [])
    for mode, kw in modes:
        try:
            eng = gs.Engine(lm, **kw)
            fig[f"{mode}_ms"] = _step_ms(gs, eng, lm, L, N, steps)[0]
        except Exception as exc:  # noqa: BLE001 - a mode this tree or device refuses: its reason is the figure
            fig[f"{mode}_ms"] = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        eng = None
        _clean(dev)
    return lm


def step_llama(fig: Figures, dry: bool) -> None:
    import torch

    gs, dev = _models(dry)
    lm = _big(fig, dry, gs.LLAMA, fp8=True)
    L, N = (48, 2) if dry else (600, 8)
    # peak memory over 12 length buckets: one engine (its step cache), a prompt in each bucket, 2 steps each
    lengths = [40, 50, 60] if dry else [int(200 * 2 ** (i / 4)) for i in range(12)]
    eng = gs.Engine(lm)
    cfg = gs.step_config(lm, N, max_steps=2)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, Lb in enumerate(lengths):
        eng.calibrate(gs.span_prompt(Lb, int(lm.head_weight.shape[0]), seed=i), cfg)
        fig["buckets_run"] = i + 1
    fig["steps_built"] = eng.steps.cache.stats["builds"] if eng.steps is not None else None
    fig["lengths"] = lengths
    if dev.type == "cuda":
        fig["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        fig["device_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
    eng = None
    _clean(dev)


def step_anchor(fig: Figures, dry: bool) -> None:
    """torch.compile of the plain bf16 forward (gpu_suite.anchor_step, Inductor with CUDA graphs) at SmolLM2 L 256 N 8
    and Llama-3.1-8B L 600 N 8: ms a call, and the seconds of its compile and first call."""
    import torch

    gs, dev = _models(dry)
    for key, name, L, N in (("smollm2", gs.SMOL, 256, 8), ("llama", gs.LLAMA, 600, 8)):
        if dev.type != "cuda":
            fig[f"{key}_ms"] = "n/a (cpu): the anchor compiles with CUDA graphs"
            continue
        lm = gs.build_model(name, dry, torch.bfloat16, dev)
        t0 = time.perf_counter()
        fig[f"{key}_ms"], fig[f"{key}_compile_s"] = _anchor_ms(gs, lm, L, N)
        fig[f"{key}_step_s"] = time.perf_counter() - t0
        lm = None
        _clean(dev)


def step_gemma2(fig: Figures, dry: bool) -> None:
    gs, _ = _models(dry)
    _big(fig, dry, gs.GEMMA, fp8=False)


def step_length_mix(fig: Figures, dry: bool) -> None:
    import torch

    import length_mix

    gs, dev = _models(dry)
    n, lo, hi, steps, N = (3, 40, 90, 2, 2) if dry else (24, 200, 600, 50, 8)
    lm = gs.build_model(gs.SMOL, dry, torch.float32, dev)
    prompts = length_mix.mix_prompts(int(lm.head_weight.shape[0]), n, lo, hi)
    res = length_mix.measure(lm, prompts, steps, N, ("repeated", "buckets"))  # exact: a capture a length, too long
    fig["shape"] = f"{n} prompts of {lo}-{hi} tokens, {steps} steps, N {N}"
    for mode, r in res.items():
        fig[mode] = {k: r.get(k) for k in ("ms_per_prompt", "ratio", "steps_built", "length_buckets", "graphs")}


def _clean(dev) -> None:
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _count(summary: str, word: str) -> int:
    """The number before `word` in a pytest summary line (0 when it is not there)."""
    parts = summary.replace(",", " ").split()
    return sum(int(parts[i - 1]) for i, p in enumerate(parts) if p.startswith(word) and parts[i - 1].isdigit())


STEP_FUNCTIONS = {"cuda_tests": step_cuda_tests, "kernels": step_kernels, "bf16_pieces": step_bf16_pieces,
                  "smollm2": step_smollm2, "llama": step_llama, "gemma2": step_gemma2, "length_mix": step_length_mix,
                  "anchor": step_anchor}
assert list(STEP_FUNCTIONS) == list(STEPS)


# ------------------------------------------------------------------------------------------------ the targets


def _get(results: dict, step: str, *keys):
    """A figure of a step that ran to its end (None otherwise: a step cut short keeps its figures under _partial)."""
    v = results.get(step, {})
    if v.get("_status") != "ok":
        return None
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def outcome(status: str | None) -> str:
    """The kind of a step's status: 'ok', 'skipped', 'failed', 'timed out', 'interrupted', or 'not run' (None)."""
    if status is None:
        return "not run"
    return next((k for k in ("ok", "skipped", "failed", "timed out", "interrupted") if status.startswith(k)),
                "failed")


# bf16_pieces: the bound of tests/test_cuda.py's split-reference test (test_refresh.py's): 1e-5 of the largest element
PIECES_MAX_REL = 1e-5


def targets(results: dict, cuda: bool) -> list:
    """(target of issue #49 / #53, figure, status) rows: status 'met', 'missed', 'not measured' (with the step that
    did not end and why), or 'n/a (cpu)' (the CPU form: tiny shapes, every figure only a sign that its path ran). A
    figure is shown only from steps that ran to their end."""
    rows = []

    def num(x):
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    def add(target: str, steps: tuple, value, ok, shown: str | None = None) -> None:
        short = [f"{s} {outcome(results.get(s, {}).get('_status'))}" for s in steps
                 if outcome(results.get(s, {}).get("_status")) != "ok"]
        if short:  # no figure of a step that did not end: say which and why
            rows.append((target, "-", f"not measured: {', '.join(short)}"))
            return
        if not cuda:  # the CPU form's tiny shapes: the figure shows the path ran, not the target
            status = "n/a (cpu)"
        elif value is None or ok is None:
            status = "not measured"
        else:
            status = "met" if ok else "missed"
        rows.append((target, shown if shown is not None else ("-" if value is None else str(value)), status))

    failed = _get(results, "cuda_tests", "failed")
    add("CUDA tests and kernel tests pass", ("cuda_tests",), failed, None if failed is None else failed == 0,
        _get(results, "cuda_tests", "summary"))
    bad = _get(results, "kernels", "parity_failed")
    passed = _get(results, "kernels", "parity_passed")
    add("kernel parity at real shapes (gpu_kernels.py --quick): every check PASS", ("kernels",), bad,
        None if bad is None else not bad, None if bad is None else f"{passed} PASS, {len(bad)} FAIL")
    pieces = [num(_get(results, "bf16_pieces", "as_left", f"{k}_pieces", "max")) for k in ("up", "down")]
    floor = [num(_get(results, "bf16_pieces", "as_left", f"{k}_float32", "max")) for k in ("up", "down")]
    have = None not in pieces and None not in floor
    add(f"bf16-piece reference product at Llama-3.1-8B's d / I within {PIECES_MAX_REL:g} of its largest element "
        "(float64 product; #53)", ("bf16_pieces",), pieces[0], max(pieces) <= PIECES_MAX_REL if have else None,
        f"max rel {max(pieces):.1e} (float32 product {max(floor):.1e})" if have else None)
    ms = num(_get(results, "smollm2", "step_ms"))
    add("SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised)", ("smollm2",), ms,
        None if ms is None else ms <= 2.5,
        None if ms is None else f"{ms:.3f} ms (refresh {_fmt(_get(results, 'smollm2', 'refresh_ms'))} ms)")
    anchor = num(_get(results, "anchor", "smollm2_ms"))
    add("SmolLM2 step faster than torch.compile of the plain forward (3.2 ms on the H200)", ("smollm2", "anchor"),
        anchor, None if ms is None or anchor is None else ms < anchor,
        None if ms is None or anchor is None else f"{ms:.3f} vs {anchor:.3f} ms")
    k = num(_get(results, "smollm2", "kernels"))
    add("SmolLM2 step <= 300 kernels", ("smollm2",), k, None if k is None else k <= 300)
    for step, name in (("llama", "Llama-3.1-8B"), ("gemma2", "Gemma-2-2B")):
        d, p = num(_get(results, step, "default_ms")), num(_get(results, step, "plain_bf16_ms"))
        add(f"{name} L 600 N 8 default step within 1.15x of the plain bf16 step", (step,), d,
            None if d is None or p is None else d <= 1.15 * p,
            None if d is None or p is None else f"{d:.2f} vs {p:.2f} ms ({d / p:.2f}x)")
    f8, a = _get(results, "llama", "fp8_ms"), num(_get(results, "anchor", "llama_ms"))
    ok = None if num(f8) is None or a is None else a / f8 >= 1.5
    shown = (f8 if isinstance(f8, str) else None if f8 is None else f"{f8:.2f} ms, no anchor" if a is None
             else f"{a / f8:.2f}x ({f8:.2f} vs {a:.2f} ms)")
    add("Llama-3.1-8B with FP8 differences >= 1.5x the compiled anchor", ("llama", "anchor"), num(f8), ok, shown)
    r = num(_get(results, "length_mix", "buckets", "ratio"))
    add("24-prompt 200-600 mix within 1.3x of one repeated length", ("length_mix",), r,
        None if r is None else r <= 1.3, None if r is None else f"{r:.2f}x")
    peak, total = num(_get(results, "llama", "peak_gib")), num(_get(results, "llama", "device_gib"))
    add("peak memory over 12 buckets at Llama shape within the device", ("llama",), peak,
        None if peak is None or total is None else peak < total,
        None if peak is None else f"{peak:.1f} of {total:.1f} GiB")
    dec = num(_get(results, "smollm2", "decode", "warm_ms_per_token"))
    add("decode <= 1.5 ms a token", ("smollm2",), dec, None if dec is None else dec <= 1.5, _fmt(dec, " ms"))
    return rows


def _fmt(x, unit: str = "") -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.3f}{unit}"


def table(results: dict, cuda: bool, device: str) -> str:
    lines = [f"## bench/gpu_check.py on {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| target (issues #49, #53) | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {s} |" for t, v, s in targets(results, cuda)]
    steps = [f"{k}: {v['_status']}" for k, v in results.items() if isinstance(v, dict) and "_status" in v]
    return "\n".join(lines + ["", "Steps: " + "; ".join(steps) + "."]) + "\n"


# ------------------------------------------------------------------------------------------------ running


class StepTimeout(Exception):
    pass


def run_in_process(step: str, out: Path, dry: bool, timeout: float | None) -> str:
    """One step in this process (--dry-run under an alarm of `timeout` s; the child, whose parent interrupts it):
    its status, 'ok', 'failed: ...' or 'timed out ...'."""
    def alarm(*_):
        raise StepTimeout(f"over {timeout:.0f} s")

    if timeout is not None:
        old = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(max(1, int(timeout)))
    try:
        STEP_FUNCTIONS[step](Figures(out, step), dry)
        return "ok"
    except (StepTimeout, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt) and timeout is not None:  # Ctrl-C in the CPU form: stop there
            raise
        print(f"{step}: its time is up; its figures so far are kept in {step}.json", flush=True)
        return f"timed out after {timeout or STEPS[step]:.0f} s"
    except Exception as exc:  # noqa: BLE001 - a step's failure is its status; the check goes on
        import traceback

        traceback.print_exc()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        if timeout is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def run_child(step: str, out: Path, timeout: float) -> str:
    """One step in a child interpreter (its output, and its own children's, streamed to OUT/<step>.log as it runs),
    stopped after `timeout` s as `timeout -s INT` does: SIGINT to its process group, SIGKILL GRACE_S later. Its
    status: 'ok', 'failed (...)' or 'timed out after N s', each with the last line the step wrote."""
    out = out.absolute()  # the child runs from the tree's root: a relative OUT would name another folder there
    log_path = out / f"{step}.log"
    # every line in the log as it is printed; the tree's package on the path of the child's own children too
    # (bench/gpu_kernels.py, pytest), which a plain copy has not installed
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with open(log_path, "w") as log:  # a session of its own: the time limit reaches its children too
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--step", step, "--out", str(out)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        except KeyboardInterrupt:  # this check's Ctrl-C or SIGTERM: its child, a session of its own, stops with it
            stop(proc)
            raise
    last = _tail(log_path, 1)
    said = f"; its last line: {last[0][:200]!r}" if last else "; it wrote nothing"
    if rc is None or rc == INTERRUPTED:
        return f"timed out after {timeout:.0f} s ({step}.log holds what it wrote{said})"
    return "ok" if rc == 0 else f"failed (exit status {rc}; see {step}.log{said})"


def stop(proc) -> None:
    """Stop a step's child and its own children (its process group) as `timeout -s INT` does: SIGINT, SIGKILL GRACE_S
    later (at once on a second Ctrl-C), and SIGKILL to whatever of the group outlived the child, so that nothing of
    the step keeps running, or holds the device, after it."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=GRACE_S)
    except ProcessLookupError:
        pass
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, n: int) -> list[str]:
    """The last n non-blank lines of a text file ([] when there is none)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


def collect(out: Path, step: str, status: str) -> dict:
    """A step's entry of check.json: its status; its figures only when it ran to its end (a step cut short or failed
    keeps what it had under _partial, never read as a figure)."""
    path = out / f"{step}.json"
    figures = json.loads(path.read_text()) if path.is_file() else {}
    if status == "ok":
        return dict(figures, _status=status)
    return {"_status": status, **({"_partial": figures} if figures else {})}


def out_problem(out: Path) -> str | None:
    """Why --out cannot take this run's figures (a file; a folder that holds an earlier run's files; one that cannot be
    made or written: under a file, no permission), or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    above = next(p for p in out.parents if p.exists() or p == p.parent) if not out.exists() else out
    if not above.is_dir():
        return f"--out {out} cannot be made: {above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"--out {out} cannot be {'written' if above == out else 'made'}: no permission in {above}"
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        names = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        return (f"--out {out} already holds {len(held)} files ({names}): give a new or empty folder, so that no "
                "figure of an earlier run is read as this run's")
    return None


def main(argv=None) -> int:
    ap = _Parser(prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new or empty folder the figures go to as they are measured "
                                                 "(e.g. $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="the CPU form: tiny shapes, every step in this process")
    ap.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), help="the steps to run, in order")
    ap.add_argument("--budget-s", type=arg_type("check_budget_s"), default=540.0,
                    help="the whole check's seconds (default 540: 9 minutes)")
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # a child runs one step
    args = ap.parse_args(argv)
    out = Path(args.out).absolute()  # the children run from the tree's root (run_child), whatever this cwd is
    if args.step:  # the child: its status is its exit code; its parent stops it with SIGINT
        status = run_in_process(args.step, out, False, None)
        return 0 if status == "ok" else INTERRUPTED if status.startswith("timed out") else 1
    problem = out_problem(out)
    if problem:
        print(f"gpu_check.py: error: {problem}", file=sys.stderr)
        return 2
    if args.dry_run:  # Triton's interpreter for the CPU form, set before triton is first imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("gpu_check.py: error: --dry-run needs Triton's interpreter, and triton was imported without "
                  "TRITON_INTERPRET=1 in this process: run it in a new one", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_check.py: error: TRITON_INTERPRET is set: unset it to run the compiled kernels", file=sys.stderr)
        return 2
    if not cuda and not args.dry_run:
        print("gpu_check.py: error: no CUDA device: bench/gpu_check.py measures on a GPU; --dry-run runs its CPU "
              "form", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # what out_problem cannot foresee (a read-only file system, /proc)
        print(f"gpu_check.py: error: --out {out} cannot be made: {exc.strerror or exc}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda else "CPU (--dry-run)"
    t0 = time.perf_counter()
    import sicl_fast

    print(f"# gpu_check on {device}: steps {', '.join(args.steps)}; figures in {out}; sicl_fast from "
          f"{Path(sicl_fast.__file__).parent}, torch {torch.__version__}", flush=True)
    before = signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the step's child stopped, the table written
    try:
        return _run_steps(args, out, cuda, device, t0)
    finally:
        signal.signal(signal.SIGTERM, before)


def _run_steps(args, out: Path, cuda: bool, device: str, t0: float) -> int:
    """main's steps, in order, each under its share of the budget from t0; check.json after each, check.md at the end
    (module docstring)."""
    results, interrupted = {}, False
    for step in args.steps:
        left = args.budget_s - (time.perf_counter() - t0)
        room = left - GRACE_S if cuda else left  # a child's SIGINT leaves it GRACE_S to end
        try:
            if room < MIN_STEP_S:
                status = f"skipped: {max(left, 0):.0f} s of the budget left"
            elif cuda:
                status = run_child(step, out, min(STEPS[step], room))
            else:
                status = run_in_process(step, out, True, min(DRY_TIMEOUT, room))
        except KeyboardInterrupt:
            status, interrupted = "interrupted (Ctrl-C or SIGTERM): the check stopped here", True
        results[step] = collect(out, step, status)
        print(f"[{time.perf_counter() - t0:6.1f} s] {step}: {status}", flush=True)
        if cuda and status != "ok" and not status.startswith("skipped"):  # what it wrote last, here too
            print("\n".join(f"    {ln}" for ln in _tail(out / f"{step}.log", 12)), flush=True)
        (out / "check.json").write_text(json.dumps(results, indent=1, default=str))
        if interrupted:
            break
    md = table(results, cuda, device)
    (out / "check.md").write_text(md)
    print("\n" + md)
    if interrupted:
        return 130  # as a shell reports a command ended by Ctrl-C
    return 0 if all(v["_status"] == "ok" for v in results.values()) else 1


def _terminated(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


if __name__ == "__main__":
    sys.exit(main())
