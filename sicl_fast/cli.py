"""Command line: `sicl-fast demo | proxy | calibrate | icleval | report | bench`. It only parses and calls the API."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from .ascent import CalibrationConfig
from .errors import SiclError
from .evaluation.cli import add_icleval_eval_args, add_report_command
from .models.loading import DTYPES, HOW_TO_POINT
from .models.transformer import DIFF_MATMUL

DEMO_REQUEST = {
    "id": "demo",
    "instruction": "Write each number word as a digit.",
    "demos": [
        {"input": "one", "output": "1"},
        {"input": "seven", "output": "7"},
        {"input": "three", "output": "3"},
        {"input": "nine", "output": "9"},
    ],
    "query": "five",
}


def _config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per CalibrationConfig field, same name with dashes; unset flags keep the model's preset."""
    g = p.add_argument_group("calibration (defaults: the model family's preset, see README)")
    hints = typing.get_type_hints(CalibrationConfig)
    for f in dataclasses.fields(CalibrationConfig):
        typ = hints[f.name]
        if typ is bool:
            g.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action="store_const", const=True,
                           default=None, help=f"(preset: {f.default})")
            continue
        conv = float if typ in (float, typing.Optional[float]) else int if typ is int else str
        names = [f"--{f.name.replace('_', '-')}"]
        if f.name == "N":
            names.append("--num-directions")
        g.add_argument(*names, dest=f.name, type=conv, default=None, metavar=f.name.upper(),
                       help=f"(preset: {f.default})")


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"default: the embedded SmolLM2-135M. Also: {HOW_TO_POINT}")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    g.add_argument("--backend", default="auto",
                   help="auto (fast when the family is supported, else hf), fast, fast-fp32, hf, naive")
    g.add_argument("--diff-matmul", default="auto", choices=DIFF_MATMUL,
                   help="fast backend, float32 models: multiply the perturbed rows' differences from row 0 in bf16 "
                        "(auto: where bf16 products are fast: AVX512-BF16 / AMX CPUs, CUDA sm_80+)")
    g.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS); they join the fixed prefix")


def _gen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable; default: a newline)")


