"""Command line: `sicl-fast demo | proxy | calibrate | icleval | report | bench | profile | plan | serve |
gradstudy`. It only parses and calls the API."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
import warnings

from .ascent import CalibrationConfig
from .errors import SiclError, SiclWarning, require
from .evaluation.cli import add_icleval_eval_args, add_report_command
from .graphs import GRAPH_MODES
from .gradstudy import STUDY_ESTIMATORS, STUDY_MUS, STUDY_NS
from .models.loading import DTYPES, HOW_TO_POINT
from .models.transformer import DIFF_MATMUL
from .ops import IMPLS
from .plan import LOOPS
from .records import OPENED

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


def _int_at_least(low: int):
    """An argparse type: an integer >= low (checked while parsing, before any model is loaded)."""
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    conv.__name__ = f"integer >= {low}"
    return conv


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (and exit 2), like every other error of the CLI."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
                        "(auto: where bf16 products are fast: AVX512-BF16 / AMX CPUs, CUDA sm_80+) or in FP8 e4m3 "
                        "(fp8: tensor cores on sm_89+, emulated elsewhere; never chosen by auto yet)")
    g.add_argument("--impl", default="auto", choices=IMPLS,
                   help="implementation of the hot ops (perturb, update, proxy, span head, difference epilogues): "
                        "auto (Triton on CUDA, the C++ extension on the CPU when built, else torch), torch, cpp, "
                        "triton")
    g.add_argument("--loop", default="auto", choices=LOOPS,
                   help="static: the sync-free step (sicl_fast.static); eager: the reference loop; auto: static where "
                        "the backend supports it (fast, fast-fp32). Same results.")
    g.add_argument("--sync-every", type=_int_at_least(1), default=None, metavar="K",
                   help="static loop: read the state back every K steps (default 1 on the CPU, 8 on a GPU)")
    g.add_argument("--graphs", default="auto", choices=GRAPH_MODES,
                   help="CUDA graphs: the static step captured once per prompt shape and replayed, and the decode "
                        "step captured per cache length; auto: on for CUDA with the static loop. Same results.")
    g.add_argument("--pack", type=_int_at_least(1), default=1, metavar="P",
                   help="calibrate / icleval / bench: calibrate up to P prompts at once through one batched forward "
                        "(throughput mode, fast backend; default 1)")
    g.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS); they join the fixed prefix")


def _gen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=32)
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
    p = _Parser(prog="sicl-fast", description="Self-improving in-context learning, fast.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="calibrate a built-in few-shot example and show both answers")
    _model_flags(d), _config_flags(d), _gen_flags(d)

    x = sub.add_parser("proxy", help="proxy f(X0) and its parts for each request; JSON lines on stdout")
    x.add_argument("requests")
    _model_flags(x), _config_flags(x)

    c = sub.add_parser("calibrate", help="calibrate each request; one JSON line per request in --out")
    c.add_argument("requests")
    c.add_argument("--out", required=True, help="results JSONL (resumed when it exists); '-' streams to stdout")
    c.add_argument("--generate", action="store_true", help="also decode answer_base and answer_calibrated")
    _model_flags(c), _config_flags(c), _gen_flags(c), add_ray_flags(c)

    e = sub.add_parser("icleval", help="base vs calibrated accuracy on ICLEval task files")
    e.add_argument("dir", help="folder with ICLEval task files (data/tasks_data)")
    e.add_argument("--tasks", nargs="*", default=None, help="file names without .json (default: all present)")
    e.add_argument("--limit", type=_int_at_least(1), default=None, help="first N samples per task")
    e.add_argument("--out", required=True)
    _model_flags(e), _config_flags(e), add_ray_flags(e)
    add_icleval_eval_args(e)

    bn = sub.add_parser("bench", help="ms per ascent step and per calibration, with peak memory")
    bn.add_argument("--length", type=_int_at_least(1), nargs="+", default=[128], help="prompt lengths in tokens")
    bn.add_argument("--backends", nargs="+", default=["fast", "fast-fp32", "hf", "naive"],
                    help="backends to compare side by side")
    bn.add_argument("--repeats", type=_int_at_least(1), default=3)
    bn.add_argument("--prefix", type=_int_at_least(0), default=0, help="tokens of instruction before the demonstrations")
    bn.add_argument("--calibration-steps", type=_int_at_least(0), default=0,
                    help="also time a whole calibration of this many steps (patience off)")
    _model_flags(bn), _config_flags(bn)

    pl = sub.add_parser("plan", help="the run plan the engine flags resolve to on the model (backend, impl, "
                                     "attention, difference products, loop, graphs, pack, estimator) and why")
    _model_flags(pl), _config_flags(pl)

    pr = sub.add_parser("profile", help="where the time of one ascent step goes: per phase ms, share, FLOPs, "
                                         "FLOP/s against the measured matmul peak; peak memory; kernels per step")
    pr.add_argument("requests", nargs="?", default=None,
                    help="requests JSONL (the first request is profiled); default: a synthetic prompt of --length")
    pr.add_argument("--length", type=_int_at_least(8), default=512,
                    help="synthetic prompt length in tokens (default 512)")
    pr.add_argument("--prefix", type=_int_at_least(0), default=0,
                    help="synthetic prompt: tokens of instruction before the demos")
    pr.add_argument("--repeats", type=_int_at_least(1), default=5, help="timed calls per phase (the best is kept)")
    pr.add_argument("--trace", default=None, metavar="OUT.json",
                    help="also write a torch.profiler Chrome trace (NVTX ranges per phase on CUDA)")
    pr.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    _model_flags(pr), _config_flags(pr)
    pr.set_defaults(backend="fast")

    gs = sub.add_parser("gradstudy", help="how close the zeroth-order estimate comes to the exact gradient, per N "
                                          "and mu (sicl_fast.gradstudy); one JSON line per request in --out")
    gs.add_argument("requests")
    gs.add_argument("--out", required=True, help="records JSONL (resumed when it exists; a regular file)")
    gs.add_argument("--report", default=None, metavar="DIR", help="also write DIR/study.md, study.json and "
                                                                  "plots/cosine_vs_N.png")
    gs.add_argument("--study-N", dest="study_N", type=_int_at_least(1), nargs="+", default=list(STUDY_NS),
                    metavar="N", help=f"numbers of directions (default {' '.join(map(str, STUDY_NS))})")
    gs.add_argument("--study-mu", dest="study_mu", type=float, nargs="+", default=list(STUDY_MUS), metavar="MU",
                    help=f"smoothing radii, embedding-scale units (default {' '.join(map(str, STUDY_MUS))})")
    gs.add_argument("--study-estimators", dest="study_estimators", nargs="+", default=list(STUDY_ESTIMATORS),
                    choices=STUDY_ESTIMATORS, metavar="EST", help="forward and / or central (default both)")
    gs.add_argument("--seeds", type=_int_at_least(1), default=8, help="seeds per cell (default 8)")
    gs.add_argument("--points", type=_int_at_least(0), nargs="+", default=[0, 5, 10], metavar="STEP",
                    help="exact-gradient calibration steps at which to measure (default 0 5 10)")
    gs.add_argument("--chunk", type=_int_at_least(1), default=16, help="forward rows per batch (memory)")
    _model_flags(gs), _config_flags(gs)

    add_report_command(sub)
    _serve_command(sub)
    for name, sp in sub.choices.items():
        sp.add_argument("--debug", action="store_true", help="show the full traceback of an unexpected error")
    return p


def _serve_command(sub) -> None:
    from .serve.settings import add_serve_flags

    s = sub.add_parser("serve", help="HTTP/JSON calibration server (needs the extra: pip install \"sicl-fast[serve]\")")
    _model_flags(s)
    add_serve_flags(s)


def _overrides(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(CalibrationConfig)}


def _check_flags(args) -> None:
    """Every flag checked before any model is loaded: the calibration values (CalibrationConfig's own checks on the
    values given) and the optional packages the model asks for."""
    from .models.loading import GEMMA3_FILE, GEMMA3_PACKAGE, SHORT_NAMES, from_models_dir

    CalibrationConfig(**{k: v for k, v in _overrides(args).items() if v is not None})
    if _wants_grad(args) and hasattr(args, "impl"):
        from .plan import resolve_impl

        resolve_impl(args.impl, args.device, grad=True)  # refuses forward-only ops before the model loads
    if (SHORT_NAMES.get(str(getattr(args, "model", None)).lower()) == "gemma3-270m"
            and from_models_dir(GEMMA3_FILE) is None):
        require(GEMMA3_PACKAGE)
    if getattr(args, "ray", None) is not None:
        require("ray")


def _wants_grad(args) -> bool:
    """Will this command run the exact-gradient ascent (--estimator grad, the icleval method sicl-grad, gradstudy)?
    Then the engine is built for it (differentiable ops; sicl_fast.ops.make_ops)."""
    return (getattr(args, "estimator", None) == "grad" or "sicl-grad" in (getattr(args, "method", None) or ())
            or args.cmd == "gradstudy")


def _plan_choices(args, **over) -> dict:
    """The run plan's choices from the flags (sicl_fast.plan.Choices; `over` replaces some)."""
    return {**dict(backend=args.backend, diff_matmul=args.diff_matmul, impl=args.impl, loop=args.loop,
                   sync_every=args.sync_every, pack=getattr(args, "pack", 1), grad=_wants_grad(args),
                   graphs=args.graphs), **over}


