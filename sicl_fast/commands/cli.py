"""Command line: `sicl-fast demo | proxy | calibrate | icleval | report | bench | profile | plan | serve |
gradstudy`. It only parses and calls the API."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import typing
import warnings

from ..calibration.ascent import PRESETS, CalibrationConfig
from ..diagnostics.gradstudy import STUDY_ESTIMATORS, STUDY_MUS, STUDY_NS
from ..errors import SiclError, SiclWarning, require
from ..evaluation.cli import add_icleval_eval_args, add_report_command
from ..formats.records import OPENED, folder_arg
from ..models.attention import ATTN_IMPLS
from ..models.loading import DTYPES
from ..models.transformer import DIFF_MATMUL
from ..ops import IMPLS
from ..run.graphs import GRAPH_MODES
from ..run.knobs import RANGES, arg_type
from ..run.plan import ATTN_PRECISIONS, BACKENDS, LOOPS

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


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (and exit 2), like every other error of the CLI. Negative numbers in any notation
    (-1e308, -.5, -inf) are values, not flags (argparse alone reads only -1 and -1.5 so)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but where there are sub-commands, arguments left over are refused by the (sub-)command that
        was given them ('sicl-fast calibrate: error: unrecognized arguments: 3', and its --help), not by the
        program."""
        if self._subparsers is None:  # a parser of one command (the bench scripts'): argparse's own
            return super().parse_args(args, namespace)
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self._chosen(ns).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def _chosen(self, ns) -> argparse.ArgumentParser:
        """The innermost (sub-)command parser `ns` was parsed by."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(ns, action.dest, None) in action.choices:
                chosen = action.choices[getattr(ns, action.dest)]
                return chosen._chosen(ns) if isinstance(chosen, _Parser) else chosen
        return self


# what each knob does, for its --help (the ranges are sicl_fast.run.knobs'; the defaults the presets')
KNOB_HELP = {
    "mu": "smoothing radius, in units of the model's embedding scale",
    "N": "Gaussian directions per step",
    "eta": "step size, in units of the model's embedding scale",
    "kappa": "cosine floor to the original embeddings; <= 0 turns the projection off",
    "tau": "gate: no ascent when the proxy of the original prompt is below it",
    "patience": "steps without an improvement of the proxy (see --min-delta) before stopping; 0 turns early "
                "stopping off",
    "max_steps": "at most this many steps (K)",
    "alpha": "weight of C (mean per-demonstration confidence) in the proxy",
    "beta": "weight of R (low quantile of the token probabilities) in the proxy",
    "gamma": "weight of G (confidence growth over the demonstrations) in the proxy",
    "q": "the quantile of R",
    "seed": "noise seed; the same seed gives the same run",
    "estimator": "forward, central (pairs X +/- mu U) or grad (the exact gradient)",
    "grad_mode": "clip (each row's gradient to --clip-norm) or normalize (each row to unit norm)",
    "clip_norm": "the per-row gradient norm limit",
    "snr_threshold": "> 0: skip the update when |mean| / std of the finite differences is below it",
    "projection_scope": "prompt (the cosine projection on the whole matrix, as the reference) or demos",
    "perturb_query": "ablation: perturb the query rows too",
    "scale": "the unit of mu and eta; 1.0 gives absolute units",
    "checkpoint": "estimator grad: recompute each layer in the backward (memory of one layer)",
    "min_delta": "patience counts a step as an improvement only when its proxy beats the last counted one by more "
                 "than this (0: any gain, the paper's rule)",
    "min_delta_rel": "the same as a fraction of the last counted proxy (the larger of the two margins applies)",
}
PROXY_KNOBS = ("alpha", "beta", "gamma", "q")  # what the proxy alone reads
# what a whole run reads beyond its steps (bench and profile time steps)
RUN_KNOBS = ("tau", "patience", "max_steps", "min_delta", "min_delta_rel")


def _default_help(name: str, default) -> str:
    """The default a knob takes, as it is: the model's preset where the presets set it (every family's preset holds
    the paper's numbers; N is 8 for models under 1B parameters), the dataclass default otherwise."""
    if name == "N":
        return "default: the model's preset: 8 for models under 1B parameters, as the embedded SmolLM2-135M, else 16"
    if all(name in preset for preset in PRESETS.values()):
        values = {preset[name] for preset in PRESETS.values()}
        return f"default: the model's preset, {values.pop()} for every family" if len(values) == 1 else \
            "default: the model's preset"
    if name == "scale":
        return "default: the model's embedding scale"
    return "default: off" if default is False else f"default: {default}"


def _knob_flags(g, names) -> None:
    """One flag per CalibrationConfig field in `names`, same name with dashes; unset flags keep the preset."""
    hints = typing.get_type_hints(CalibrationConfig)
    for f in dataclasses.fields(CalibrationConfig):
        if f.name not in names:
            continue
        flag, typ = f"--{f.name.replace('_', '-')}", hints[f.name]
        rng = RANGES.get(f.name)
        limits = f"{rng.lo} to {rng.hi}; " if rng is not None else ""
        text = f"{KNOB_HELP[f.name]} ({limits}{_default_help(f.name, f.default)})"
        if typ is bool:
            g.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=text)
            continue
        conv = (arg_type(f.name) if rng is not None else float if typ in (float, float | None)
                else str)
        names_ = [flag, "--num-directions"] if f.name == "N" else [flag]
        g.add_argument(*names_, dest=f.name, type=conv, default=None, metavar=f.name.upper(), help=text)


def _group(title: str, build) -> argparse.ArgumentParser:
    """A parent parser holding one argument group (argparse `parents=`): each command takes the groups it uses."""
    p = argparse.ArgumentParser(add_help=False)
    build(p.add_argument_group(title))
    return p


def _model(g) -> None:
    g.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M; also 'gemma3-270m', a "
                                                 "transformers model folder (with config.json) or a .gguf file")
    g.add_argument("--device", default="auto", help="auto (CUDA where there is one, else the CPU), cpu, cuda, "
                                                    "cuda:1, ...")
    g.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="the weights' dtype; auto: float32, or bfloat16 on CUDA where the weights are bf16 values "
                        "(the perturbation batches' products are bf16 in difference form on both where bf16 is "
                        "fast: bench/RESULTS.md 17)")


def _tokens(g) -> None:
    g.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS); they join the fixed prefix")


def _backend(g, default: str = "auto") -> None:
    text = ("auto (fast when the family is supported, else hf), fast, fast-fp32, hf, naive" if default == "auto" else
            f"default {default}: the static step it times needs the fast backend's forward (fast or fast-fp32)")
    g.add_argument("--backend", default=default, choices=("auto", *BACKENDS), help=text)


