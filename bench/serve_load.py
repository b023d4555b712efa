"""Load test of `sicl-fast serve`'s OpenAI chat endpoint with the official `openai` client: this checkout's server
(its scheduler decodes concurrent answers together and steps calibrations between them) beside another checkout's
(`--other`, e.g. 481e2be, whose server runs one request at a time), side by side in one run.

    mkdir /tmp/base && git archive 481e2be | tar -x -C /tmp/base && cp sicl_fast/ops/_C*.so /tmp/base/sicl_fast/
    python bench/serve_load.py --other /tmp/base
    python bench/serve_load.py --other /tmp/base --clients 1 8 --requests 2 --mix-answers 2 --out /tmp/short.json
    python bench/serve_load.py --other /tmp/base --clients 8 32 --calibrations 8 --pack auto    # a GPU (issue 55)

Both servers run as `sicl-fast serve` subprocesses (the embedded SmolLM2-135M, `--threads`, one at a time busy:
each phase runs on one server, then on the other, the order alternating), the clients are threads of this process,
each with its own `openai.OpenAI` client. Every request is a chat completion of one few-shot conversation (an
instruction, DEMOS, a sentence to repeat in capitals) with `max_tokens` --new-tokens and the same `sicl` knobs, so
that after the first one every request is a store hit on one stored calibration. Phases:

  store   one request calibrates the conversation's prompt (--store-steps steps) and stores it
  alone   each query once, one at a time: its latency alone and its answer, the reference of "tokens identical"
  load    for each --clients count and each mode (non-streaming, streaming), every client sends --requests
          requests back to back: answers per second, tokens per second, latency p50 / p99, answers equal to alone
  calibrations  (with --calibrations) for each count K, K calibrate requests of the mix's prompt at once
          (/v1/calibrate, reuse off, --cal-steps steps, no early stop, seeds 0..K-1): calibrations per second,
          steps per second, latency p50 / p99 and each seed's best proxy, this server's beside the other's (with
          --pack above 1, this server runs them as slots of one packed step: the packed server path)
  mix     a calibration of another prompt (/v1/calibrate, reuse off, --mix-steps steps, no early stop) starts, and
          --mix-delay s later --mix-answers answers arrive one after the other: each one's latency against its
          latency alone and the calibration's step alone (both measured just before: each answer once, the same
          calibration --mix-alone-steps steps with nothing beside it), target <= 2 x alone + one step

Prints a table and writes the JSON (--out): the targets of issue 52 on this CPU are, at 8 clients, at least 3x the
other server's answer throughput with p50 at most half of its p50, and the mix target above.
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

from other_checkout import PRELUDE  # bench/, first on sys.path when run as a script

SERVE = PRELUDE + "\nfrom sicl_fast.commands.cli import main\nsys.exit(main(sys.argv[2:]))\n"
INSTRUCTION = "Repeat each sentence in capital letters."
DEMOS = [("the cat sat on the mat.", "THE CAT SAT ON THE MAT."),
         ("we walked to the old bridge at noon.", "WE WALKED TO THE OLD BRIDGE AT NOON.")]
QUERIES = ["my brother plays the piano every evening.", "a small boat drifted across the quiet lake.",
           "she bought three red apples at the market.", "the train to the city leaves at seven.",
           "our garden is full of yellow flowers.", "he read the letter twice before he answered.",
           "the children built a castle out of sand.", "rain fell softly on the tin roof all night."]
MIX_REQUEST = {"id": "mix", "instruction": "Write each number word as a digit.",
               "demos": [{"input": w, "output": d} for w, d in (("one", "1"), ("seven", "7"), ("three", "3"),
                                                                 ("nine", "9"))], "query": "five"}


def messages(query: str) -> list[dict]:
    out = [{"role": "system", "content": INSTRUCTION}]
    for q, a in DEMOS:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return out + [{"role": "user", "content": query}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`sicl-fast serve` of this checkout (root None) or of another (its own code: other_checkout.PRELUDE)."""

    def __init__(self, name: str, root: str | None, threads: int, extra: tuple[str, ...] = ()) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["serve", "--port", str(self.port), "--threads", str(threads), "--log-level", "warning",
                 "--max-queue", "64", *extra]
        cmd = ([sys.executable, "-m", "sicl_fast.cli", *flags] if root is None else
               [sys.executable, "-c", SERVE, str(Path(root).resolve()), *flags])
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} server exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.proc.kill()
            raise SystemExit(f"{name} server did not come up in 300 s")
        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def client(self, timeout: float):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat(client, model: str, query: str, stream: bool, args) -> tuple[float, str, int]:
    """(latency s, answer, completion tokens) of one chat completion."""
    kw = dict(model=model, messages=messages(query), max_tokens=args.new_tokens,
              extra_body={"sicl": {"max_steps": args.store_steps, "patience": 0, "tau": 0.0}})
    t0 = time.perf_counter()
    if stream:
        text, tokens = "", 0
        for c in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if c.choices:
                text += c.choices[0].delta.content or ""
            elif c.usage is not None:
                tokens = c.usage.completion_tokens
    else:
        r = client.chat.completions.create(**kw)
        text, tokens = r.choices[0].message.content, r.usage.completion_tokens
    return time.perf_counter() - t0, text, tokens