def _engine_kwargs(args, add_special_tokens=None) -> dict:
    """The Engine's arguments from the flags (what a Ray worker builds its own engine from)."""
    ast = args.add_special_tokens if add_special_tokens is None else add_special_tokens
    return dict(model=args.model, dtype=args.dtype, device=args.device, add_special_tokens=ast, **_plan_choices(args))


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
    _check_flags(args)
    eng = _engine(args)
    prompt = eng.prepare(DEMO_REQUEST, reserve=args.max_new_tokens)
    over = _overrides(args)
    if over["max_steps"] is None:
        over["max_steps"] = 15  # keeps the demo well under a minute on a laptop CPU
    cfg = eng.config(**over)
    stops = args.stop or ["\n"]
    base = eng.generate(prompt, max_new_tokens=args.max_new_tokens, stop_strings=stops)
    print(f"model: {eng.lm.name}  backend: {eng.backend.name}  impl: {eng.backend.ops.name}  prompt: "
          f"{prompt.length} tokens, {prompt.num_demos} demonstrations, perturbed rows [{prompt.demo_start}, "
          f"{prompt.demo_end})")
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
    from .records import proxy_record
    from .requests import read_requests

    requests = list(read_requests(args.requests))
    _check_flags(args)
    eng = _engine(args)
    prompts = [eng.prepare(r) for r in requests]  # validate everything before any output
    cfg = eng.config(**_overrides(args))
    for p in prompts:
        print(json.dumps(proxy_record(p, eng.proxy(p, cfg))), flush=True)
    return 0