def _diff(g) -> None:
    g.add_argument("--diff-matmul", default="auto", choices=DIFF_MATMUL,
                   help="fast backend, float32 models: multiply the perturbed rows' differences from row 0 in bf16 "
                        "(auto: where bf16 products are fast: AVX512-BF16 / AMX CPUs, CUDA sm_80+) or in FP8 e4m3 "
                        "(fp8: tensor cores on CUDA sm_89+, refused below, emulated off CUDA; not chosen by auto yet)")
    g.add_argument("--attn", default="auto", choices=ATTN_IMPLS,
                   help="fast backend: the attention kernel; auto: the fused kernel of --impl (Triton, C++), else "
                        "flash-attn on CUDA for fp16 / bf16 or torch's SDPA; math: the torch reference (what a "
                        "fallback to the torch ops runs)")
    g.add_argument("--attn-precision", default="auto", choices=ATTN_PRECISIONS,
                   help="fast backend: the float32 attention's products (the reference pass's, the difference "
                        "form's); auto: tf32x3 with the Triton attention (3 TF32 products on the tensor cores, about "
                        "21 of float32's 24 bits), the other kernels' own IEEE float32; ieee: IEEE float32 FMA on the "
                        "CUDA cores")


def _ops(g) -> None:
    g.add_argument("--impl", default="auto", choices=IMPLS,
                   help="implementation of the hot ops (perturb, update, proxy, span head, difference epilogues): "
                        "auto (Triton on CUDA, the C++ extension on the CPU when built, else torch), torch, cpp, "
                        "triton")


def _loop(g) -> None:
    g.add_argument("--loop", default="auto", choices=LOOPS,
                   help="static: the step without host reads, checked every --sync-every steps; eager: the readable "
                        "reference loop; auto: static where the backend supports it (fast, fast-fp32). Same results.")
    g.add_argument("--sync-every", type=arg_type("sync_every"), default=None, metavar="K",
                   help="static loop: read the state back every K steps (default 1 on the CPU, 8 on a GPU)")
    g.add_argument("--graphs", default="auto", choices=GRAPH_MODES,
                   help="CUDA graphs: the static step captured once per prompt shape and replayed, and the decode "
                        "step captured per cache length; auto: on for CUDA with the static loop. Same results.")
    g.add_argument("--length-buckets", type=arg_type("length_buckets", auto=True, words=("off",)), default="auto",
                   metavar="K",
                   help="pad the static step to a ladder of K lengths a doubling (a power of two), so that prompts of "
                        "nearby lengths share one step and its CUDA graph; auto: 4 where graphs are on, else off. "
                        "Same results up to the products' summation order")


def _pack(g) -> None:
    g.add_argument("--pack", type=arg_type("pack", auto=True), default="auto", metavar="P",
                   help="calibrate up to P prompts at once through one batched forward (throughput mode, fast "
                        "backend; bench times one packed step of P copies of the prompt); auto (the default): 8 on "
                        "CUDA for a model under 1B parameters, where it pays, else 1 (sicl-fast plan says why)")


def _serve_pack(g) -> None:
    g.add_argument("--pack", type=arg_type("pack", auto=True), default=1, metavar="P",
                   help="calibrate up to P concurrent requests as slots of one packed step (each joining at a read "
                        "and leaving at its own stop), without the store (their reuse is off unless a request asks "
                        "for it); auto: 8 on CUDA for a model under 1B parameters, where it pays, else 1 (default 1: "
                        "calibrations one at a time, through the store)")


def _budget(g) -> None:
    g.add_argument("--time-budget", dest="time_budget", type=arg_type("time_budget_s"), default=None, metavar="S",
                   help="stop each calibration at the first step boundary after S seconds (static loop: the first "
                        "read of its state) with the best embeddings so far, stop reason time_budget; at least one "
                        "step runs (default: no budget)")


def _generate(g) -> None:
    g.add_argument("--max-new-tokens", type=arg_type("max_new_tokens"), default=None,
                   help="at most this many tokens per answer (default 32)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string, at least one character (repeatable; default: a newline)")


def _threads(g) -> None:
    g.add_argument("--threads", type=arg_type("threads"), default=None, metavar="N",
                   help="threads of torch and the C++ ops (one pool; default: OMP_NUM_THREADS when set, else the "
                        "cores this process may use; on a machine shared with other work fewer can be faster). "
                        "OpenMP's wait policy is PASSIVE unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set "
                        "(`sicl-fast plan` shows both)")


def _ray(g) -> None:
    """--ray [ADDRESS] and the pool's shape (commands.distributed); Ray is the optional `ray` extra. The values are
    checked while parsing, with or without --ray."""
    from .distributed import LOCAL

    g.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                   help="run on a pool of Ray actors: no ADDRESS starts a local Ray, 'auto' or 'ray://host:port' "
                        "joins a cluster")
    g.add_argument("--workers", type=arg_type("workers"), default=1, help="engine actors, one model each (default 1)")
    g.add_argument("--cpus-per-worker", type=arg_type("cpus_per_worker"), default=None,
                   help="default: the cluster's CPUs // --workers (each actor's --threads match it unless given)")
    g.add_argument("--gpus-per-worker", type=arg_type("gpus_per_worker"), default=None,
                   help="default: 1 with --device cuda, else 0")
    g.add_argument("--max-retries", type=arg_type("max_retries"), default=None,
                   help="times a request is retried after its worker died before it is recorded as an error "
                        "(default 2)")


def _parents() -> dict[str, argparse.ArgumentParser]:
    """The flag groups, each a parent parser (a command takes the ones it uses, #26)."""
    # the estimator is a group of its own: the one knob the run plan reads (estimator 'grad': differentiable ops)
    ascent = [f.name for f in dataclasses.fields(CalibrationConfig) if f.name not in (*PROXY_KNOBS, "estimator")]
    step = [name for name in ascent if name not in RUN_KNOBS]
    return {
        "model": _group("model", _model), "tokens": _group("tokens", _tokens),
        "backend": _group("backend", _backend), "ops": _group("hot ops", _ops),
        "diff": _group("difference products", _diff),
        "backend_fast": _group("backend", lambda g: _backend(g, "fast")),
        "threads": _group("threads", _threads),
        "loop": _group("loop", _loop), "pack": _group("packing", _pack),
        "serve_pack": _group("packing", _serve_pack),
        "proxy": _group("proxy weights", lambda g: _knob_flags(g, PROXY_KNOBS)),
        "estimator": _group("estimator", lambda g: _knob_flags(g, ("estimator",))),
        "ascent": _group("ascent", lambda g: _knob_flags(g, ascent)),
        "step": _group("ascent step", lambda g: _knob_flags(g, step)),
        "generate": _group("answers", _generate),
        "reuse": _group("calibration store (docs/store.md)", _reuse),
        "store": _group("calibration store: where it keeps calibrations", _store),
        "budget": _group("time budget", _budget),
        "ray": _group('scale out on Ray (the ray extra: SICL_RAY=1 make setup; docs/scaling.md)', _ray),
        "debug": _group("errors", lambda g: g.add_argument(
            "--debug", action="store_true", help="show the full traceback of an unexpected error")),
    }


