"""How the step holds up on a shared machine: ms per step of `fast` and `hf` for each OpenMP wait policy and thread
count, quiet and beside busy processes that this script starts and stops itself, side by side in one run.

    python bench/contention.py                                   # passive and active, 1 thread and every core
    python bench/contention.py --length 256 --load 2 --threads 1 2 --policies default passive active \
        --json contention.json

OpenMP reads its wait policy once, when torch loads it, so every (policy, threads) pair is a new worker process:
it loads the model once and times one ascent step of each backend (sicl_fast.diagnostics.benchmark.bench_step), first on
the quiet machine, then with `--load` busy processes (one pure-Python spin loop each) running beside it. The policies:
passive (OMP_WAIT_POLICY=PASSIVE, what sicl_fast sets when the user has not chosen), active (OMP_WAIT_POLICY=ACTIVE:
threads spin at barriers) and default (libgomp's own: the worker imports torch before sicl_fast, so nothing is set;
threads spin a while, then sleep). Prints the table (markdown) and writes every row, with `uptime` before and after
the run (the machine's load), to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # run.threads.WAIT_ENV (the driver does not import sicl_fast)
POLICIES = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "default": {}}


def worker(args) -> None:
    """Load the model once, time a step of each backend quiet and loaded, print one JSON line per measurement."""
    if args.policy == "default":
        import torch  # noqa: F401 - OpenMP starts before sicl_fast could choose its policy: libgomp's default

    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.backends import make_backend
    from sicl_fast.diagnostics.benchmark import bench_step, synthetic_prompt
    from sicl_fast.models import load

    lm = load(args.model)
    cfg = CalibrationConfig.for_model(lm, N=args.N)
    prompt = synthetic_prompt(lm, args.length, seed=0)
    backends = {name: make_backend(name, lm, threads=args.threads[0]) for name in args.backends}
    for phase in ("quiet", "loaded"):
        if phase == "loaded":
            print("READY", flush=True)  # the driver starts the load, then answers on stdin
            sys.stdin.readline()
        for name, be in backends.items():
            r = bench_step(be, prompt, cfg, repeats=args.repeats)
            print(json.dumps({"phase": phase, "backend": name, "impl": r["impl"], "L": r["L"], "model": lm.name,
                              "threads": be.plan.threads, "wait_policy": be.plan.wait_policy,
                              "ms_min": r["ms_min"], "ms_mean": r["ms_mean"]}), flush=True)


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_worker(args, policy: str, threads: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_ENV}
    env.update(POLICIES[policy])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--policy", policy, "--length", str(args.length),
           "--repeats", str(args.repeats), "--threads", str(threads), "--N", str(args.N), "--backends", *args.backends]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows, load = [], []
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                load = busy(args.load)
                time.sleep(args.settle)  # let the spinners get going
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif line.startswith("{"):
                rows.append(dict(json.loads(line), policy=policy))
                r = rows[-1]
                print(f"  {policy} threads {threads} {r['phase']} {r['backend']}: {r['ms_min']:.1f} ms",
                      file=sys.stderr, flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
        proc.wait()
    if proc.returncode:
        raise SystemExit(f"worker failed ({policy}, {threads} threads): exit {proc.returncode}")
    return rows


def table(rows: list[dict], load: int) -> str:
    """One line per (policy, threads, backend): quiet and loaded ms per step, and the slowdown."""
    out = [f"| wait policy | threads | backend | impl | quiet ms/step | beside {load} busy ms/step | slowdown |",
           "|---|---|---|---|---|---|---|"]
    by = {(r["policy"], r["threads"], r["backend"], r["phase"]): r for r in rows}
    for p, t, b, phase in by:
        if phase != "quiet":
            continue
        q, lo = by[p, t, b, "quiet"], by[p, t, b, "loaded"]
        out.append(f"| {q['wait_policy']} | {t} | {b} | {q['impl']} | {q['ms_min']:.1f} | {lo['ms_min']:.1f} | "
                   f"{lo['ms_min'] / q['ms_min']:.2f}x |")
    return "\n".join(out)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as sicl-fast's --model (default: the embedded SmolLM2-135M)")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--N", type=int, default=8)
    p.add_argument("--load", type=int, default=2, help="busy processes beside the loaded run (default 2)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds the busy processes run before the timing")
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help=f"thread counts (default 1 and every core this process may use, {cores})")
    p.add_argument("--policies", nargs="+", default=["passive", "active"], choices=sorted(POLICIES))
    p.add_argument("--backends", nargs="+", default=["fast", "hf"])
    p.add_argument("--json", default="contention.json", help="the rows and the run's facts (default %(default)s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="passive", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    before = uptime()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [r for pol in args.policies for t in args.threads for r in run_worker(args, pol, t)]
    after = uptime()
    print(f"# {started}, {os.cpu_count()} CPUs ({cores} usable), model {rows[0]['model']}, L {rows[0]['L']}, "
          f"N {args.N}, min of {args.repeats}; uptime before: {before}; after: {after}")
    print(table(rows, args.load))
    with open(args.json, "w") as f:
        json.dump({"date": started, "cpus": os.cpu_count(), "usable_cores": cores, "uptime_before": before,
                   "uptime_after": after, "load": args.load, "length": args.length, "N": args.N,
                   "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