def at_once(one, n: int) -> float:
    """one(0) ... one(n - 1) on n threads at once: the seconds until the last ends."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def load(server: Server, clients: int, stream: bool, alone: dict, args) -> dict:
    """--requests requests from each of `clients` clients, back to back."""
    lat, tokens, wrong, errors = [], [], 0, {}
    lock = threading.Lock()

    def one(c: int) -> None:
        nonlocal wrong
        client = server.client(args.timeout)
        for k in range(args.requests):
            q = QUERIES[(c + k) % len(QUERIES)]
            try:
                s, text, n = chat(client, server.model, q, stream, args)
            except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                with lock:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            with lock:
                lat.append(s)
                tokens.append(n)
                wrong += text != alone[q]

    wall = at_once(one, clients)
    return {"clients": clients, "stream": stream, "answers": len(lat), "errors": errors, "wall_s": wall,
            "answers_per_s": len(lat) / wall, "tokens_per_s": sum(tokens) / wall,
            "p50_s": pct(lat, 0.5) if lat else None, "p99_s": pct(lat, 0.99) if lat else None,
            "mean_tokens": statistics.mean(tokens) if tokens else None, "not_alone": wrong}


def calibrations(server: Server, count: int, args) -> dict:
    """`count` calibrate requests of the mix's prompt at once, seeds 0..count-1 (module docstring)."""
    config = {"patience": 0, "tau": 0.0, "min_delta": 0.0, "max_steps": args.cal_steps}
    lat, steps, best, errors = {}, {}, {}, {}
    lock = threading.Lock()

    def one(seed: int) -> None:
        body = {"request": MIX_REQUEST, "reuse": "off", "config": {**config, "seed": seed}}
        t0 = time.perf_counter()
        try:
            r = httpx.post(server.url + "/v1/calibrate", json=body, timeout=args.timeout)
            r.raise_for_status()
            summary = r.json()["summary"]
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            with lock:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        with lock:
            lat[seed], steps[seed], best[seed] = time.perf_counter() - t0, summary["steps"], summary["best_proxy"]

    wall = at_once(one, count)
    xs = list(lat.values())
    return {"count": count, "done": len(xs), "errors": errors, "wall_s": wall, "per_s": len(xs) / wall,
            "steps_per_s": sum(steps.values()) / wall, "p50_s": pct(xs, 0.5) if xs else None,
            "p99_s": pct(xs, 0.99) if xs else None, "best_proxy": {str(k): v for k, v in sorted(best.items())}}


