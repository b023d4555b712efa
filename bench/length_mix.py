"""A realistic mix of prompt lengths through the product path: milliseconds a prompt for each way of running it,
side by side in one process on one model (issue 38's target: the mix with length buckets within 1.3x of the same
prompts at one repeated length).

    python bench/length_mix.py --device cuda --out bench/results_length_mix.jsonl   # 24 prompts, 200-600, 50 steps
    python bench/length_mix.py --smoke                                              # the CPU's quick form
    python bench/length_mix.py --prompts 6 --min 100 --max 200 --steps 3 --length-buckets 4   # padding, CPU

The prompts: `--prompts` of lengths drawn uniformly from [--min, --max] (seeded), random token ids of the model's
vocabulary with a fixed 8-token prefix, three demonstration outputs of 4-9 tokens and a 16-token query (the ascent's
cost does not depend on what the tokens say). Every calibration runs its full --steps (tau 0, patience 0), N 8.
The modes, each on its own Engine over the one loaded model:
    repeated   every prompt at one length (the mix's median) with graphs: one capture, then replays; the reference
    exact      length_buckets off: one step (and on CUDA one graph capture) a length
    buckets    length_buckets auto (4 a doubling): the mix shares a few steps and graphs
    packed     pack auto (8 on CUDA below 1B parameters), uncaptured
Each mode is timed over the whole mix after a warm-up prompt of another length, which pays the model's first-call
costs (kernel compiles, allocator) outside the figure, not the new lengths' captures: those are the figure's point.
Reports ms a prompt, the steps built (graphs captured on CUDA), each mode's ratio to `repeated`, and for buckets and
packed the largest difference of a proxy history from the exact mode's and the prompts whose best step is the same.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

MODES = ("repeated", "exact", "buckets", "packed")


def mix_prompts(vocab: int, n: int, lo: int, hi: int, seed: int = 0, prefix: int = 8, query: int = 16) -> list:
    """n synthetic Prompts of lengths uniform in [lo, hi]: a prefix, three outputs spread over the demonstrations,
    a query (module docstring)."""
    from sicl_fast.formats.requests import Request
    from sicl_fast.formats.spans import Prompt

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        end = L - query
        spans, block = [], (end - prefix) // 3
        for t in range(3):
            width = int(torch.randint(4, 10, (1,), generator=g))
            stop = prefix + (t + 1) * block if t < 2 else end
            spans.append((stop - width, stop))
        ids = torch.randint(0, vocab, (L,), generator=g)
        req = Request(id=f"mix{i}", prompt="x" * (L + 1), output_spans=((1, 2),))
        out.append(Prompt(request=req, input_ids=ids, token_spans=tuple(spans), demo_start=prefix,
                          demo_end=spans[-1][1]))
    return out


def engine(lm, mode: str, buckets="auto", **kw):
    """The Engine of one mode over the loaded model (module docstring); buckets: the buckets mode's length_buckets
    (on the CPU, where 'auto' takes none, a count shows what the padding costs without a capture to save)."""
    from sicl_fast import Engine

    choices = {"repeated": dict(pack=1), "exact": dict(pack=1, length_buckets="off"),
               "buckets": dict(pack=1, length_buckets=buckets), "packed": dict(pack="auto")}[mode]
    return Engine(lm, **choices, **kw)


def run_mode(engine, prompts, cfg) -> dict:
    """Calibrate `prompts` (one by one, or packed by the engine's plan) -> seconds and the steps built."""
    sync = torch.cuda.synchronize if engine.lm.device.type == "cuda" else (lambda: None)
    builds = (lambda: engine.steps.cache.stats["builds"]) if engine.steps is not None else (lambda: 0)
    before = builds()
    sync()
    t0 = time.perf_counter()
    results = engine.calibrate_many(prompts, cfg)
    sync()
    seconds = time.perf_counter() - t0
    built = builds() - before
    return {"seconds": seconds, "ms_per_prompt": 1e3 * seconds / len(prompts), "steps_built": built,
            "steps_run": sum(r.steps for r in results), "pack": engine.plan.pack,
            "length_buckets": engine.plan.length_buckets, "graphs": engine.plan.graphs,
            "histories": [r.history for r in results], "best_steps": [r.best_step for r in results]}


def measure(lm, prompts, steps: int, N: int = 8, modes=MODES, buckets="auto", **engine_kw) -> dict:
    """Every mode over the mix (repeated: the mix's prompts cut to its median length), after one warm-up prompt
    each. -> {mode: run_mode's dict, with 'ratio' to repeated}."""
    from sicl_fast import CalibrationConfig

    cfg = CalibrationConfig.for_model(lm, N=N, max_steps=steps, tau=0.0, patience=0)
    V = int(lm.head_weight.shape[0])
    median = int(statistics.median(p.length for p in prompts))
    longest = max(p.length for p in prompts)
    same = mix_prompts(V, len(prompts), median, median, seed=1)
    warm = mix_prompts(V, 1, longest + 7, longest + 7, seed=2)
    out = {}
    for mode in (m for m in MODES if m in modes):  # one engine at a time: its steps and graphs go before the next
        eng = engine(lm, mode, buckets, **engine_kw)
        eng.calibrate_many(warm, cfg)
        out[mode] = run_mode(eng, same if mode == "repeated" else prompts, cfg)
        del eng
    base = out.get("repeated", {}).get("ms_per_prompt")
    for r in out.values():
        r["ratio"] = r["ms_per_prompt"] / base if base else None
    if "exact" in out:  # the same prompts padded or packed: how far their runs are from the exact lengths'
        for mode in ("buckets", "packed"):
            if mode in out:
                r, e = out[mode], out["exact"]
                r["max_history_diff"] = max(abs(x - y) for h, g in zip(r["histories"], e["histories"])
                                            for x, y in zip(h, g))
                r["same_best_steps"] = sum(a == b for a, b in zip(r["best_steps"], e["best_steps"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a registry name or path (default: SmolLM2-135M)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--min", type=int, default=200)
    ap.add_argument("--max", type=int, default=600)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--length-buckets", default="auto", help="the buckets mode's choice: auto, or a count a doubling")
    ap.add_argument("--diff-matmul", default="auto", choices=("auto", "off", "bf16", "fp8"),
                    help="every mode's difference products (the buckets' history difference depends on them)")
    ap.add_argument("--smoke", action="store_true", help="4 prompts of 40-90 tokens, 2 steps (the machinery)")
    ap.add_argument("--out", default=None, help="append the figures to this JSON-lines file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.min, args.max, args.steps = 4, 40, 90, 2
    from sicl_fast.models import load

    lm = load(args.model, dtype=args.dtype, device=args.device)
    prompts = mix_prompts(int(lm.head_weight.shape[0]), args.prompts, args.min, args.max)
    load_before = os.getloadavg()
    buckets = args.length_buckets if args.length_buckets == "auto" else int(args.length_buckets)
    res = measure(lm, prompts, args.steps, args.N, args.modes, buckets, diff_matmul=args.diff_matmul)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": lm.name,
              "device": torch.cuda.get_device_name(0) if lm.device.type == "cuda" else
              f"{platform.machine()} CPU, {os.cpu_count()} cores", "dtype": str(lm.dtype),
              "commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                       text=True).stdout.strip(),
              "prompts": args.prompts, "lengths": [args.min, args.max], "steps": args.steps, "N": args.N,
              "length_buckets_asked": buckets, "diff_matmul": args.diff_matmul,
              "load": [load_before, os.getloadavg()], "modes": res}
    for mode, r in res.items():
        ratio = f"{r['ratio']:.2f}x repeated" if r["ratio"] else ""
        near = (f"  history within {r['max_history_diff']:.1e} of exact, best step the same on "
                f"{r['same_best_steps']}/{len(prompts)}" if "max_history_diff" in r else "")
        print(f"{mode:<9} {r['ms_per_prompt']:9.1f} ms a prompt  {r['steps_built']:3d} steps built  "
              f"pack {r['pack']}  buckets {r['length_buckets']}  graphs {r['graphs']}  {ratio}{near}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