def cmd_calibrate(args) -> int:
    import functools

    from .jobs import calibrate_requests, check_requests
    from .records import ResultWriter, check_output
    from .requests import read_requests
    from .workers import write_all

    requests = list(read_requests(args.requests))
    _check_flags(args)
    check_output(args.out, inputs=[args.requests])
    with _workers(args) as workers:
        cfg = workers.config(**_overrides(args))
        # every request tokenized and its step's memory checked before anything is written
        workers.call(check_requests, requests, args.max_new_tokens if args.generate else 0, cfg)
        work = functools.partial(calibrate_requests, config=cfg, max_new_tokens=args.max_new_tokens,
                                 stop_strings=args.stop, generate=args.generate)
        with ResultWriter(args.out) as out:
            todo = [r for r in requests if r.id not in out]
            if len(todo) < len(requests):
                print(f"resuming: {len(requests) - len(todo)} of {len(requests)} requests already in {args.out}",
                      file=sys.stderr)
            chunks = [todo[i:i + args.pack] for i in range(0, len(todo), args.pack)]  # --pack: calibrated packed
            with _progress(len(todo), "calibrate") as bar:  # closed (its line ended) before any error is printed
                write_all(workers, work, chunks, out, lambda chunk, msg: [{"id": r.id, "error": msg} for r in chunk],
                          bar)
    return 0