# the flag groups of each command: only the flags it uses ('proxy' runs one row, so no difference products; 'plan'
# only the flags that change the plan, sicl_fast.run.plan.make_plan: of the knobs, --estimator (grad) and --reuse)
COMMAND_GROUPS = {
    "demo": ("model", "tokens", "backend", "ops", "diff", "threads", "loop", "proxy", "estimator", "ascent", "budget",
             "generate"),
    "proxy": ("model", "tokens", "backend", "ops", "threads", "proxy"),
    "calibrate": ("model", "tokens", "backend", "ops", "diff", "threads", "loop", "pack", "proxy", "estimator",
                  "ascent", "budget", "generate", "ray", "reuse", "store"),
    "icleval": ("model", "backend", "ops", "diff", "threads", "loop", "pack", "proxy", "estimator", "ascent",
                "budget", "ray", "reuse", "store"),
    "bench": ("model", "ops", "diff", "threads", "loop", "pack", "proxy", "estimator", "step"),
    "profile": ("model", "tokens", "backend_fast", "ops", "diff", "threads", "proxy", "estimator", "step"),
    "gradstudy": ("model", "tokens", "backend", "ops", "diff", "threads", "proxy", "estimator", "ascent"),
    "serve": ("model", "tokens", "backend", "ops", "diff", "threads", "loop", "serve_pack", "reuse", "store"),
    "plan": ("model", "backend", "ops", "diff", "threads", "loop", "pack", "estimator", "reuse"),
    "report": (),
}


def _reuse(g) -> None:
    """Whether calibrations go through the store (sicl_fast.answering.reuse; a run plan choice): --reuse."""
    from ..run.plan import REUSE_MODES

    g.add_argument("--reuse", default=None, choices=REUSE_MODES,
                   help="auto (default): requests sharing their instruction and demonstrations are calibrated once "
                        "and reused where that is exact, calibrated per query where it is not; on: reuse always "
                        "(records say when it is approximate); off: calibrate every request (the default with "
                        "--pack > 1, which calibrates packed, without the store)")


def _store(g) -> None:
    """Where the calibration store keeps calibrations (sicl_fast.store): --store, --store-mib."""
    from ..store import DEFAULT_MAX_BYTES

    g.add_argument("--store", type=folder_arg, default=None, metavar="DIR",
                   help="also keep calibrations on disk in DIR, for reruns and for processes sharing it (default: "
                        "memory only)")
    g.add_argument("--store-mib", type=arg_type("store_mib"), default=None, metavar="MIB",
                   help=f"memory the store may hold, in MiB (default {DEFAULT_MAX_BYTES >> 20})")


def _store_mib(args) -> int:
    """--store-mib, or its default (None in args: told apart from a value given, which _check_store refuses where
    the store is not used)."""
    from ..store import DEFAULT_MAX_BYTES

    return args.store_mib if args.store_mib is not None else DEFAULT_MAX_BYTES >> 20


def _check_store(args) -> None:
    """--store and --store-mib before any work: refused where no calibration goes through the store (calibrate and
    icleval with --reuse off, the default with --pack > 1 and with --answer-at: they would only make empty
    folders; serve keeps them, as a request may ask for reuse), then --store checked as --export is (a file, a
    dangling link, no permission: sicl_fast.formats.records.check_out_dir)."""
    from ..formats.records import check_out_dir

    given = [(f, v) for f, v in (("--store", args.store), ("--store-mib", args.store_mib)) if v is not None]
    if given and args.cmd != "serve" and reuse_mode(args) == "off":
        if args.reuse == "off":
            why, fix = "--reuse off calibrates every request on its own, without the store", ", or use --reuse auto"
        elif getattr(args, "answer_at", None):
            why, fix = "--answer-at keeps the best X along each run, so no calibration goes through the store", ""
        else:
            why, fix = f"--pack {args.pack} calibrates packed, without the store", ", or use --pack 1"
        raise SiclError(f"{' and '.join(f'{f} {v}' for f, v in given)} would have no effect: {why}; drop "
                        f"{' and '.join(f for f, _ in given)}{fix}")
    if args.store is not None:
        require("safetensors")  # made with the engine's store: a refused resume leaves no folder
        check_out_dir(args.store, "--store", "the calibrations", make=False)


def _pack_count(args) -> int:
    """--pack as a count: 'auto' is one before the plan has resolved it (the plan command's own: its model loads
    with the plan; every other command resolves it first, _resolve_pack)."""
    pack = getattr(args, "pack", 1)
    return 1 if pack == "auto" else pack


def _reuse_choice(args) -> str | None:
    """The store's mode as the flags ask for it (a run plan choice; None: the plan's default): off for a command
    without --reuse; with icleval --answer-at, which keeps the best X along each run, the run plan's rule
    (sicl_fast.run.plan.resolve_reuse: off, and a refusal of --reuse auto / on)."""
    from ..run.plan import resolve_reuse

    if not hasattr(args, "reuse"):
        return "off"
    if getattr(args, "answer_at", None):
        return resolve_reuse(args.reuse, _pack_count(args), keeps_best=True)[0]
    return args.reuse


def reuse_mode(args) -> str:
    """--reuse resolved by the run plan's rule (sicl_fast.run.plan.resolve_reuse: auto unless packing)."""
    from ..run.plan import resolve_reuse

    return resolve_reuse(_reuse_choice(args), _pack_count(args))[0]


