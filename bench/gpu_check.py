"""The prepared device check: what the GPU verification issue (#49) measures first, within 9 minutes on one H100 / H200,
each long step a child process under its own timeout, every figure written to --out as it is measured, then one table
of that issue's targets beside the figures. The first call on a GPU machine (docs/gpu_runbook.md).

    python bench/gpu_check.py --out $OUT                    # CUDA: about 9 minutes
    python bench/gpu_check.py --out /tmp/check --dry-run    # the CPU form: tiny shapes, in one process (a test)

The steps, most important first (the figures' models: random weights at the shapes of bench/models/*.json, built by
bench/gpu_suite.py; --dry-run: its two-layer smoke shapes):
    cuda_tests  tests/test_cuda.py and the kernel tests on the device (conftest's TRITON_DEVICE is CUDA there);
                --dry-run: the command only (on the CPU they are the suite's own)
    kernels     bench/gpu_kernels.py --quick: parity (PASS / FAIL) and timing at real shapes; --dry-run: its
                difference-form parity checks (rows_section) at tiny shapes under Triton's interpreter
    smollm2     the default step at SmolLM2 L 256 N 8 with float32 weights (what --dtype auto gives the registry's GGUF
                models; every other choice the plan's default: bf16 difference products, Triton, graphs, buckets): ms
                a step over a whole calibration (its reads and reference refreshes amortised), the kernels a step,
                one refresh's ms; torch.compile of the plain bf16 forward (bench/gpu_suite.anchor_step); decode
                ms a token (gpu_suite's Suite.decode)
    llama       Llama-3.1-8B at L 600 N 8, bf16 weights: the default step, the plain bf16 step (diff_matmul 'off'),
                FP8 differences; peak memory over 12 length buckets (one engine, prompts of 12 buckets' lengths, 2
                steps each); last, the compiled anchor
    gemma2      Gemma-2-2B at L 600 N 8, bf16: the default and the plain bf16 step
    length_mix  bench/length_mix.measure: 24 prompts of 200-600 tokens with length buckets against one repeated
                length (SmolLM2 shape)

OUT holds <step>.log (the child's output, as it runs), <step>.json (its figures, rewritten after each), check.json
(all of them) and check.md (the table). Exit status 0 when every step ran (a missed target is a finding, not a
failure), 1 when a step failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(HERE))

KERNEL_TESTS = ["tests/test_cuda.py", "tests/test_kernel_proxy.py", "tests/test_kernel_rng.py",
                "tests/test_kernel_span_logprobs.py", "tests/test_rows_triton.py", "tests/test_rows_ops.py",
                "tests/test_ops.py", "tests/test_fused_decoder.py", "tests/test_launch.py"]
# step -> its timeout on the GPU (s); 530 in all, the 9 minutes less the parent's own start
STEPS = {"cuda_tests": 90, "kernels": 60, "smollm2": 90, "llama": 180, "gemma2": 60, "length_mix": 50}
DRY_TIMEOUT = 120  # --dry-run: each step in this process under an alarm


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


# ------------------------------------------------------------------------------------------------ the steps


def step_cuda_tests(fig: Figures, dry: bool) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda or not cuda", "-p", "no:cacheprovider", *KERNEL_TESTS]
    fig["command"] = " ".join(cmd[1:])
    if dry:
        fig["summary"] = "n/a (cpu): the suite runs these on the CPU"
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout[-6000:] + proc.stderr[-2000:], flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if " in " in ln and ("passed" in ln or "failed" in ln)]
    fig["summary"] = lines[-1].strip("= ") if lines else f"no summary (exit status {proc.returncode})"
    fig["failed"] = _count(fig["summary"], "failed") + _count(fig["summary"], "error")


def step_kernels(fig: Figures, dry: bool) -> None:
    if dry:  # the difference form's parity checks as gpu_kernels runs them, tiny shapes, one call for a timing
        import torch

        from gpu_kernels import rows_section
        from sicl_fast.kernels._configs import FAMILIES

        tiny = {"tests": dict(FAMILIES["tests"], V=500, softcap=None, attn_cap=None, qk_norm=False)}
        checks = rows_section(lambda *a: None, torch.device("cpu"), lambda fn: (fn(), 0.0)[1], tiny, (2,), (8,),
                              torch_too=False)
    else:
        proc = subprocess.run([sys.executable, str(HERE / "gpu_kernels.py"), "--quick"], cwd=ROOT,
                              capture_output=True, text=True)
        print(proc.stdout + proc.stderr[-3000:], flush=True)
        checks = [(ln[8:], True) for ln in proc.stdout.splitlines() if ln.startswith("- PASS: ")]
        checks += [(ln[8:], False) for ln in proc.stdout.splitlines() if ln.startswith("- FAIL: ")]
        fig["exit_status"] = proc.returncode
    fig["parity_passed"] = sum(ok for _, ok in checks)
    fig["parity_failed"] = [what for what, ok in checks if not ok]


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
    if dev.type == "cuda":  # torch.compile of the plain bf16 forward: the anchor of the GPU suite
        lm16 = gs.build_model(gs.SMOL, dry, torch.bfloat16, dev)
        fig["anchor_ms"] = _anchor_ms(gs, lm16, L, N)
        lm16 = None
    plan = gs.make_plan(argparse.Namespace(smoke=dry, models=[gs.SMOL], lengths=[L], N=[N], pack=None, anchor=["none"],
                                           budget_s=1e9))
    suite = gs.Suite(plan, dev, torch.float32)
    suite._lm = (gs.SMOL, lm)  # the model built above: Suite.decode measures on it
    suite.decode(gs.SMOL, L)
    row = suite.out.decode[-1]
    fig["decode"] = {k: row.get(k) for k in ("status", "warm_ms_per_token", "new_ms_per_token", "note")}


def _anchor_ms(gs, lm, L: int, N: int) -> float:
    """ms of the compiled plain forward (gpu_suite.anchor_step) at L, N: compiled on its first call."""
    prompt = gs.span_prompt(L, int(lm.head_weight.shape[0]), seed=L * 100 + N)
    cfg = gs.step_config(lm, N)
    import torch

    with torch.no_grad():
        X0 = lm.model.get_input_embeddings()(prompt.input_ids.to(lm.device)).float()
    step, _ = gs.anchor_step(gs.Cell(lm=lm, prompt=prompt, cfg=cfg, X0=X0))
    step()
    clock = gs.Clock(lm.device, gs.make_plan(argparse.Namespace(smoke=False, models=None, lengths=None, N=None,
                                                                pack=None, anchor=["none"], budget_s=1e9)))
    return clock.ms(step, 1e3 * clock.seconds(step)[1])


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
    if dev.type == "cuda":  # last: its compile takes the longest
        fig["anchor_ms"] = _anchor_ms(gs, lm, L, N)


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


STEP_FUNCTIONS = {"cuda_tests": step_cuda_tests, "kernels": step_kernels, "smollm2": step_smollm2,
                  "llama": step_llama, "gemma2": step_gemma2, "length_mix": step_length_mix}


# ------------------------------------------------------------------------------------------------ the targets


def _get(results: dict, step: str, *keys):
    v = results.get(step, {})
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def targets(results: dict, cuda: bool) -> list:
    """(target of issue #49, figure, status) rows: status 'met', 'missed', 'not measured', or 'n/a (cpu)' (the CPU
    form: tiny shapes, every figure only a sign that its path ran)."""
    rows = []

    def num(x):
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    def add(target: str, value, ok, shown: str | None = None) -> None:
        if not cuda:  # the CPU form's tiny shapes: the figure shows the path ran, not the target
            status = "n/a (cpu)"
        elif value is None or ok is None:
            status = "not measured"
        else:
            status = "met" if ok else "missed"
        rows.append((target, shown if shown is not None else ("-" if value is None else str(value)), status))

    failed = _get(results, "cuda_tests", "failed")
    add("CUDA tests and kernel tests pass", failed, None if failed is None else failed == 0,
        _get(results, "cuda_tests", "summary"))
    bad = _get(results, "kernels", "parity_failed")
    passed = _get(results, "kernels", "parity_passed")
    add("kernel parity at real shapes (gpu_kernels.py --quick): every check PASS", bad,
        None if bad is None else not bad, None if bad is None else f"{passed} PASS, {len(bad)} FAIL")
    ms, anchor = num(_get(results, "smollm2", "step_ms")), num(_get(results, "smollm2", "anchor_ms"))
    add("SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised)", ms, None if ms is None else ms <= 2.5,
        None if ms is None else f"{ms:.3f} ms (refresh {_fmt(_get(results, 'smollm2', 'refresh_ms'))} ms)")
    add("SmolLM2 step faster than torch.compile of the plain forward (3.2 ms on the H200)", anchor,
        None if ms is None or anchor is None else ms < anchor,
        None if anchor is None else f"{ms:.3f} vs {anchor:.3f} ms")
    k = num(_get(results, "smollm2", "kernels"))
    add("SmolLM2 step <= 300 kernels", k, None if k is None else k <= 300)
    for step, name in (("llama", "Llama-3.1-8B"), ("gemma2", "Gemma-2-2B")):
        d, p = num(_get(results, step, "default_ms")), num(_get(results, step, "plain_bf16_ms"))
        add(f"{name} L 600 N 8 default step within 1.15x of the plain bf16 step", d,
            None if d is None or p is None else d <= 1.15 * p,
            None if d is None or p is None else f"{d:.2f} vs {p:.2f} ms ({d / p:.2f}x)")
    f8, a = _get(results, "llama", "fp8_ms"), num(_get(results, "llama", "anchor_ms"))
    ok = None if num(f8) is None or a is None else a / f8 >= 1.5
    shown = (f8 if isinstance(f8, str) else None if f8 is None else f"{f8:.2f} ms, no anchor" if a is None
             else f"{a / f8:.2f}x ({f8:.2f} vs {a:.2f} ms)")
    add("Llama-3.1-8B with FP8 differences >= 1.5x the compiled anchor", num(f8), ok, shown)
    r = num(_get(results, "length_mix", "buckets", "ratio"))
    add("24-prompt 200-600 mix within 1.3x of one repeated length", r, None if r is None else r <= 1.3,
        None if r is None else f"{r:.2f}x")
    peak, total = num(_get(results, "llama", "peak_gib")), num(_get(results, "llama", "device_gib"))
    add("peak memory over 12 buckets at Llama shape within the device", peak,
        None if peak is None or total is None else peak < total,
        None if peak is None else f"{peak:.1f} of {total:.1f} GiB")
    dec = num(_get(results, "smollm2", "decode", "warm_ms_per_token"))
    add("decode <= 1.5 ms a token", dec, None if dec is None else dec <= 1.5, _fmt(dec, " ms"))
    return rows


def _fmt(x, unit: str = "") -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.3f}{unit}"


def table(results: dict, cuda: bool, device: str) -> str:
    lines = [f"## bench/gpu_check.py on {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| target (issue #49) | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {s} |" for t, v, s in targets(results, cuda)]
    steps = [f"{k}: {v['_status']}" for k, v in results.items() if isinstance(v, dict) and "_status" in v]
    return "\n".join(lines + ["", "Steps: " + "; ".join(steps) + "."]) + "\n"


# ------------------------------------------------------------------------------------------------ running


class StepTimeout(Exception):
    pass


def run_in_process(step: str, out: Path, dry: bool, timeout: float) -> str:
    """One step in this process (--dry-run, and the child's own run) under an alarm: its status."""
    def alarm(*_):
        raise StepTimeout(f"over {timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(max(1, int(timeout)))
    try:
        STEP_FUNCTIONS[step](Figures(out, step), dry)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - a step's failure is its status; the check goes on
        import traceback

        traceback.print_exc()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_child(step: str, out: Path, timeout: float) -> str:
    """One step in a child interpreter (its output to OUT/<step>.log as it runs), killed after `timeout` s."""
    with open(out / f"{step}.log", "w") as log:  # a session of its own: a timeout ends its children too
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--step", step, "--out", str(out)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:.0f} s (its figures so far kept)"
    return "ok" if rc == 0 else f"failed (exit status {rc}; see {step}.log)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder the figures go to as they are measured (e.g. $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="the CPU form: tiny shapes, every step in this process")
    ap.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), help="the steps to run, in order")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole check's seconds (default 540: 9 minutes)")
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # a child runs one step
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.step:  # the child: its status is its exit code
        return 0 if run_in_process(args.step, out, False, STEPS[args.step]) == "ok" else 1
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to run the compiled kernels.")
        return 1
    if not cuda and not args.dry_run:
        print("No CUDA device: bench/gpu_check.py measures on a GPU; --dry-run runs its CPU form.")
        return 1
    device = torch.cuda.get_device_name(0) if cuda else "CPU (--dry-run)"
    t0, results = time.perf_counter(), {}
    print(f"# gpu_check on {device}: steps {', '.join(args.steps)}; figures in {out}", flush=True)
    for step in args.steps:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 10:
            status = "skipped: the budget is spent"
        elif cuda:
            status = run_child(step, out, min(STEPS[step], left))
        else:
            status = run_in_process(step, out, True, min(DRY_TIMEOUT, left))
        path = out / f"{step}.json"
        results[step] = dict(json.loads(path.read_text()) if path.is_file() else {}, _status=status)
        print(f"[{time.perf_counter() - t0:6.1f} s] {step}: {status}", flush=True)
        (out / "check.json").write_text(json.dumps(results, indent=1, default=str))
    md = table(results, cuda, device)
    (out / "check.md").write_text(md)
    print("\n" + md)
    return 0 if all(v["_status"] == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