def cmd_icleval(args) -> int:
    from .evaluation.cli import check_icleval_args, run_icleval_from_args

    _check_flags(args)
    check_icleval_args(args)
    with _workers(args, add_special_tokens=True) as workers:  # ICLEval: the tokenizer's default special tokens
        cfg = workers.config(**_overrides(args))
        return run_icleval_from_args(workers, cfg, args)


def cmd_report(args) -> int:
    from .evaluation.cli import report_from_args

    return report_from_args(args)


def cmd_bench(args) -> int:
    from .backends import build_backend
    from .benchmark import bench_calibration, bench_step, synthetic_prompt
    from .models import load
    from .plan import Choices, make_plan

    _check_flags(args)
    choices = [Choices(**_plan_choices(args, backend=name)) for name in args.backends]
    lm = load(args.model, dtype=args.dtype, device=args.device)
    cfg = CalibrationConfig.for_model(lm, **_overrides(args))
    plans = [make_plan(lm, c) for c in choices]  # every backend's plan (and refusal) before any timing
    print(f"# model {lm.name}, {args.dtype}, {args.device}, N={cfg.N}, B={cfg.batch}, "
          f"torch threads {__import__('torch').get_num_threads()}")
    print("| backend | impl | loop | L | prefix | P | ms/step (mean) | ms/step (min) | peak MiB | calib s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in args.length:
        prompt = synthetic_prompt(lm, length, seed=cfg.seed, prefix=args.prefix)
        for plan in plans:
            backend = build_backend(plan, lm)
            r = bench_step(backend, prompt, cfg, repeats=args.repeats)
            cal = ""
            if args.calibration_steps:
                c = bench_calibration(backend, prompt, cfg.replace(max_steps=args.calibration_steps, patience=0,
                                                                   tau=0.0))
                cal = f"{c['seconds']:.2f}"
            print(f"| {plan.backend} | {r['impl']} | {r['loop']} | {r['L']} | {prompt.demo_start} | {r['P']} | "
                  f"{r['ms_mean']:.1f} | {r['ms_min']:.1f} | {r['peak_mb']:.0f} | {cal} |", flush=True)
    return 0


def cmd_plan(args) -> int:
    from .models import load
    from .plan import Choices, make_plan

    _check_flags(args)
    choices = Choices(**_plan_choices(args))  # checked before the model loads
    print(make_plan(load(args.model, dtype=args.dtype, device=args.device), choices).explain())
    return 0


def cmd_profile(args) -> int:
    from .benchmark import synthetic_prompt
    from .profile import profile_step
    from .requests import read_requests

    _check_flags(args)
    eng = _engine(args)
    if args.requests:
        prompt = eng.prepare(read_requests(args.requests)[0])
    else:
        prompt = synthetic_prompt(eng.lm, args.length, seed=args.seed or 0, prefix=args.prefix)
    prof = profile_step(eng.backend, eng.config(**_overrides(args)), prompt, repeats=args.repeats, trace=args.trace)
    if args.json:
        print(json.dumps({"info": prof.info, "step_ms": prof.step_ms, "peak_mb": prof.peak_mb,
                          "kernels": {"total": prof.kernels.total, "per_layer": prof.kernels.per_layer,
                                      "rest": prof.kernels.rest},
                          "matmul_peak_gflops": prof.peak_gflops, "matmul_peak_shape": prof.peak_shape,
                          "phases": [dict(zip(("phase", "ms", "share", "gflop", "gflops", "pct_peak"), r))
                                     for r in prof.rows]}))
    else:
        print(prof.markdown())
    if args.trace:
        print(f"trace: {args.trace}", file=sys.stderr)
    return 0


def cmd_gradstudy(args) -> int:
    from .gradstudy import StudySettings, markdown, study_prompt, summarize, write_report
    from .records import ResultWriter, check_output, read_records
    from .requests import read_requests

    requests = list(read_requests(args.requests))
    _check_flags(args)
    settings = StudySettings(Ns=tuple(args.study_N), mus=tuple(args.study_mu), estimators=tuple(args.study_estimators),
                             seeds=args.seeds, points=tuple(args.points), chunk=args.chunk)
    if args.out == "-":
        raise SiclError("--out -: gradstudy reads its records back for the table; give a regular file")
    check_output(args.out, inputs=[args.requests])
    if args.report:
        require("matplotlib")
    eng = _engine(args)
    cfg = eng.config(**_overrides(args))
    prompts = [eng.prepare(r) for r in requests]  # every request tokenized before anything is written
    with ResultWriter(args.out) as out:
        todo = [p for p in prompts if p.id not in out]
        if len(todo) < len(prompts):
            print(f"resuming: {len(prompts) - len(todo)} of {len(prompts)} requests already in {args.out}",
                  file=sys.stderr)
        with _progress(len(todo) * len(settings.points), "gradstudy") as bar:
            bar.unit = "point"
            for p in todo:
                out.write(study_prompt(eng.backend, p, cfg, settings, on_point=lambda k: bar.update(1)))
    ids = {p.id for p in prompts}
    records = [r for r in read_records(args.out) if r.get("id") in ids]
    rows = summarize(records)
    print(markdown(rows))
    if args.report:
        for path in write_report(args.report, rows, records, settings, title=eng.lm.name):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .serve import require
    from .serve.settings import settings_from_args

    require()  # the extra first, then the bind rule, then the model: fail fast
    settings = settings_from_args(args)
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    from .serve.server import serve

    return serve(_engine(args), settings)


COMMANDS = {"demo": cmd_demo, "proxy": cmd_proxy, "calibrate": cmd_calibrate, "icleval": cmd_icleval,
            "bench": cmd_bench, "report": cmd_report, "profile": cmd_profile, "plan": cmd_plan, "serve": cmd_serve,
            "gradstudy": cmd_gradstudy}


def _interrupted(cmd: str) -> str:
    """What an interrupted run leaves behind, and how to go on."""
    if not OPENED:
        return f"sicl-fast {cmd}: interrupted; nothing was written"
    parts = []
    for w in OPENED:
        if w.streaming:
            parts.append(f"{w.written} record(s) written to {w.path} (streamed output does not resume)")
        else:
            parts.append(f"{w.written} record(s) written to {w.path} this run, {len(w.done)} in the file; "
                         "run the same command again to resume")
    return f"sicl-fast {cmd}: interrupted; " + "; ".join(parts)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings as one line each; third-party warnings (nothing a user can act on) are dropped."""
    if issubclass(category, SiclWarning):
        print(f"sicl-fast: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input or a missing optional package (one line), 130 interrupted (one line),
    1 an unexpected error (one line; --debug shows the traceback)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warning from the tokenizers library
    args = build_parser().parse_args(argv)
    cmd = args.cmd
    OPENED.clear()  # the results files this command opens (for the Ctrl-C summary)
    try:
        with warnings.catch_warnings():
            if not args.debug:
                warnings.showwarning = _show_warning
            return COMMANDS[cmd](args)
    except SiclError as exc:
        if args.debug:
            raise
        print(f"sicl-fast {cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(_interrupted(cmd), file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place that turns a crash into a line
        if args.debug:
            raise
        print(f"sicl-fast {cmd}: internal error: {type(exc).__name__}: {exc} "
              f"(run again with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
