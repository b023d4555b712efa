"""ICLEval throughput at the paper's budget: samples per second of the full protocol (base and sicl, K 250, the
paper's settings and stopping rule) with the default device and precision (`--device auto --dtype auto`), and the
time the whole set would take at that rate.

    python bench/icleval_throughput.py ICLEval/data/tasks_data --out docs/icleval_gpu/smollm2 [--model ...]
    python bench/icleval_throughput.py tests/data/icleval --out /tmp/tp --smoke          # the CPU's quick form

Flags after `--` go to `sicl-fast icleval` as they are (e.g. `-- --threads 4 --device cuda`).

It runs `sicl-fast icleval DIR --method base sicl --out OUT/records.jsonl` (resumable: a rerun, e.g. the next
device session, continues where the records end) under a wall clock and a --budget-s of its own (the icleval
process is interrupted with SIGINT at the budget: only whole records are written), then appends one line to
OUT/throughput.jsonl: the date, the machine, the samples this call added, its wall seconds and samples per second,
and the records so far. The headline (printed, and in OUT/throughput.md): samples per second over every call and
the minutes the full set of samples in DIR's files would take. --smoke: 2 samples per file, 3 steps, for a CPU run
of the machinery (not a figure).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path


def count_samples(folder: str, tasks) -> int:
    from sicl_fast.icleval import load_dir

    return sum(len(v) for k, v in load_dir(folder).items() if not tasks or k in tasks)


def count_records(path: Path) -> int:
    """Samples with both methods done (the icleval records: one per sample and method)."""
    if not path.exists():
        return 0
    keys: dict = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                keys.setdefault((r.get("task"), r.get("uid")), set()).add(r.get("method"))
    return sum(1 for methods in keys.values() if {"base", "sicl"} <= methods)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="ICLEval's data/tasks_data folder")
    ap.add_argument("--out", required=True, help="folder for records.jsonl, throughput.jsonl, throughput.md")
    ap.add_argument("--model", default=None, help="sicl-fast --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="stop the icleval run after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="2 samples per file, 3 steps: the machinery, not a figure")
    ap.add_argument("extra", nargs="*", metavar="-- FLAG", help="after --: more sicl-fast icleval flags, as they are")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"
    cmd = [sys.executable, "-m", "sicl_fast.cli", "icleval", args.dir, "--method", "base", "sicl", "--out",
           str(records), "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if args.tasks:
        cmd += ["--tasks", *args.tasks]
    if args.smoke:
        cmd += ["--limit", "2", "--max-steps", "3"]
    cmd += args.extra
    before = count_records(records)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    try:
        proc.wait(timeout=args.budget_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # icleval writes only whole records
        proc.wait()
    wall = time.perf_counter() - t0
    after = count_records(records)
    line = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(),
            "command": " ".join(cmd), "added": after - before, "wall_s": round(wall, 1),
            "samples_per_s": round((after - before) / wall, 4) if wall > 0 else None, "records": after,
            "returncode": proc.returncode, "smoke": args.smoke}
    with open(out / "throughput.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    with open(out / "throughput.jsonl") as f:
        calls = [json.loads(x) for x in f if x.strip()]
    done = sum(c["added"] for c in calls if c["smoke"] == args.smoke)
    seconds = sum(c["wall_s"] for c in calls if c["smoke"] == args.smoke)
    total = count_samples(args.dir, args.tasks)
    rate = done / seconds if seconds else 0.0
    minutes = total / rate / 60 if rate else float("inf")
    head = (f"{done} samples (base + sicl) in {seconds:.0f} s over {len(calls)} call(s) on {line['machine']}: "
            f"{rate:.3f} samples/s; the {total} samples of these files would take {minutes:.1f} min"
            + (" (smoke: not a figure)" if args.smoke else ""))
    print(head)
    (out / "throughput.md").write_text(f"{head}\n\nrecords: {after} of {total} samples in {records}\n")
    return 0 if proc.returncode in (0, -signal.SIGINT, 130) else proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
