"""The Triton kernel specialisations a test selection compiles on a GPU, and what compiling them from a cold Triton
cache costs for sm_90, counted and timed without a GPU: what bench/gpu_check.py's cuda_tests step is sized from.

    python bench/cold_compiles.py tests/test_kernel_proxy.py tests/test_ops.py [-- PYTEST ARGS] [--out FILE.json]
    python bench/cold_compiles.py --engine                # test_cuda.py's engine work, on the CPU (below)
    python bench/cold_compiles.py --from FILE.json        # compile an earlier run's recording (its --out) again

1. The tests run here, in this process, under Triton's interpreter, each launcher taking its GPU launch
   configuration (kernels._utils.launch_config as on a GPU, not the interpreter's fewer, larger programs), and every
   launch's specialisation is recorded as Triton's JIT keys it on a GPU: its own binder for an sm_90 target
   (argument types, pointers and ints divisible by 16, ints equal to 1, constexprs, warps, stages, options), with
   the interpreter's own constexpr (UPCAST: its dot has no bf16) as a GPU passes it.
2. Each distinct specialisation is compiled for sm_90 in a fresh interpreter with an empty Triton cache
   (TRITON_INTERPRET=0; Triton's own ptxas) and timed, and so is each distinct launcher (the C module Triton builds
   for a signature and its constants, compiled with the C compiler as Triton does, not linked against libcuda,
   which a machine without a GPU lacks).
3. Per test file, in the order given: its tests, those skipped here, the specialisations it is the first to need,
   and their seconds; then the whole selection's.

CUDA-only tests (tests/test_cuda.py) skip on the CPU and record nothing. `--engine` runs, on the CPU, what those tests
run on the GPU: the fast backend's span log-probs of every tiny family of tests/test_fast_backend.py, float32 and
bf16, Triton ops (test_cuda.py's first test, 14 of its 24), and a seeded static calibration of each family.
The figures are CPU seconds of this machine (the compiling process's and its children's, ptxas and the C compiler:
on a loaded machine its wall time would count the other processes' turns), one compile at a time, as pytest compiles
on a GPU (one process, each specialisation at its first launch); a GPU machine's CPU may be faster or slower.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_ARCH = 90


# ------------------------------------------------------------------------------------------------ recording


class Recorder:
    """Every launch's JIT specialisation, by the test that made it (a pytest plugin; `record` is called by the
    launch wrapper)."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", TARGET_ARCH, 32))
        self.jit: dict = {}
        self.specs: dict = {}  # key -> the specialisation (JSON-able)
        self.by_test: dict = defaultdict(list)  # nodeid -> keys in first-launch order
        self.outcomes: dict = {}  # nodeid -> passed / failed / skipped
        self.current = "(outside a test)"

    def record(self, kernel, args, kwargs: dict) -> None:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        fn = getattr(kernel, "fn", None)
        if fn is None:  # not a Triton kernel (a test's stand-in for one)
            return
        if fn not in self.jit:  # the JIT function the kernel is on a GPU: its do_not_specialize lists too
            jf = JITFunction(fn, **{k: v for k, v in getattr(kernel, "kwargs", {}).items()
                                    if k in ("do_not_specialize", "do_not_specialize_on_alignment")})
            self.jit[fn] = (jf, create_function_from_signature(jf.signature, jf.params, self.backend))
        jf, binder = self.jit[fn]
        kwargs = dict(kwargs)
        if "UPCAST" in kwargs:  # the interpreter's own constexpr (kernels/attention.py, span_logprobs.py)
            kwargs["UPCAST"] = False
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jf._pack_args(self.backend, kwargs, bound, specialization, options)
        opts = {k: v for k, v in kwargs.items() if k not in jf.arg_names}
        spec = {"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
                "constexprs": sorted([list(k), v] for k, v in constexprs.items()),
                "attrs": sorted([list(k), v] for k, v in attrs.items()), "options": dict(sorted(opts.items()))}
        key = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.specs.setdefault(key, spec)
        keys = self.by_test[self.current]
        if key not in keys:
            keys.append(key)

    # pytest hooks
    def pytest_runtest_logstart(self, nodeid, location):
        self.current = nodeid

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)


def install(recorder: Recorder) -> None:
    """Every kernel module's `launch` records before it launches, and its `launch_config` gives the GPU's
    configuration (the kernel modules import both by name from kernels._utils)."""
    import importlib
    import pkgutil

    import sicl_fast.kernels as K
    from sicl_fast.kernels import _utils

    launch, config = _utils.launch, _utils.launch_config

    def recording_launch(kernel, grid, *args, device, block: int = 1, num_warps: int | None = None, **meta):
        recorder.record(kernel, args, dict(meta, num_warps=num_warps or _utils.num_warps_for(block)))
        return launch(kernel, grid, *args, device=device, block=block, num_warps=num_warps, **meta)

    def gpu_config(op, interp=None, *a, **kw):
        return config(op, False if interp is None else interp, *a, **kw)

    for info in pkgutil.iter_modules(K.__path__):
        if info.name == "_utils":  # its own names stay (tests/test_launch.py calls _utils.launch itself)
            continue
        mod = importlib.import_module(f"{K.__name__}.{info.name}")
        if getattr(mod, "launch", None) is launch:
            mod.launch = recording_launch
        if getattr(mod, "launch_config", None) is config:
            mod.launch_config = gpu_config