def add_ray_flags(p: argparse.ArgumentParser) -> None:
    """--ray [ADDRESS] and the pool's shape (sicl_fast.distributed); Ray is the optional `ray` extra."""
    from .distributed import LOCAL

    g = p.add_argument_group('scale out on Ray (pip install "sicl-fast[ray]"; README "Scaling out")')
    g.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                   help="run on a pool of Ray actors: no ADDRESS starts a local Ray, 'auto' or 'ray://host:port' "
                        "joins a cluster")
    g.add_argument("--workers", type=int, default=1, help="engine actors, one model each (default 1)")
    g.add_argument("--cpus-per-worker", type=int, default=None,
                   help="default: the cluster's CPUs // --workers (torch threads in each actor match it)")
    g.add_argument("--gpus-per-worker", type=float, default=None, help="default: 1 with --device cuda, else 0")
    g.add_argument("--max-retries", type=int, default=2,
                   help="times a request is retried after its worker died before it is recorded as an error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sicl-fast", description="Self-improving in-context learning, fast.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="calibrate a built-in few-shot example and show both answers")
    _model_flags(d), _config_flags(d), _gen_flags(d)

    x = sub.add_parser("proxy", help="proxy f(X0) and its parts for each request; JSON lines on stdout")
    x.add_argument("requests")
    _model_flags(x), _config_flags(x)

    c = sub.add_parser("calibrate", help="calibrate each request; one JSON line per request in --out")
    c.add_argument("requests")
    c.add_argument("--out", required=True)
    c.add_argument("--generate", action="store_true", help="also decode answer_base and answer_calibrated")
    _model_flags(c), _config_flags(c), _gen_flags(c), add_ray_flags(c)

    e = sub.add_parser("icleval", help="base vs calibrated accuracy on ICLEval task files")
    e.add_argument("dir", help="folder with ICLEval task files (data/tasks_data)")
    e.add_argument("--tasks", nargs="*", default=None, help="file names without .json (default: all present)")
    e.add_argument("--limit", type=int, default=None, help="first N samples per task")
    e.add_argument("--out", required=True)
    _model_flags(e), _config_flags(e), add_ray_flags(e)
    add_icleval_eval_args(e)

    bn = sub.add_parser("bench", help="ms per ascent step and per calibration, with peak memory")
    bn.add_argument("--length", type=int, nargs="+", default=[128], help="prompt lengths in tokens")
    bn.add_argument("--backends", nargs="+", default=["fast", "fast-fp32", "hf", "naive"],
                    help="backends to compare side by side")
    bn.add_argument("--repeats", type=int, default=3)
    bn.add_argument("--prefix", type=int, default=0, help="tokens of instruction before the demonstrations")
    bn.add_argument("--calibration-steps", type=int, default=0,
                    help="also time a whole calibration of this many steps (patience off)")
    _model_flags(bn), _config_flags(bn)

    add_report_command(sub)
    return p


def _overrides(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(CalibrationConfig)}


def _engine_kwargs(args, add_special_tokens=None) -> dict:
    ast = args.add_special_tokens if add_special_tokens is None else add_special_tokens
    return dict(model=args.model, backend=args.backend, dtype=args.dtype, device=args.device, add_special_tokens=ast,
                diff_matmul=args.diff_matmul)


def _engine(args, add_special_tokens=None):
    from .engine import Engine

    return Engine(**_engine_kwargs(args, add_special_tokens))


def _workers(args, add_special_tokens=None):
    """Where calibrate / icleval run their work: this process, or a Ray pool with --ray (sicl_fast.workers)."""
    if getattr(args, "ray", None) is None:
        from .workers import LocalWorkers

        if args.workers != 1:
            raise SiclError(f"--workers {args.workers} needs --ray (one process runs one engine)")
        return LocalWorkers(_engine(args, add_special_tokens))
    from .distributed import RayPool

    return RayPool(_engine_kwargs(args, add_special_tokens), workers=args.workers, address=args.ray,
                   cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                   max_retries=args.max_retries)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


def cmd_demo(args) -> int:
    eng = _engine(args)
    prompt = eng.prepare(DEMO_REQUEST, reserve=args.max_new_tokens)
    over = _overrides(args)
    if over["max_steps"] is None:
        over["max_steps"] = 15  # keeps the demo well under a minute on a laptop CPU
    cfg = eng.config(**over)
    stops = args.stop or ["\n"]
    base = eng.generate(prompt, max_new_tokens=args.max_new_tokens, stop_strings=stops)
    print(f"model: {eng.lm.name}  backend: {eng.backend.name}  prompt: {prompt.length} tokens, "
          f"{prompt.num_demos} demonstrations, perturbed rows [{prompt.demo_start}, {prompt.demo_end})")
    print("--- prompt ---")
    print(prompt.request.prompt)
    print("--------------")
    res = eng.calibrate(prompt, cfg, on_step=lambda s, f: print(f"  step {s:3d}  proxy {f:.4f}", file=sys.stderr))
    cal = eng.generate(prompt, res.embeddings, max_new_tokens=args.max_new_tokens, stop_strings=stops)
    print(f"proxy before: {res.initial_proxy:.4f}   after: {res.best_proxy:.4f}   "
          f"({res.steps} steps, stopped by {res.stop_reason}, {res.seconds:.1f} s)")
    print(f"answer before: {base.answer!r}")
    print(f"answer after:  {cal.answer!r}")
    return 0


def cmd_proxy(args) -> int:
    from .requests import read_requests

    eng = _engine(args)
    prompts = [eng.prepare(r) for r in read_requests(args.requests)]  # validate everything before any output
    cfg = eng.config(**_overrides(args))
    for p in prompts:
        out = eng.proxy(p, cfg)
        rec = {"id": p.id, "proxy": float(out.f[0]), "C": float(out.C[0]), "R": float(out.R[0]),
               "G": float(out.G[0]), "num_demos": p.num_demos, "token_spans": [list(s) for s in p.token_spans]}
        print(json.dumps(rec), flush=True)
    return 0


def cmd_calibrate(args) -> int:
    import functools

    from .jobs import calibrate_request, check_requests
    from .records import ResultWriter
    from .requests import read_requests
    from .workers import write_all

    requests = list(read_requests(args.requests))
    with _workers(args) as workers:
        workers.call(check_requests, requests, args.max_new_tokens if args.generate else 0)
        cfg = workers.config(**_overrides(args))
        work = functools.partial(calibrate_request, config=cfg, max_new_tokens=args.max_new_tokens,
                                 stop_strings=args.stop, generate=args.generate)
        with ResultWriter(args.out) as out:
            todo = [r for r in requests if r.id not in out]
            if len(todo) < len(requests):
                print(f"resuming: {len(requests) - len(todo)} of {len(requests)} requests already in {args.out}",
                      file=sys.stderr)
            bar = _progress(len(todo), "calibrate")
            write_all(workers, work, todo, out, lambda r, msg: [{"id": r.id, "error": msg}], bar)
            bar.close()
    return 0


def cmd_icleval(args) -> int:
    from .evaluation.cli import run_icleval_from_args

    with _workers(args, add_special_tokens=True) as workers:  # ICLEval: the tokenizer's default special tokens
        cfg = workers.config(**_overrides(args))
        return run_icleval_from_args(workers, cfg, args)


def cmd_report(args) -> int:
    from .evaluation.cli import report_from_args

    return report_from_args(args)


def cmd_bench(args) -> int:
    from .backends import make_backend
    from .benchmark import bench_calibration, bench_step, synthetic_prompt
    from .engine import Engine

    eng = Engine(model=args.model, backend="hf", dtype=args.dtype, device=args.device)
    cfg = eng.config(**_overrides(args))
    print(f"# model {eng.lm.name}, {args.dtype}, {args.device}, N={cfg.N}, B={cfg.batch}, "
          f"torch threads {__import__('torch').get_num_threads()}")
    print("| backend | L | prefix | P | ms/step (mean) | ms/step (min) | peak MiB | calib s |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.length:
        prompt = synthetic_prompt(eng.lm, length, seed=cfg.seed, prefix=args.prefix)
        for name in args.backends:
            backend = make_backend(name, eng.lm, diff_matmul=args.diff_matmul)
            r = bench_step(backend, prompt, cfg, repeats=args.repeats)
            cal = ""
            if args.calibration_steps:
                c = bench_calibration(backend, prompt, cfg.replace(max_steps=args.calibration_steps, patience=0, tau=0.0))
                cal = f"{c['seconds']:.2f}"
            print(f"| {name} | {r['L']} | {prompt.demo_start} | {r['P']} | {r['ms_mean']:.1f} | {r['ms_min']:.1f} | {r['peak_mb']:.0f} | {cal} |",
                  flush=True)
    return 0


COMMANDS = {"demo": cmd_demo, "proxy": cmd_proxy, "calibrate": cmd_calibrate, "icleval": cmd_icleval,
            "bench": cmd_bench, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.cmd](args)
    except SiclError as exc:
        print(f"sicl-fast {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