def mix(server: Server, alone: dict, args) -> dict:
    """Answers arriving while a calibration of another prompt runs (module docstring). Their latency alone and the
    calibration's step alone are measured just before: each answer once, and the same calibration for
    --mix-alone-steps steps with nothing beside it (its seconds / steps, the setup in its first)."""
    config = {"patience": 0, "tau": 0.0, "min_delta": 0.0}
    s = httpx.post(server.url + "/v1/calibrate", json={"request": MIX_REQUEST, "reuse": "off", "config": {
        **config, "max_steps": args.mix_alone_steps}}, timeout=args.timeout).json()["summary"]
    step = s["seconds"] / max(1, s["steps"])
    body = {"request": MIX_REQUEST, "reuse": "off", "config": {**config, "max_steps": args.mix_steps}}
    out = {}

    def calibrate() -> None:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/calibrate", json=body, timeout=args.timeout).json()
        out.update(latency_s=time.perf_counter() - t0, summary=r["summary"])

    client = server.client(args.timeout)
    alone_s = {q: chat(client, server.model, q, False, args)[0] for q in QUERIES[:args.mix_answers]}  # just before
    cal = threading.Thread(target=calibrate)
    cal.start()
    time.sleep(args.mix_delay)
    answers = []
    for k in range(args.mix_answers):
        q = QUERIES[k % len(QUERIES)]
        s, text, _ = chat(client, server.model, q, False, args)
        answers.append({"query": q, "latency_s": s, "alone_s": alone_s[q], "same": text == alone[q],
                        "during": cal.is_alive()})
    cal.join()
    s = out["summary"]
    for a in answers:
        a["target_s"] = 2 * a["alone_s"] + step
        a["met"] = a["latency_s"] <= a["target_s"]
    return {"calibration": {"steps": s["steps"], "seconds": s["seconds"], "step_alone_s": step,
                            "latency_s": out["latency_s"]}, "answers": answers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None, help="another checkout (its server: the reference); none: this one only")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=4, help="requests per client in the load phase")
    ap.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every answer")
    ap.add_argument("--store-steps", type=int, default=4, help="steps of the stored calibration")
    ap.add_argument("--mix-steps", type=int, default=30)
    ap.add_argument("--mix-delay", type=float, default=1.0)
    ap.add_argument("--mix-answers", type=int, default=4)
    ap.add_argument("--mix-alone-steps", type=int, default=5, help="steps of the mix's calibration run alone first")
    ap.add_argument("--calibrations", type=int, nargs="*", default=[],
                    help="the calibrations phase's counts of calibrate requests at once (none: no such phase)")
    ap.add_argument("--cal-steps", type=int, default=8, help="steps of each calibration of that phase")
    ap.add_argument("--pack", default=None, help="this server's --pack (its default when unset; the other server "
                                                 "is given none: 481e2be has no packed server path)")
    ap.add_argument("--threads", type=int, default=1, help="each server's threads (OMP_NUM_THREADS and --threads)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    ap.add_argument("--out", default="bench/results_serve_batching.json")
    args = ap.parse_args()

    servers = [Server("this", None, args.threads, ("--pack", args.pack) if args.pack else ())]
    if args.other:
        servers.append(Server("other", args.other, args.threads))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor()
                 or platform.machine(), "cpus": os.cpu_count(), "load_before": os.getloadavg(),
                 "args": vars(args), "servers": {s.name: {} for s in servers}}
    try:
        order = lambda k: servers if k % 2 == 0 else servers[::-1]  # noqa: E731 - alternate who goes first
        for s in servers:  # store, then alone
            client = s.client(args.timeout)
            t, _, _ = chat(client, s.model, QUERIES[0], False, args)
            out = res["servers"][s.name]
            out["store_s"] = t
            out["alone"] = {}
            for q in QUERIES:
                sec, text, n = chat(client, s.model, q, False, args)
                out["alone"][q] = {"s": sec, "answer": text, "tokens": n}
        if len(servers) == 2:
            a, b = (res["servers"][n]["alone"] for n in ("this", "other"))
            res["alone_same_answers"] = sum(a[q]["answer"] == b[q]["answer"] for q in QUERIES)
        k = 0
        for clients in args.clients:
            for stream in (False, True):
                for s in order(k):
                    alone = {q: v["answer"] for q, v in res["servers"][s.name]["alone"].items()}
                    row = load(s, clients, stream, alone, args)
                    res["servers"][s.name].setdefault("load", []).append(row)
                    print(f"{s.name:5s} clients {clients:2d} stream {stream!s:5s}: {row['answers_per_s']:.2f} "
                          f"answers/s, p50 {row['p50_s']:.3f} s, p99 {row['p99_s']:.3f} s, not alone "
                          f"{row['not_alone']}, errors {row['errors']}", file=sys.stderr, flush=True)
                k += 1
        for count in args.calibrations:
            for s in order(k):
                row = calibrations(s, count, args)
                res["servers"][s.name].setdefault("calibrations", []).append(row)
                print(f"{s.name:5s} calibrations {count:2d} at once: {row['per_s']:.2f} a second, "
                      f"{row['steps_per_s']:.1f} steps/s, p50 {row['p50_s']} s, errors {row['errors']}",
                      file=sys.stderr, flush=True)
            k += 1
        for s in order(k):
            al = res["servers"][s.name]["alone"]
            res["servers"][s.name]["mix"] = mix(s, {q: v["answer"] for q, v in al.items()}, args)
    finally:
        for s in servers:
            s.close()
    res["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table(res))
    return 0


def table(res: dict) -> str:
    """The markdown table of the load phase (this / other side by side) and the mix."""
    this, other = res["servers"]["this"], res["servers"].get("other")
    lines = ["| clients | stream | answers/s this | answers/s other | x | p50 s this | p50 s other | p99 s this | "
             "p99 s other | answers = alone (this, other) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, a in enumerate(this["load"]):
        b = other["load"][i] if other else None
        x = f"{a['answers_per_s'] / b['answers_per_s']:.2f}" if b else ""
        lines.append(f"| {a['clients']} | {'yes' if a['stream'] else 'no'} | {a['answers_per_s']:.2f} | "
                     f"{b['answers_per_s'] if b else float('nan'):.2f} | {x} | {a['p50_s']:.3f} | "
                     f"{b['p50_s'] if b else float('nan'):.3f} | {a['p99_s']:.3f} | "
                     f"{b['p99_s'] if b else float('nan'):.3f} | {a['answers'] - a['not_alone']}/{a['answers']}"
                     + (f", {b['answers'] - b['not_alone']}/{b['answers']}" if b else "") + " |")
    if this.get("calibrations"):
        lines += ["", "| calibrations at once | per s this | per s other | x | steps/s this | steps/s other | "
                  "p50 s this | p50 s other | max abs best proxy this - other |", "|---" * 9 + "|"]
        for i, a in enumerate(this["calibrations"]):
            b = other["calibrations"][i] if other else None
            diff = (max((abs(v - b["best_proxy"][k]) for k, v in a["best_proxy"].items() if k in b["best_proxy"]),
                        default=float("nan")) if b else float("nan"))
            lines.append(f"| {a['count']} | {a['per_s']:.2f} | {b['per_s'] if b else float('nan'):.2f} | "
                         + (f"{a['per_s'] / b['per_s']:.2f}" if b and b["per_s"] else "") + f" | "
                         f"{a['steps_per_s']:.1f} | {b['steps_per_s'] if b else float('nan'):.1f} | "
                         f"{a['p50_s'] or float('nan'):.3f} | "
                         f"{(b['p50_s'] or float('nan')) if b else float('nan'):.3f} | {diff:.2e} |")
    for name, srv in res["servers"].items():
        m = srv["mix"]
        c = m["calibration"]
        lines.append(f"\nmix ({name}): a {c['steps']}-step calibration in {c['seconds']:.1f} s, "
                     f"{c['step_alone_s']:.3f} s a step alone; answers "
                     + "; ".join(f"{a['latency_s']:.3f} s (alone {a['alone_s']:.3f} s, target {a['target_s']:.3f} s, "
                                 f"{'met' if a['met'] else 'missed'}{'' if a['during'] else ', after it'})"
                                 for a in m["answers"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