def engine_work() -> None:
    """What tests/test_cuda.py runs on the GPU, here on the CPU with the Triton ops: each tiny family's fast-backend
    span log-probs in float32 (fast-fp32) and bf16 (fast) at prefixes 0, 6 and 14 (its first test); the engine's
    static calibrations of its other tests (Llama float32 fast-fp32; Gemma 2 float32 and bf16 fast on three prompts,
    then decoding; Llama float32 and bf16 fast past the first refresh; Qwen3 float32 decoding), uncaptured."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from test_fast_backend import SUPPORTED_FAMILIES, build, make_prompt, perturbed
    from test_graphs import moved
    from test_static import BASE

    from sicl_fast.backends import make_backend
    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.engine import Engine
    from sicl_fast.models import from_transformers

    def in_dtype(lm, dtype):
        return from_transformers(copy.deepcopy(lm.model).to(dtype), lm.tokenizer, name=f"{lm.name}-{dtype}")

    models = {f: build(f) for f in SUPPORTED_FAMILIES}
    for lm in models.values():
        for dtype, backend in ((torch.float32, "fast-fp32"), (torch.bfloat16, "fast")):
            be = make_backend(backend, in_dtype(lm, dtype), impl="triton")
            for a in (0, 6, 14):
                p = make_prompt(a, seed=a)
                be.span_logprobs(perturbed(be.embed(p), a), p, near_row0=True)
    runs = [("llama", torch.float32, "fast-fp32", 6, [make_prompt(6, seed=1)])]
    runs += [("gemma2", dt, "fast", 7, [make_prompt(6, seed=1), moved(6, seed=2), make_prompt(0, seed=3)])
             for dt in (torch.float32, torch.bfloat16)]
    runs += [("llama", dt, "fast", 20, [make_prompt(6, seed=1)]) for dt in (torch.float32, torch.bfloat16)]
    for family, dtype, backend, steps, prompts in runs:
        eng = Engine(in_dtype(models[family], dtype), backend=backend, impl="triton", graphs="off", sync_every=3)
        for p in prompts:
            eng.calibrate(p, CalibrationConfig(**{**BASE, "max_steps": steps}))
        if family == "gemma2":
            eng.backend.generate(eng.backend.embed(make_prompt(6, seed=48))[:48], None, 12)
    eng = Engine(models["qwen3"], backend="fast-fp32", impl="triton", graphs="off")
    eng.backend.generate(eng.backend.embed(make_prompt(6, seed=4)), None, 16)


# ------------------------------------------------------------------------------------------------ compiling


def compile_specs(specs: list[dict]) -> list[dict]:
    """Each spec compiled for sm_90 in this interpreter (TRITON_INTERPRET=0, the caller's empty Triton cache): its
    seconds, and its launcher's (None where an earlier spec had the same launcher source)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    launchers, out = set(), []
    for s in specs:
        fn = getattr(importlib.import_module(s["module"]), s["kernel"])
        src = ASTSource(fn, s["signature"], {tuple(k): v for k, v in s["constexprs"]},
                        {tuple(k): v for k, v in s["attrs"]})
        t0, c0 = time.perf_counter(), cpu_seconds()
        try:
            k = triton.compile(src, target=target, options=backend.parse_options(dict(s["options"])).__dict__)
        except Exception as exc:  # noqa: BLE001 - a compile error is this spec's result
            out.append({"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}", "seconds": None,
                        "cpu_s": None})
            continue
        t1, c1 = time.perf_counter(), cpu_seconds()
        consts = {(fn.arg_names.index(i),) if isinstance(i, str) else i: v for i, v in src.constants.items()}
        c_src = driver.make_launcher(consts, dict(src.signature), getattr(k.metadata, "tensordesc_meta", None))
        launcher = None
        if c_src not in launchers:
            launchers.add(c_src)
            launcher = build_launcher(c_src, driver.include_dirs)
        out.append({"seconds": round(t1 - t0, 3), "cpu_s": round(c1 - c0, 3), "launcher_cpu_s": launcher,
                    "error": None})
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Triton's ptxas): a compile's cost on a loaded
    machine, where its wall time also counts the other processes' turns."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def build_launcher(c_src: str, include_dirs: list) -> float:
    """CPU seconds to compile a launcher's C source as triton.runtime.build does (-O3 -shared -fPIC), not linked."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "launcher.c"
        path.write_text(c_src)
        inc = [*include_dirs, sysconfig.get_paths()["include"]]
        c0 = cpu_seconds()
        subprocess.run(["gcc", str(path), "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", str(Path(d) / "l.so"),
                        *[f"-I{i}" for i in inc]], check=True, stdout=subprocess.DEVNULL)
        return round(cpu_seconds() - c0, 3)


def compile_cold(specs: list[dict]) -> list[dict]:
    """compile_specs in a fresh interpreter with an empty Triton cache (the kernels as JIT functions)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache}
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile"], input=json.dumps(specs),
                           env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------------------------ the report


