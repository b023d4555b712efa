"""How the step holds up on a shared machine: ms per step of `fast` and `hf`, quiet and beside busy processes that
this script starts and stops itself, side by side in one run.

    python bench/contention.py --length 256 --load 2 --threads 1 2 --variants default passive

For every variant (environment of the worker process: OpenMP's wait policy is read once, when the runtime loads,
so each variant is a new process) and thread count, a worker process loads the model once and times one ascent
step of each backend (sicl_fast.benchmark.bench_step), first on the quiet machine, then with `--load` busy
processes (one pure-Python spin loop each) running beside it. The table gives both times and the slowdown; the
load average (`os.getloadavg`) is printed before the run, to show that the machine was quiet.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# what each variant sets in the worker's environment (OMP_WAIT_POLICY: how OpenMP threads wait at a barrier)
VARIANTS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def worker(args) -> None:
    """Load the model once, time a step of each backend, print one JSON line per backend."""
    import torch

    from sicl_fast.backends import make_backend
    from sicl_fast.benchmark import bench_step, synthetic_prompt
    from sicl_fast.engine import Engine
    from sicl_fast.threads import apply_threads

    apply_threads(args.threads)
    eng = Engine(backend="hf")
    cfg = eng.config(N=args.N)
    prompt = synthetic_prompt(eng.lm, args.length, seed=0)
    backends = {name: make_backend(name, eng.lm) for name in args.backends}
    phases = ("quiet", "loaded")
    for phase in phases:
        if phase == "loaded":
            print("READY", flush=True)  # the driver starts the load, then answers on stdin
            sys.stdin.readline()
        for name, be in backends.items():
            r = bench_step(be, prompt, cfg, repeats=args.repeats)
            print(json.dumps({"phase": phase, "backend": name, "impl": r["impl"], "L": r["L"],
                              "threads": torch.get_num_threads(), "ms_min": r["ms_min"], "ms_mean": r["ms_mean"]}),
                  flush=True)


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_variant(args, variant: str, threads: int) -> list[dict]:
    env = dict(os.environ, **VARIANTS[variant])
    cmd = [sys.executable, __file__, "--worker", "--length", str(args.length), "--repeats", str(args.repeats),
           "--threads", str(threads), "--N", str(args.N), "--backends", *args.backends]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows, load = [], []
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                load = busy(args.load)
                time.sleep(1.0)  # let the spinners get going
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif line.startswith("{"):
                rows.append(dict(json.loads(line), variant=variant))
                print(f"  {variant} threads {threads} {rows[-1]['phase']} {rows[-1]['backend']}: "
                      f"{rows[-1]['ms_min']:.0f} ms", file=sys.stderr, flush=True)
    finally:
        for p in load:
            p.kill()
        proc.wait()
    if proc.returncode:
        raise SystemExit(f"worker failed ({variant}, {threads} threads): exit {proc.returncode}")
    return rows


def table(rows: list[dict], load: int) -> str:
    out = [f"| variant | threads | backend | impl | quiet ms/step | beside {load} busy ms/step | slowdown |",
           "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["variant"], r["threads"], r["backend"]) for r in rows}, key=str)
    for v, t, b in keys:
        q = next(r for r in rows if (r["variant"], r["threads"], r["backend"], r["phase"]) == (v, t, b, "quiet"))
        lo = next(r for r in rows if (r["variant"], r["threads"], r["backend"], r["phase"]) == (v, t, b, "loaded"))
        out.append(f"| {v} | {t} | {b} | {q['impl']} | {q['ms_min']:.0f} | {lo['ms_min']:.0f} | "
                   f"{lo['ms_min'] / q['ms_min']:.2f}x |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--N", type=int, default=8)
    p.add_argument("--load", type=int, default=2, help="busy processes beside the loaded run")
    p.add_argument("--threads", type=int, nargs="+", default=[len(os.sched_getaffinity(0))])
    p.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    p.add_argument("--backends", nargs="+", default=["fast", "hf"])
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        return worker(args)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average before "
          f"the run {os.getloadavg()[0]:.2f}, SmolLM2-135M float32, L {args.length}, N {args.N}, min of "
          f"{args.repeats}")
    rows = [r for v in args.variants for t in args.threads for r in run_variant(args, v, t)]
    print(table(rows, args.load))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
