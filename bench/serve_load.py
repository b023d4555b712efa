"""Load test of `sicl-fast serve` on loopback, with the same work run as direct engine calls in the same run.

    python bench/serve_load.py                      # 200 requests, 8 clients, SmolLM2, max_steps 1
    python bench/serve_load.py --requests 40 --clients 4 --max-steps 1 --time-limit 300

Phases (the server is idle while the bench process computes):
  1 + 2, interleaved (so both see the same load on a shared machine): `--direct` calibrations through Calibrator
        in this process (the engine without a server), each followed by the same request through the server from
        one client: per-request overhead = client latency - the server's engine time (timing.engine_s), and
        client latency - the direct call's time
  3. load:       `--requests` requests from `--clients` concurrent clients; p50 / p95 / p99 latency, throughput,
                 errors; throughput overhead = 1 / throughput against the direct mean per call
The server runs as a subprocess (`sicl-fast serve`, the embedded SmolLM2-135M), so clients and server do not
share an interpreter. Bounded: at most --requests requests, and whatever is not done after --time-limit seconds is
counted as not completed (and the run says so).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from sicl_fast import Calibrator, Engine

QUERIES = ["five", "eight", "two", "six", "four", "zero", "ten", "three"]


def request(i: int) -> dict:
    return {"id": f"r{i}", "instruction": "Write each number word as a digit.",
            "demos": [{"input": "one", "output": "1"}, {"input": "seven", "output": "7"},
                      {"input": "three", "output": "3"}, {"input": "nine", "output": "9"}],
            "query": QUERIES[i % len(QUERIES)]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def engine_seconds(metrics: str) -> float:
    """sicl_fast_engine_seconds_sum{job="calibrate"} from the server's Prometheus text."""
    key = 'sicl_fast_engine_seconds_sum{job="calibrate"}'
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(key)), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_queue: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sicl_fast.cli", "serve", "--port", str(port), "--max-queue", str(max_queue),
           "--log-level", "warning", "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not come up in 300 s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, server and direct calls alike (1: on a 2-core machine shared with other "
                         "jobs, 2 threads ran 5-10x slower)")
    ap.add_argument("--direct", type=int, default=20, help="direct engine calls, and sequential server calls")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the load phase")
    ap.add_argument("--out", default="bench/results_serve_load.json")
    args = ap.parse_args()
    knobs = {"max_steps": args.max_steps, "patience": 0, "tau": 0.0}  # a fixed step count per request

    port = free_port()
    torch.set_num_threads(args.threads)
    server = start_server(port, max_queue=max(16, args.clients), threads=args.threads)
    url = f"http://127.0.0.1:{port}"
    try:
        # 1 + 2. direct engine calls and sequential server calls, interleaved so both see the same machine load
        eng = Engine()
        cfg = eng.config(**knobs)
        http = httpx.Client(base_url=url, timeout=args.time_limit)
        Calibrator(eng.backend, cfg).run(eng.prepare(request(0)))  # warm-ups
        http.post("/v1/calibrate", json={"request": request(0), "config": knobs}).raise_for_status()
        direct, seq, seq_engine = [], [], []
        for i in range(args.direct):
            t0 = time.perf_counter()
            res = Calibrator(eng.backend, cfg).run(eng.prepare(request(i)))
            direct.append(time.perf_counter() - t0)
            assert res.steps == args.max_steps
            t0 = time.perf_counter()
            r = http.post("/v1/calibrate", json={"request": request(i), "config": knobs})
            seq.append(time.perf_counter() - t0)
            r.raise_for_status()
            seq_engine.append(r.json()["timing"]["engine_s"])
        del eng

        # 3. load: --clients threads share a counter of --requests requests
        lat: list[float] = []
        errors: dict[str, int] = {}
        lock = threading.Lock()
        todo = iter(range(args.requests))
        deadline = time.monotonic() + args.time_limit

        def client() -> None:
            with httpx.Client(base_url=url, timeout=args.time_limit) as c:
                while time.monotonic() < deadline:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    t0 = time.perf_counter()
                    try:
                        r = c.post("/v1/calibrate", json={"request": request(i), "config": knobs},
                                   timeout=max(1.0, deadline - time.monotonic()))
                        ok = r.status_code == 200 and r.json()["summary"]["steps"] == args.max_steps
                        key = None if ok else f"HTTP {r.status_code}"
                    except httpx.HTTPError as exc:
                        key = type(exc).__name__
                    with lock:
                        if key is None:
                            lat.append(time.perf_counter() - t0)
                        else:
                            errors[key] = errors.get(key, 0) + 1

        engine_before = engine_seconds(http.get("/metrics").text)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        engine_s = engine_seconds(http.get("/metrics").text) - engine_before
    finally:
        server.terminate()
        server.wait(30)

    done = len(lat)
    d_mean, s_mean = statistics.mean(direct), statistics.mean(seq)
    overhead = [a - b for a, b in zip(seq, seq_engine)]
    paired = [a - b for a, b in zip(seq, direct)]
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": "SmolLM2-135M (embedded)",
        "knobs": knobs,
        "requests": args.requests,
        "clients": args.clients,
        "completed": done,
        "not_completed": args.requests - done - sum(errors.values()),
        "errors": errors,
        "direct_s": {"mean": d_mean, "p50": pct(direct, 0.5), "min": min(direct), "n": len(direct)},
        "sequential_s": {"mean": s_mean, "p50": pct(seq, 0.5), "n": len(seq)},
        "sequential_minus_direct_ms": {"mean": 1e3 * statistics.mean(paired), "p50": 1e3 * pct(paired, 0.5)},
        "sequential_overhead_ms": {
            "mean": 1e3 * statistics.mean(overhead),
            "p50": 1e3 * pct(overhead, 0.5),
            "max": 1e3 * max(overhead),
        },
        "load_latency_s": {"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "p99": pct(lat, 0.99), "max": max(lat)}
        if lat
        else {},
        "load_wall_s": wall,
        "throughput_rps": done / wall,
        "throughput_overhead_pct": 100 * ((wall / done) / d_mean - 1) if done else None,
        # the server's engine time during the load phase (its /metrics), per request and as a share of the wall time
        "load_engine_s_per_request": engine_s / done if done else None,
        "load_engine_busy_fraction": engine_s / wall,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0 if not errors and done == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