def report(rec: Recorder, results: dict) -> dict:
    """{file: {tests, skipped, new specialisations, compile s, launcher s}} in the order the tests ran, and 'all'."""
    seen, files = set(), {}
    for nodeid, keys in rec.by_test.items():
        f = files.setdefault(nodeid.split("::")[0], dict(tests=0, skipped=0, specialisations=0, compile_s=0.0,
                                                         launcher_s=0.0, errors=0))
        f["tests"] += nodeid != "(outside a test)"
        f["skipped"] += rec.outcomes.get(nodeid) == "skipped"
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            r = results[k]
            f["specialisations"] += 1
            f["errors"] += bool(r["error"])
            f["compile_s"] += r["cpu_s"] or 0.0
            f["launcher_s"] += r.get("launcher_cpu_s") or 0.0
    for nodeid, outcome in rec.outcomes.items():  # tests that launched nothing
        if nodeid not in rec.by_test:
            f = files.setdefault(nodeid.split("::")[0], dict(tests=0, skipped=0, specialisations=0, compile_s=0.0,
                                                             launcher_s=0.0, errors=0))
            f["tests"] += 1
            f["skipped"] += outcome == "skipped"
    total = {k: sum(f[k] for f in files.values()) for k in ("tests", "skipped", "specialisations", "compile_s",
                                                             "launcher_s", "errors")}
    per_kernel: dict = defaultdict(lambda: [0, 0.0])
    for k in seen:
        s, r = rec.specs[k], results[k]
        per_kernel[s["kernel"]][0] += 1
        per_kernel[s["kernel"]][1] += r["cpu_s"] or 0.0
    return {"files": files, "all": total, "kernels": {k: {"specialisations": n, "compile_s": round(t, 1)}
                                                      for k, (n, t) in sorted(per_kernel.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="test files or node ids, in the order they would run")
    ap.add_argument("--engine", action="store_true", help="test_cuda.py's engine work on the CPU (docstring)")
    ap.add_argument("--out", help="also write the recording, then the report and every specialisation, as JSON here")
    ap.add_argument("--from", dest="from_", help="compile the recording of an earlier --out instead of running tests")
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the child: specs on stdin
    args, pytest_args = ap.parse_known_args(argv)
    if args.compile:
        print(json.dumps(compile_specs(json.load(sys.stdin))))
        return 0
    if not args.tests and not args.engine and not args.from_:
        print("cold_compiles.py: name test files, --engine or --from FILE", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    rec = Recorder()
    t0 = time.perf_counter()
    if args.from_:  # an earlier recording (--out), compiled again
        saved = json.loads(Path(args.from_).read_text())
        rec.specs, rec.outcomes = saved["specs"], saved["outcomes"]
        rec.by_test.update(saved["by_test"])
    else:
        install(rec)
    if args.engine:
        rec.current = "engine (test_cuda.py's work)"
        engine_work()
        rec.outcomes[rec.current] = "passed"
    if args.tests:
        import pytest

        pytest.main(["-q", "-p", "no:cacheprovider", "-m", "cuda or not cuda", *[a for a in pytest_args if a != "--"],
                     *args.tests], plugins=[rec])
    ran = time.perf_counter() - t0
    if args.out:  # the recording first: --from compiles it again without running the tests
        Path(args.out).write_text(json.dumps({"specs": rec.specs, "by_test": rec.by_test, "outcomes": rec.outcomes},
                                             indent=1, default=str))
    keys = list(rec.specs)
    t1 = time.perf_counter()
    results = dict(zip(keys, compile_cold([rec.specs[k] for k in keys])))
    rep = report(rec, results)
    print(f"\n# cold sm_{TARGET_ARCH} compiles of {', '.join(args.tests) or 'the engine work'} "
          f"(tests {ran:.0f} s under the interpreter, compiles {time.perf_counter() - t1:.0f} s)\n")
    print("| file | tests | skipped here | new specialisations | compile CPU s | launcher CPU s | errors |")
    print("|---|---|---|---|---|---|---|")
    for name, f in [*rep["files"].items(), ("all", rep["all"])]:
        print(f"| {name} | {f['tests']} | {f['skipped']} | {f['specialisations']} | {f['compile_s']:.1f} | "
              f"{f['launcher_s']:.1f} | {f['errors']} |")
    print("\n| kernel | specialisations | compile CPU s |\n|---|---|---|")
    for name, k in rep["kernels"].items():
        print(f"| {name} | {k['specialisations']} | {k['compile_s']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({**rep, "specs": {k: dict(rec.specs[k], **results[k]) for k in keys},
                                              "by_test": rec.by_test, "outcomes": rec.outcomes}, indent=1,
                                             default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
