"""ICLEval throughput at the paper's budget: samples per second of the full protocol (base and sicl, K 250, the
paper's settings and stopping rule) with the default device and precision (`--device auto --dtype auto`), and the
time the whole set would take at that rate.

    python bench/icleval_throughput.py ICLEval/data/tasks_data --out docs/icleval_gpu/smollm2 [--model ...]
    python bench/icleval_throughput.py tests/data/icleval --out /tmp/tp --smoke          # the CPU's quick form

Flags after `--` go to `sicl-fast icleval` as they are (e.g. `-- --threads 4 --device cuda`), wherever the folder
and this script's own flags stand before it.

It runs `sicl-fast icleval DIR --method base sicl --out OUT/records.jsonl` (resumable: a rerun, e.g. the next
device session, continues where the records end) under a wall clock and a --budget-s of its own (the icleval
process is interrupted with SIGINT at the budget, or by Ctrl-C: only whole records are written), then appends one
line to OUT/throughput.jsonl: the date, the machine, the samples this call added, its wall seconds and samples per
second, the flags after `--` and the records so far. The headline (printed, and in OUT/throughput.md): samples per
second over the calls on this machine with the same flags after `--` (a call with other icleval flags, such as
`-- --max-steps 20`, is another figure and says its flags), and the minutes the full set of samples in DIR's files
would take (`n/a` before any sample is done). A call
whose icleval run failed (bad flags, a crash) is not a throughput line: its exit status is passed on, after one
line saying so. Bad input (a folder without ICLEval task files, --out on a file) is one line and exit status 2,
before anything runs. --smoke: 2 samples per file, 3 steps, for a CPU run of the machinery (not a figure).
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from sicl_fast.commands.cli import _Parser
from sicl_fast.errors import SiclError, SiclWarning
from sicl_fast.formats.inputs import json_value
from sicl_fast.run.knobs import arg_type

PROG = "icleval_throughput.py"
SET = ("--out", "--method", "--quiet")  # set by this script for the icleval run: refused after `--`
OWN = ("--model", "--tasks")  # this script's own (the samples it counts), given before `--`


def count_samples(folder: str, tasks) -> int:
    from sicl_fast.icleval import load_dir

    return sum(len(v) for v in load_dir(folder, tasks or None).values())


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of one of this script's files (a SiclError names a line that is not one)."""
    out = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(json_value(line, f"{path}:{n}"))  # not UTF-8, too deep, not JSON: one line naming it
                if not isinstance(out[-1], dict):
                    raise SiclError(f"{path}:{n}: not a JSON object")
    return out


def count_records(path: Path) -> int:
    """Samples with both methods done (the icleval records: one per sample and method)."""
    if not path.exists():
        return 0
    keys: dict = {}
    for r in read_lines(path):
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


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, the flags after `--` for sicl-fast icleval); those this script sets refused."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    extra = argv[i + 1:]
    for a in (a.split("=", 1)[0] for a in extra):
        if a in SET:
            raise SiclError(f"{a} after --: this script sets {', '.join(SET)} for the icleval run itself; drop it "
                            "(--out names this script's folder)")
        if a in OWN:
            raise SiclError(f"{a} after --: give it before -- (this script's own flag: it counts the samples of the "
                            "model's tasks)")
    return argv[:i], extra


def headline(calls: list[dict], smoke: bool, total: int, machine_name: str, flags: list[str] = ()) -> str:
    """Samples per second over the calls of this kind (smoke or not) on this machine with the same flags after `--`
    (another machine or other icleval flags is another figure), and the minutes the whole set would take at that
    rate (n/a before any sample is done: no rate to divide by)."""
    flags = list(flags)
    pool = [c for c in calls if c["smoke"] == smoke and c.get("machine", machine_name) == machine_name
            and c.get("flags", []) == flags]
    done = sum(c["added"] for c in pool)
    seconds = sum(c["wall_s"] for c in pool)
    rate = done / seconds if seconds and done else None
    return (f"{done} samples (base + sicl) in {seconds:.0f} s over {len(pool)} call(s) on {machine_name}"
            + (f" with icleval flags {' '.join(flags)}" if flags else "") + ": "
            + ("n/a samples/s (none done yet); the whole set's time n/a" if rate is None else
               f"{rate:.3f} samples/s; the {total} samples of these files would take {total / rate / 60:.1f} min")
            + (" (smoke: not a figure)" if smoke else ""))


def exit_status(returncode: int) -> int:
    """A child's return code as this process's exit status (a signal N as 128 + N, as a shell says it)."""
    return 128 - returncode if returncode < 0 else returncode


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings in one line each (an ICLEval file that differs from the released data), as sicl-fast's."""
    if issubclass(category, SiclWarning):
        print(f"{PROG}: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="ICLEval's data/tasks_data folder")
    ap.add_argument("--out", required=True, help="folder for records.jsonl, throughput.jsonl, throughput.md")
    ap.add_argument("--model", default=None, help="sicl-fast --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--budget-s", type=arg_type("time_budget_s"), default=None,
                    help="stop the icleval run after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="2 samples per file, 3 steps: the machinery, not a figure")
    ap.epilog = "after --: more sicl-fast icleval flags, as they are"
    argv = sys.argv[1:] if argv is None else argv
    try:
        own, extra = split_argv(argv)
    except SiclError as exc:
        ap.error(str(exc))
    args = ap.parse_args(own)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = warning_line
            return measure(args, extra)
    except (SiclError, OSError) as exc:
        what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else exc
        print(f"{PROG}: error: {what}", file=sys.stderr)
        return 2


def measure(args, extra: list[str]) -> int:
    from sicl_fast.formats.records import check_out_dir

    total = count_samples(args.dir, args.tasks)  # the folder and its task files, before anything runs
    out = Path(args.out)
    check_out_dir(out, "--out", "records.jsonl, throughput.jsonl and throughput.md")
    out.mkdir(parents=True, exist_ok=True)
    records, lines = out / "records.jsonl", out / "throughput.jsonl"
    calls = read_lines(lines) if lines.exists() else []
    cmd = [sys.executable, "-m", "sicl_fast.cli", "icleval", args.dir, "--method", "base", "sicl", "--out",
           str(records), "--quiet"]
    if args.model:
        cmd += ["--model", args.model]
    if args.tasks:
        cmd += ["--tasks", *args.tasks]
    if args.smoke:
        cmd += ["--limit", "2", "--max-steps", "3"]
    cmd += extra
    before = count_records(records)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    interrupted = False
    try:
        proc.wait(timeout=args.budget_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # icleval writes only whole records
        proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reaches the child too (one process group); a SIGINT of this process alone not
        interrupted = True
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, -signal.SIGINT, 130):
        print(f"{PROG}: error: sicl-fast icleval exited with status {exit_status(proc.returncode)}; this call is "
              f"not a throughput line ({lines} unchanged)", file=sys.stderr)
        return exit_status(proc.returncode)
    after = count_records(records)
    line = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(),
            "command": " ".join(cmd), "added": after - before, "wall_s": round(wall, 1),
            "samples_per_s": round((after - before) / wall, 4) if wall > 0 else None, "records": after,
            "returncode": proc.returncode, "smoke": args.smoke, "flags": extra}
    with open(lines, "a") as f:
        f.write(json.dumps(line) + "\n")
    head = headline(calls + [line], args.smoke, total, line["machine"], extra)
    print(head)
    (out / "throughput.md").write_text(f"{head}\n\nrecords: {after} of {total} samples in {records}\n")
    return 130 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