def _store_line(workers, args) -> None:
    """One stderr line on what the store did (this process's engine; a Ray pool's workers keep their own)."""
    from .work import store_counts

    if reuse_mode(args) == "off" or getattr(args, "ray", None) is not None:
        return
    n = workers.call(store_counts)
    where = f" (memory and {args.store})" if args.store else " (memory)"
    print(f"store: {n['reused']} calibration(s) reused, {n['calibrated']} run{where}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sicl-fast", description="Self-improving in-context learning, fast.")
    sub = p.add_subparsers(dest="cmd", required=True)
    groups = _parents()

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        parents = [groups[g] for g in COMMAND_GROUPS[name]] + [groups["debug"]]
        return sub.add_parser(name, help=help, parents=parents, **kw)

    command("demo", "calibrate a built-in few-shot example and show both answers",
            description="Calibrate a built-in few-shot example (at most 15 steps unless --max-steps) and show the "
                        "prompt, the proxy at every step and both answers.")

    x = command("proxy", "proxy f(X0) and its parts for each request; JSON lines on stdout")
    x.add_argument("requests", help="requests JSONL ('-': standard input)")

    c = command("calibrate", "calibrate each request; one JSON line per request in --out")
    c.add_argument("requests", help="requests JSONL ('-': standard input)")
    c.add_argument("--out", required=True, help="results JSONL (resumed when it exists); '-' streams to stdout")
    c.add_argument("--generate", action="store_true", help="also decode answer_base and answer_calibrated")
    c.add_argument("--export", type=folder_arg, default=None, metavar="DIR",
                   help="also save each request's calibrated embeddings (every row; safetensors, as answering.export "
                        "writes them) to DIR/<id>.safetensors; the record holds the path under \"embeddings\"")

    e = command("icleval", "base vs calibrated accuracy on ICLEval task files")
    e.add_argument("dir", help="folder with ICLEval task files (data/tasks_data)")
    e.add_argument("--tasks", nargs="*", default=None, help="file names without .json (default: all present)")
    e.add_argument("--limit", type=arg_type("limit"), default=None, help="first N samples per task")
    e.add_argument("--out", required=True)
    add_icleval_eval_args(e)

    bn = command("bench", "ms per ascent step and per calibration, with peak memory")
    bn.add_argument("--length", type=arg_type("length"), nargs="+", default=[128], help="prompt lengths in tokens")
    bn.add_argument("--backends", nargs="+", default=["fast", "fast-fp32", "hf", "naive"], choices=tuple(BACKENDS),
                    metavar="BACKEND", help="backends to compare side by side (default: fast fast-fp32 hf naive)")
    bn.add_argument("--repeats", type=arg_type("repeats"), default=3, help="timed steps per cell (default 3)")
    bn.add_argument("--prefix", type=arg_type("prefix"), default=0,
                    help="tokens of instruction before the demonstrations")
    bn.add_argument("--calibration-steps", type=arg_type("calibration_steps"), default=0,
                    help="also time a whole calibration of this many steps (no gate, patience off): the 'calib s' "
                         "column")

    command("plan", "the run plan the engine flags resolve to on the model (backend, impl, attention, its check and "
                    "its precision, difference products, loop, decoding reads, graphs, pack, estimator, store, "
                    "threads, OpenMP wait policy) and why")

    pr = command("profile", "where the time of one ascent step goes: per phase ms, share, FLOPs, FLOP/s and its floor "
                            "at the product rates of its precisions (float32, bf16) measured here; the step's floor; "
                            "peak memory; kernels per step")
    pr.add_argument("requests", nargs="?", default=None,
                    help="requests JSONL (the first request is profiled); default: a synthetic prompt of --length")
    pr.add_argument("--length", type=arg_type("profile_length"), default=None,
                    help="synthetic prompt length in tokens (default 512; without REQUESTS only)")
    pr.add_argument("--prefix", type=arg_type("prefix"), default=None,
                    help="synthetic prompt: tokens of instruction before the demos (default 0; without REQUESTS only)")
    pr.add_argument("--repeats", type=arg_type("repeats"), default=5,
                    help="timed calls per phase (the best is kept; default 5)")
    pr.add_argument("--trace", default=None, metavar="OUT.json",
                    help="also write a torch.profiler Chrome trace (NVTX ranges per phase on CUDA)")
    pr.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    gs = command("gradstudy", "how close the zeroth-order estimate comes to the exact gradient, per N and mu; one "
                              "JSON line per request in --out")
    gs.add_argument("requests", help="requests JSONL ('-': standard input)")
    gs.add_argument("--out", required=True, help="records JSONL (resumed when it exists; a regular file)")
    gs.add_argument("--report", type=folder_arg, default=None, metavar="DIR",
                    help="also write DIR/study.md, study.json and plots/cosine_vs_N.png")
    gs.add_argument("--study-N", dest="study_N", type=arg_type("N"), nargs="+", default=list(STUDY_NS),
                    metavar="N", help=f"numbers of directions (default {' '.join(map(str, STUDY_NS))})")
    gs.add_argument("--study-mu", dest="study_mu", type=float, nargs="+", default=list(STUDY_MUS), metavar="MU",
                    help=f"smoothing radii, embedding-scale units (default {' '.join(map(str, STUDY_MUS))})")
    gs.add_argument("--study-estimators", dest="study_estimators", nargs="+", default=list(STUDY_ESTIMATORS),
                    choices=STUDY_ESTIMATORS, metavar="EST", help="forward and / or central (default both)")
    gs.add_argument("--seeds", type=arg_type("seeds"), default=8, help="seeds per cell (default 8)")
    gs.add_argument("--points", type=arg_type("points"), nargs="+", default=[0, 5, 10], metavar="STEP",
                    help="exact-gradient calibration steps at which to measure (default 0 5 10)")
    gs.add_argument("--chunk", type=arg_type("chunk"), default=16, help="forward rows per batch (memory; default 16)")

    add_report_command(sub, parents=[groups["debug"]])
    _serve_command(command("serve", "HTTP/JSON calibration server (needs the extra: pip install "
                                    "\"sicl-fast[serve]\")"))
    _cache_command(sub, groups["debug"])
    return p


def _serve_command(s) -> None:
    from ..serve.settings import add_serve_flags

    add_serve_flags(s)


def _cache_command(sub, debug) -> None:
    cc = sub.add_parser("cache", help="the model cache (GGUF files de-quantized into transformers folders, and the "
                                      "run plans resumes recall): list, verify, clear, path")
    acts = cc.add_subparsers(dest="action", required=True, metavar="{list,verify,clear,path}")
    model_help = "a model as --model takes it (default: the embedded SmolLM2-135M)"
    acts.add_parser("list", parents=[debug], help="every entry: its size, source and state")
    v = acts.add_parser("verify", parents=[debug], help="check every byte of every entry (or MODEL's) against the "
                                                        "checksums written with it; damaged entries are moved aside "
                                                        "(the next load converts again); exit 1 when any was")
    v.add_argument("model", nargs="?", default=None, help="only this model's entry")
    v.add_argument("--quick", action="store_true", help="the sampled check a load does, not every byte")
    c = acts.add_parser("clear", parents=[debug], help="remove every entry (or only MODEL's converted folder)")
    c.add_argument("model", nargs="?", default=None, help="only this model's entry")
    pth = acts.add_parser("path", parents=[debug], help="print MODEL's transformers folder, every byte checked "
                                                        "(converting it first when needed or damaged; transformers "
                                                        "loads it as any model folder)")
    pth.add_argument("model", nargs="?", default=None, help=model_help)


def _overrides(args) -> dict:
    """The knobs given on the command line (a command without a knob's flag leaves it to the preset)."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(CalibrationConfig)}


DEFAULT_NEW_TOKENS = 32


def _max_new_tokens(args) -> int:
    """--max-new-tokens, or its default (None in args: told apart from a value given, see _check_read)."""
    return DEFAULT_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens


# flags a command reads in some modes only: (command or None for every command that has the flag, dest, flag,
# whether this run reads it, what reads it); given where nothing reads them, they are refused before any work
MODE_FLAGS = (
    ("calibrate", "max_new_tokens", "--max-new-tokens", lambda a: a.generate, "only --generate decodes answers"),
    ("calibrate", "stop", "--stop", lambda a: a.generate, "only --generate decodes answers"),
    (None, "cpus_per_worker", "--cpus-per-worker", lambda a: a.ray is not None, "it shapes the Ray pool (--ray)"),
    (None, "gpus_per_worker", "--gpus-per-worker", lambda a: a.ray is not None, "it shapes the Ray pool (--ray)"),
    (None, "max_retries", "--max-retries", lambda a: a.ray is not None, "it retries the Ray pool's work (--ray)"),
    ("profile", "length", "--length", lambda a: a.requests is None,
     "it sizes the synthetic prompt, and REQUESTS is profiled as it is"),
    ("profile", "prefix", "--prefix", lambda a: a.requests is None,
     "it shapes the synthetic prompt, and REQUESTS is profiled as it is"),
)


def _check_read(args) -> None:
    """Refuse a flag given where this run does not read it (MODE_FLAGS): it would be ignored without a word."""
    for cmd, dest, flag, read, why in MODE_FLAGS:
        if (cmd is None or cmd == args.cmd) and getattr(args, dest, None) is not None and not read(args):
            raise SiclError(f"{flag} has no effect in this run: {why}; drop {flag}")


def _resolve_pack(args) -> None:
    """--pack auto made a count before any model loads (what the request chunks, the store's flags and the
    estimator's rules read), by the run plan's rule (sicl_fast.run.plan.auto_pack): from the device --device resolves to
    and the model's size without its weights (sicl_fast.models.facts; off CUDA the count is 1 without looking). A
    store asked for (--store, or --reuse auto / on) is used, not packed past: 1."""
    if getattr(args, "pack", None) != "auto":
        return
    if getattr(args, "store", None) is not None or getattr(args, "reuse", None) in ("auto", "on"):
        args.pack = 1
        return
    from ..models.loading import resolve_device
    from ..run.plan import BACKENDS, auto_pack, resolve_backend

    dev = resolve_device(args.device)[0]
    if dev.type != "cuda":
        args.pack = 1
        return
    from ..models.facts import model_arch

    _, cfg, arch = model_arch(args.model)
    n_params = sum(p.numel() for p in arch.parameters())
    backend = getattr(args, "backend", "auto")
    if backend == "auto":  # the plan's rule, on the config alone: fast where the fast decoder's config builds
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        backend = resolve_backend(backend, text, arch.get_input_embeddings())[0]
    sync_free = BACKENDS[backend].sync_free
    static = sync_free and getattr(args, "loop", "auto") != "eager"
    asked = getattr(args, "length_buckets", "auto") not in ("auto", "off")
    args.pack = auto_pack(dev, n_params, static, _wants_grad(args), buckets=asked)[0]


def _check_flags(args) -> None:
    """Every flag checked before any model is loaded: the calibration values (CalibrationConfig's own checks on the
    values given; the integer ranges were checked while parsing, sicl_fast.run.knobs), the stop strings and the
    optional packages the model asks for."""
    from ..backends.generate import check_stops
    from ..models.loading import GEMMA3_FILE, GEMMA3_PACKAGE, SHORT_NAMES, from_models_dir, resolve_device

    _check_read(args)
    if hasattr(args, "device"):  # a device torch cannot use here (mps, meta, ...): before any file is made
        resolve_device(args.device)
    if args.cmd != "plan":  # plan shows 'auto' resolved by the run plan itself, with its reason
        _resolve_pack(args)
    CalibrationConfig(**{k: v for k, v in _overrides(args).items() if v is not None})
    if getattr(args, "stop", None) is not None:
        check_stops(args.stop, "--stop")
    if hasattr(args, "reuse"):
        reuse_mode(args)
    if hasattr(args, "store"):  # after --reuse: its own refusals first
        _check_store(args)
    if _wants_grad(args) and hasattr(args, "impl"):
        from ..models.loading import resolve_device
        from ..run.plan import resolve_impl

        # refuses forward-only ops before the model loads
        resolve_impl(args.impl, resolve_device(args.device)[0], grad=True)
    if getattr(args, "estimator", None) is not None:
        from ..run.plan import check_estimator

        check_estimator(args.estimator, getattr(args, "loop", "auto"), _pack_count(args))
    if hasattr(args, "length_buckets"):  # a count where nothing is padded: packed, or every calibration the gradient
        from ..run.plan import check_buckets

        check_buckets(args.length_buckets, _pack_count(args), _only_grad(args))
    if (SHORT_NAMES.get(str(getattr(args, "model", None)).lower()) == "gemma3-270m"
            and from_models_dir(GEMMA3_FILE) is None):
        require(GEMMA3_PACKAGE)
    if getattr(args, "ray", None) is not None:
        require("ray")


def _only_grad(args) -> bool:
    """Does every calibration of this command take the exact gradient (--estimator grad, or icleval's calibrating
    methods sicl-grad alone)? Then nothing runs the padded static step."""
    from ..evaluation.methods import CALIBRATIONS

    methods = {m for m in getattr(args, "method", None) or () if m in CALIBRATIONS}
    return getattr(args, "estimator", None) == "grad" or methods == {"sicl-grad"}


def _wants_grad(args) -> bool:
    """Will this command run the exact-gradient ascent (--estimator grad, the icleval method sicl-grad, gradstudy)?
    Then the engine is built for it (differentiable ops; sicl_fast.ops.make_ops)."""
    return (getattr(args, "estimator", None) == "grad" or "sicl-grad" in (getattr(args, "method", None) or ())
            or args.cmd == "gradstudy")


def _plan_choices(args, **over) -> dict:
    """The run plan's choices from the flags (sicl_fast.run.plan.Choices; `over` replaces some)."""
    return {**dict(backend=getattr(args, "backend", "auto"), diff_matmul=getattr(args, "diff_matmul", "auto"),
                   attn=getattr(args, "attn", "auto"), attn_precision=getattr(args, "attn_precision", "auto"),
                   impl=args.impl, loop=getattr(args, "loop", "auto"), sync_every=getattr(args, "sync_every", None),
                   pack=getattr(args, "pack", 1), grad=_wants_grad(args), graphs=getattr(args, "graphs", "auto"),
                   length_buckets=getattr(args, "length_buckets", "auto"), reuse=_reuse_choice(args),
                   threads=getattr(args, "threads", None)),
            **over}


def _engine_kwargs(args, add_special_tokens=None) -> dict:
    """The Engine's arguments from the flags (what a Ray worker builds its own engine from)."""
    ast = getattr(args, "add_special_tokens", False) if add_special_tokens is None else add_special_tokens
    # reuse resolved here (the command line's default, sicl_fast.run.plan.resolve_reuse): Engine's own default depends
    # on whether a store is given, the command line's does not
    kw = dict(model=args.model, dtype=args.dtype, device=args.device, add_special_tokens=ast,
              **_plan_choices(args, reuse=reuse_mode(args)))
    if hasattr(args, "store"):  # the commands with the store's flags
        kw.update(store_dir=args.store, store_bytes=_store_mib(args) << 20)
    return kw


def _engine(args, add_special_tokens=None, early=None):
    """The command's Engine; early: what _planned planned before the load, whose plan the engine takes (Engine's
    plan)."""
    from ..engine import Engine

    return Engine(**_engine_kwargs(args, add_special_tokens), plan=early.plan if early is not None else None)


def _choices(args):
    """The run plan's choices of this command's engine (sicl_fast.run.plan.Choices), as _engine_kwargs gives them."""
    from ..run.plan import Choices

    return Choices(**_plan_choices(args, reuse=reuse_mode(args)))


def _planned(args):
    """(the key this command's plan is remembered by, what its engine would plan: sicl_fast.run.planned.Planned, its
    part of the records' settings, the model's name, family and size, the plan), before the model loads: the key for
    _remember (None for a streamed --out, never resumed), the Planned for a resume checked before any weight is read
    (None for a new or streamed --out, and where it cannot be told before the weights are read)."""
    from pathlib import Path

    from ..run.planned import plan_key, planned

    if str(args.out) == "-":
        return None, None
    if not Path(args.out).is_file():
        return plan_key(args.model, args.dtype, args.device, _choices(args))[0], None
    early = planned(args.model, args.dtype, args.device, _choices(args))
    return (early.key if early is not None else None), early


def _preset(early) -> CalibrationConfig:
    """The model's calibration preset, as the engine's config() gives it, from what _planned planned."""
    return CalibrationConfig.preset(early.family, early.n_params)


def _remember(args, key: str | None, facts: dict) -> None:
    """Keep what this command's engine planned after its load (facts: run.workers.engine_facts) under the key
    _planned took before it (the engine sets environment variables of its own), for the next resume of a results
    file to recall without planning (sicl_fast.run.planned.remember): a local engine's (a Ray pool's may run on
    other machines)."""
    from ..run.planned import remember

    if getattr(args, "ray", None) is None:
        remember(key, facts)


def _workers(args, add_special_tokens=None, early=None):
    """Where calibrate / icleval run their work: this process, or a Ray pool with --ray (sicl_fast.run.workers).
    early: as _engine's (a Ray pool's engines plan for themselves)."""
    if getattr(args, "ray", None) is None:
        from ..run.workers import LocalWorkers

        if args.workers != 1:
            raise SiclError(f"--workers {args.workers} needs --ray (one process runs one engine)")
        return LocalWorkers(_engine(args, add_special_tokens, early))
    from .distributed import RayPool

    return RayPool(_engine_kwargs(args, add_special_tokens), workers=args.workers, address=args.ray,
                   cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                   max_retries=2 if args.max_retries is None else args.max_retries)


def cmd_demo(args) -> int:
    _check_flags(args)
    eng = _engine(args)
    new = _max_new_tokens(args)
    prompt = eng.prepare(DEMO_REQUEST, reserve=new)
    over = _overrides(args)
    if over["max_steps"] is None:
        over["max_steps"] = 15  # a short demo; --max-steps for more
    cfg = eng.config(**over)
    stops = args.stop or ["\n"]
    base = eng.generate(prompt, max_new_tokens=new, stop_strings=stops)
    print(f"model: {eng.lm.name}  backend: {eng.backend.name}  impl: {eng.backend.ops.name}  prompt: "
          f"{prompt.length} tokens, {prompt.num_demos} demonstrations, perturbed rows [{prompt.demo_start}, "
          f"{prompt.demo_end})")
    print("--- prompt ---")
    print(prompt.request.prompt)
    print("--------------")
    res = eng.calibrate(prompt, cfg, on_step=lambda s, f: print(f"  step {s:3d}  proxy {f:.4f}", file=sys.stderr),
                        time_budget_s=args.time_budget)
    cal = eng.generate(prompt, res.embeddings, max_new_tokens=new, stop_strings=stops)
    print(f"proxy before: {res.initial_proxy:.4f}   after: {res.best_proxy:.4f}   "
          f"({res.steps} steps, stopped by {res.stop_reason}, {res.seconds:.1f} s)")
    print(f"answer before: {base.answer!r}")
    print(f"answer after:  {cal.answer!r}")
    return 0


def cmd_proxy(args) -> int:
    from ..formats.records import proxy_record
    from ..formats.requests import read_requests

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

    from ..answering.export import ExportingWriter, check_export_dir
    from .work import calibrate_requests, calibrate_settings, check_requests, group_requests
    from ..run.progress import StepProgress, progress_bar
    from ..formats.records import ResultWriter, check_output, nothing_left
    from ..formats.requests import read_requests
    from ..run.settings import resume_check
    from ..run.workers import write_all

    requests = list(read_requests(args.requests))
    _check_flags(args)
    check_output(args.out, inputs=[args.requests])
    if args.export:  # checked, not made (with its first file): a refused resume or request makes no folder
        check_export_dir(args.export, [r.id for r in requests], [args.out, args.requests])
    where = f"--out {args.out}"
    key, early = _planned(args)  # a resume's settings checked before the model loads (None: a new file, not known)
    if early is not None:
        want = calibrate_settings(args, early.settings, _preset(early).with_overrides(**_overrides(args)),
                                  _max_new_tokens(args))
        if nothing_left(args.out, [r.id for r in requests], check=resume_check(want, where)):
            print(f"nothing to do: all {len(requests)} requests are already in {args.out}", file=sys.stderr)
            return 0  # a finished run resumed: no model to load
    with _workers(args, early=early) as workers:
        _remember(args, key, workers.facts)
        cfg = workers.config(**_overrides(args))
        # every request tokenized and its step's memory checked before anything is written
        workers.call(check_requests, requests, _max_new_tokens(args) if args.generate else 0, cfg)
        work = functools.partial(calibrate_requests, config=cfg, max_new_tokens=_max_new_tokens(args),
                                 stop_strings=args.stop, generate=args.generate, export=bool(args.export),
                                 time_budget_s=args.time_budget)
        want = calibrate_settings(args, workers.settings, cfg, _max_new_tokens(args))
        with ResultWriter(args.out, settings=want, check=resume_check(want, where)) as out:
            todo = [r for r in requests if r.id not in out]
            if len(todo) < len(requests):
                print(f"resuming: {len(requests) - len(todo)} of {len(requests)} requests already in {args.out}",
                      file=sys.stderr)
            if reuse_mode(args) != "off":  # one chunk per calibration key: each group calibrated once
                chunks = [[todo[i] for i in g] for g in workers.call(group_requests, todo, cfg)]
            else:
                chunks = [todo[i:i + args.pack] for i in range(0, len(todo), args.pack)]  # --pack: calibrated packed
            with progress_bar(len(todo), "calibrate") as bar:  # closed (its line ended) before any error is printed
                write_all(workers, work, chunks, ExportingWriter(out, args.export) if args.export else out,
                          lambda chunk, msg: [{"id": r.id, "error": msg} for r in chunk], bar,
                          StepProgress(bar, cfg.max_steps))
        _store_line(workers, args)
    return 0


def cmd_icleval(args) -> int:
    from ..evaluation.cli import check_icleval_args, finished_run, print_report, run_icleval_from_args

    _check_flags(args)
    check_icleval_args(args, {k: v for k, v in _overrides(args).items() if v is not None})
    key, early = _planned(args)  # a resume's settings checked before the model loads
    done = finished_run(args, _overrides(args), early)  # --report checked with the flags, made with the report
    if done is not None:  # a finished run resumed: its report, without loading the model
        print(f"nothing to do: all {len(done[1])} records are already in {args.out}", file=sys.stderr)
        return print_report(*done, args)
    # ICLEval: the tokenizer's default special tokens
    with _workers(args, add_special_tokens=True, early=early) as workers:
        _remember(args, key, workers.facts)
        cfg = workers.config(**_overrides(args))
        rc = run_icleval_from_args(workers, cfg, args)
        _store_line(workers, args)
        return rc


def cmd_report(args) -> int:
    from ..evaluation.cli import report_from_args

    return report_from_args(args)


def cmd_bench(args) -> int:
    from ..backends import build_backend
    from ..diagnostics.benchmark import bench_calibration, bench_step, synthetic_prompt
    from ..models import load
    from ..run.plan import Choices, make_plan
    from ..diagnostics.profile import step_floor

    _check_flags(args)
    choices = [Choices(**_plan_choices(args, backend=name)) for name in args.backends]
    lm = load(args.model, dtype=args.dtype, device=args.device)
    cfg = CalibrationConfig.for_model(lm, **_overrides(args))
    plans = [make_plan(lm, c) for c in choices]  # every backend's plan (and refusal) before any timing
    dtype = str(lm.dtype).replace("torch.", "")
    print(f"# model {lm.name}, {dtype}, {lm.device}, N={cfg.N}, B={cfg.batch}, threads {plans[0].threads}, "
          f"OpenMP wait policy {plans[0].wait_policy}", flush=True)
    calib = args.calibration_steps > 0  # the whole-calibration column only when one is timed
    print("| backend | impl | loop | L | prefix | P | ms/step (mean) | ms/step (min) | peak MiB "
          "| floor ms (min / floor) |" + (" calib s |" if calib else ""))
    print("|---" * (11 if calib else 10) + "|")
    for length in args.length:
        prompt = synthetic_prompt(lm, length, seed=cfg.seed, prefix=args.prefix)
        for plan in plans:
            backend = build_backend(plan, lm)
            r = bench_step(backend, prompt, cfg, repeats=args.repeats)
            floor = step_floor(backend, cfg, prompt)  # the fast forward's, at product rates measured now
            row = (f"| {plan.backend} | {r['impl']} | {r['loop']} | {r['L']} | {prompt.demo_start} | {r['P']} | "
                   f"{r['ms_mean']:.1f} | {r['ms_min']:.1f} | {r['peak_mb']:.0f} | "
                   + ("- |" if floor is None else f"{floor.ms:.1f} ({r['ms_min'] / floor.ms:.2f}x) |"))
            if calib:
                c = bench_calibration(backend, prompt, cfg.replace(max_steps=args.calibration_steps, patience=0,
                                                                   tau=0.0))
                row += f" {c['seconds']:.2f} |"
            print(row, flush=True)
    return 0


def cmd_plan(args) -> int:
    from ..models import load
    from ..run.plan import Choices, make_plan

    _check_flags(args)
    choices = Choices(**_plan_choices(args))  # checked before the model loads
    print(make_plan(load(args.model, dtype=args.dtype, device=args.device), choices).explain())
    return 0


def cmd_profile(args) -> int:
    from ..diagnostics.benchmark import synthetic_prompt
    from ..diagnostics.profile import profile_step
    from ..formats.requests import read_requests

    first = next(iter(read_requests(args.requests))) if args.requests else None  # checked before the model loads
    _check_flags(args)
    eng = _engine(args)
    if first is not None:
        prompt = eng.prepare(first)
    else:
        prompt = synthetic_prompt(eng.lm, args.length or 512, seed=args.seed or 0, prefix=args.prefix or 0)
    prof = profile_step(eng.backend, eng.config(**_overrides(args)), prompt, repeats=args.repeats, trace=args.trace,
                        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(prof.as_json()))
    else:
        print(prof.markdown())
    if args.trace:
        print(f"trace: {args.trace}", file=sys.stderr)
    return 0


def cmd_gradstudy(args) -> int:
    from ..diagnostics.gradstudy import StudySettings, study_key, study_prompt, study_settings, walk_config
    from ..run.progress import progress_bar
    from ..formats.records import ResultWriter, check_out_dir, check_output, nothing_left
    from ..formats.requests import read_requests
    from ..run.settings import engine_settings, resume_check
    from ..run.workers import engine_facts

    requests = list(read_requests(args.requests))
    _check_flags(args)
    settings = StudySettings(Ns=tuple(args.study_N), mus=tuple(args.study_mu), estimators=tuple(args.study_estimators),
                             seeds=args.seeds, points=tuple(args.points), chunk=args.chunk)
    if args.out == "-":
        raise SiclError("--out -: gradstudy reads its records back for the table; give a regular file")
    check_output(args.out, inputs=[args.requests])
    if args.report:
        require("matplotlib")
        check_out_dir(args.report, "--report", STUDY_FILES, make=False, files=STUDY_NAMES,
                      inputs=[args.out, args.requests])
    where, ids = f"--out {args.out}", [r.id for r in requests]
    key, early = _planned(args)  # a resume's settings checked before the model loads
    done = early is not None and nothing_left(args.out, ids, key=study_key, check=resume_check(study_settings(
        early.settings, _preset(early).with_overrides(**_overrides(args)), settings, args.add_special_tokens), where))
    if done:  # --report checked with the flags and made with the report: a refused run (a request too long) makes none
        print(f"nothing to do: all {len(ids)} requests are already in {args.out}", file=sys.stderr)
        return _study_table(args, ids, settings, early.name)
    eng = _engine(args, early=early)
    _remember(args, key, engine_facts(eng))
    cfg = eng.config(**_overrides(args))
    prompts = [eng.prepare(r) for r in requests]  # every request tokenized before anything is written
    eng.check_steps(prompts, [walk_config(cfg)])  # and the walk's step checked for memory (issue 54: no 0-byte --out)
    want = study_settings(engine_settings(eng), cfg, settings, args.add_special_tokens)
    with ResultWriter(args.out, key=study_key, settings=want, check=resume_check(want, where)) as out:
        todo = [p for p in prompts if p.id not in out]
        if len(todo) < len(prompts):
            print(f"resuming: {len(prompts) - len(todo)} of {len(prompts)} requests already in {args.out}",
                  file=sys.stderr)
        with progress_bar(len(todo) * len(settings.points), "gradstudy", unit="point") as bar:
            for p in todo:
                out.write(study_prompt(eng.backend, p, cfg, settings, on_point=lambda k: bar.update(1)))
    return _study_table(args, ids, settings, eng.lm.name)


STUDY_FILES = "study.md, study.json and the plots"  # what gradstudy's --report folder gets, for its messages
STUDY_NAMES = ("study.md", "study.json")  # the files its write_report puts there, none of which may be an input


def _study_table(args, ids, settings, title: str) -> int:
    """gradstudy's table of the records of `ids` in --out (one settings: the resume check made sure), and its report
    with --report."""
    from ..diagnostics.gradstudy import markdown, summarize, write_report
    from ..formats.records import read_records

    wanted = set(ids)
    records = [r for r in read_records(args.out) if r.get("id") in wanted]
    rows = summarize(records)
    print(markdown(rows))
    if args.report:
        for path in write_report(args.report, rows, records, settings, title=title):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from ..serve import require
    from ..serve.settings import settings_from_args

    require()  # the extra first, then the bind rule and the socket, then the model: fail fast
    settings = settings_from_args(args)
    from ..serve.server import bind, serve

    sock = bind(settings)
    try:
        engine = _engine(args)
    except BaseException:
        sock.close()
        raise
    return serve(engine, settings, sock)


def cmd_cache(args) -> int:
    """`sicl-fast cache list|verify|clear|path [MODEL]` (sicl_fast.models.converted)."""
    from ..models import converted as cache
    from ..models.loading import model_folder, resolve

    def entry_of(model):
        """The converted entry of MODEL (None: every entry); a model that is a folder has none."""
        if model is None and args.action != "path":
            return None
        _, path, kind = resolve(model)
        if kind == "dir":
            raise SiclError(f"{path} is a transformers model folder, loaded as it is: it has no cache entry")
        entry = cache.find_entry(cache.content_key(path))
        if entry is None:
            raise SiclError(f"{path.name} has no cache entry yet (the first load converts it)")
        return entry

    cache.check_cache_dir()  # before anything is hashed into it: a file, a dangling link, a converted/ that is a file
    if args.action == "path":
        print(model_folder(args.model, full=True))
        return 0
    if args.action == "list":
        found = cache.entries()
        print(f"# {cache.cache_dir()}: {len(found)} item(s), {sum(e.size for e in found) / 2**20:.1f} MiB")
        for e in found:
            if e.state != "plan":
                print(f"{e.size / 2**20:10.1f} MiB  {e.state:12s}  {e.source or '-':40s}  {e.path}")
        plans = [e for e in found if e.state == "plan"]  # a few hundred bytes each, up to 64: one line for all
        if plans:
            print(f"{sum(e.size for e in plans) / 2**20:10.1f} MiB  {'plans':12s}  "
                  f"{f'{len(plans)} remembered run plan(s)':40s}  {cache.plans_dir()}")
        return 0
    if args.action == "verify":
        results = cache.verify_entries(entry_of(args.model), full=not args.quick)
        damaged = 0
        for path, problem, dest, kept in results:
            if problem is None:
                print(f"ok       {path}")
            elif kept is not None:
                damaged += 1
                print(f"damaged  {path}: {problem}; {kept}: it stays in place (the next load converts without "
                      "caching; `sicl-fast cache clear` removes it)")
            elif dest is None:
                print(f"unused   {path}: {problem}")
            else:
                damaged += 1
                print(f"damaged  {path}: {problem}; moved to {dest} (the next load converts again)")
        if not results:
            print(f"# {cache.converted_dir()}: no converted models")
        return 1 if damaged else 0
    removed, freed, skipped = cache.clear(entry_of(args.model))
    for p in skipped:
        print(f"skipped  {p}: a conversion is writing it", file=sys.stderr)
    print(f"removed {len(removed)} item(s), {freed / 2**20:.1f} MiB, from {cache.cache_dir()}")
    return 0


COMMANDS = {"demo": cmd_demo, "proxy": cmd_proxy, "calibrate": cmd_calibrate, "icleval": cmd_icleval,
            "bench": cmd_bench, "report": cmd_report, "profile": cmd_profile, "plan": cmd_plan, "serve": cmd_serve,
            "gradstudy": cmd_gradstudy, "cache": cmd_cache}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (as Ctrl-C raises KeyboardInterrupt), so both end the same way."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def _interrupted(cmd: str, how: str = "interrupted") -> str:
    """What an interrupted (or terminated) run leaves behind, and how to go on."""
    if not OPENED:
        return f"sicl-fast {cmd}: {how}; nothing was written"
    parts = []
    for w in OPENED:
        if w.streaming:
            parts.append(f"{w.written} record(s) written to {w.path} (streamed output does not resume)")
        else:
            parts.append(f"{w.written} record(s) written to {w.path} this run, {len(w.done)} in the file; "
                         "run the same command again to resume")
    return f"sicl-fast {cmd}: {how}; " + "; ".join(parts)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings as one line each; third-party warnings (nothing a user can act on) are dropped."""
    if issubclass(category, SiclWarning):
        print(f"sicl-fast: warning: {message}", file=sys.stderr)


def _quiet_stdout() -> None:
    """After the reader of stdout went away (`| head`): point stdout at /dev/null, so that the flush at exit does
    not fail again (the Python documentation's recipe for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input or a missing optional package (one line), 130 interrupted (Ctrl-C) and 143
    terminated (SIGTERM) (one line each), 141 the reader of stdout went away (no line), 1 an unexpected error (one
    line; --debug shows the traceback)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warning from the tokenizers library
    args = build_parser().parse_args(argv)
    cmd = args.cmd
    OPENED.clear()  # the results files this command opens (for the Ctrl-C summary)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
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
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except KeyboardInterrupt as exc:
        if args.debug:
            raise
        terminated = isinstance(exc, Terminated)
        print(_interrupted(cmd, "terminated" if terminated else "interrupted"), file=sys.stderr)
        return 143 if terminated else 130
    except Exception as exc:  # noqa: BLE001 - the one place that turns a crash into a line
        if args.debug:
            raise
        print(f"sicl-fast {cmd}: internal error: {type(exc).__name__}: {exc} "
              f"(run again with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
