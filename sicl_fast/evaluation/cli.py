"""Command-line glue for `sicl-fast icleval ... --report RUN/ [--method ...] [ablations]` and `sicl-fast report`.

sicl_fast/commands/cli.py calls:
    add_icleval_eval_args(icleval_parser)          the flags below, on the icleval subcommand
    run_icleval_from_args(engine, config, args)    runs, prints the tables, writes the report; returns the exit code
    finished_run(args, overrides, early)           (model, records) of a resumed run with nothing left, or None
    print_report(model, records, args)             the tables (and --report) from the records
    add_report_command(subparsers)                 the `report` subcommand
    report_from_args(args)                         its implementation; returns the exit code
"""
from __future__ import annotations

import argparse
import re
import sys

from ..run.knobs import arg_type
from ..formats.records import check_out_dir, folder_arg
from .ablations import ABLATIONS, make_variants
from .icleval_cls import DCPMI_PREMISES
from .methods import CALIBRATIONS, METHODS, BaselineOptions, run_methods

REPORT_FILES = "report.md, report.json and plots/"  # what --report's folder gets, for its messages
REPORT_NAMES = ("report.md", "report.json")  # the files write_report puts in it, none of which may be an input


def add_icleval_eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation (methods, baselines, ablations, report)")
    g.add_argument("--report", type=folder_arg, default=None, metavar="RUN_DIR",
                   help="also write RUN_DIR/report.md, report.json and plots/*.png from the records")
    g.add_argument("--method", nargs="+", default=["sicl"], choices=METHODS, metavar="METHOD",
                   help=f"one or more of {', '.join(METHODS)} (default: sicl); sicl-grad: the same calibration "
                        "with the exact gradient (estimator grad, every row normalised to step eta); cc, dcpmi and "
                        "demo run on the classification files only")
    g.add_argument("--ablate", nargs="+", default=[], choices=ABLATIONS, metavar="WHAT",
                   help="extra calibration variants: alpha, beta or gamma off (the others rescaled), perturb-query")
    g.add_argument("--sweep-N", dest="sweep_N", nargs="+", type=arg_type("N"), default=[], metavar="N",
                   help="extra calibration variants, one per number of directions")
    g.add_argument("--sweep-mu", dest="sweep_mu", nargs="+", type=float, default=[], metavar="MU",
                   help="extra calibration variants, one per smoothing radius")
    g.add_argument("--no-reference", action="store_true",
                   help="with --ablate / --sweep-*, do not also run the unablated calibration")
    g.add_argument("--cf-inputs", nargs="+", default=None, metavar="TEXT",
                   help="content-free inputs of cc and demo (default: 'N/A' '' '[MASK]')")
    g.add_argument("--dcpmi-premise", default=None, choices=DCPMI_PREMISES,
                   help="DC-PMI domain premise: the answer delimiter 'Output:' alone (default) or the "
                        "demonstrations followed by it")
    g.add_argument("--demo-orders", type=arg_type("demo_orders"), default=None,
                   help="DEmO: candidate orders (all of them if n! is smaller; default 24)")
    g.add_argument("--demo-top-k", type=arg_type("demo_top_k"), default=None,
                   help="DEmO: orders kept by the label-fairness stage (default 4)")
    g.add_argument("--demo-seed", type=arg_type("seed"), default=None, help="DEmO: the seed of its orders (default 0)")
    g.add_argument("--demo-influence", default=None, choices=("zeroshot", "content_free"),
                   help="DEmO: reference distribution of the influence KL (default zeroshot)")
    g.add_argument("--demo-predict", default=None, choices=("score", "generate"),
                   help="DEmO: argmax label (default) or greedy decoding with the chosen order")
    g.add_argument("--answer-at", dest="answer_at", nargs="+", type=arg_type("max_steps"), default=[],
                   metavar="STEPS", help="also decode each calibration's answer from its best embeddings after these "
                                         "step counts (e.g. 1 2 5 10 20 50): the report's answers changed vs steps")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def options_from_args(args) -> BaselineOptions:
    """The baselines' settings from their flags (BaselineOptions' defaults for those not given)."""
    given = {f: getattr(args, f) for f in ("dcpmi_premise", "demo_orders", "demo_top_k", "demo_seed",
                                           "demo_influence", "demo_predict") if getattr(args, f) is not None}
    if args.cf_inputs is not None:
        given["cf_inputs"] = tuple(args.cf_inputs)
    return BaselineOptions(**given)


# the evaluation flags only some methods read: (dest, flag, the methods that read it); given to a run of none of
# them, they are refused before any work (check_method_flags)
METHOD_FLAGS = (("cf_inputs", "--cf-inputs", ("cc", "demo")), ("dcpmi_premise", "--dcpmi-premise", ("dcpmi",)),
                *((f"demo_{x}", f"--demo-{x.replace('_', '-')}", ("demo",))
                  for x in ("orders", "top_k", "seed", "influence", "predict")),
                ("ablate", "--ablate", ("sicl",)), ("sweep_N", "--sweep-N", ("sicl",)),
                ("sweep_mu", "--sweep-mu", ("sicl",)), ("no_reference", "--no-reference", ("sicl",)),
                ("answer_at", "--answer-at", CALIBRATIONS), ("time_budget", "--time-budget", CALIBRATIONS))


def check_method_flags(args, knobs: dict) -> None:
    """Refuse an evaluation flag (METHOD_FLAGS) or a calibration knob (`knobs`: those given) that no method of
    --method reads, and --no-reference without a variant to run instead: each would be ignored without a word."""
    from ..errors import SiclError

    methods = set(args.method)
    asked = f"--method {' '.join(args.method)}"  # as given
    for dest, flag, readers in METHOD_FLAGS:
        if getattr(args, dest, None) not in (None, [], False) and not methods & set(readers):
            raise SiclError(f"{flag} has no effect: it is read by --method {' or '.join(readers)} only, and this "
                            f"run's is {asked}; add that method or drop {flag}")
    if not methods & set(CALIBRATIONS):
        flags = [f"--{k.replace('_', '-')}" for k in knobs] + (["--store"] if getattr(args, "store", None) else [])
        if flags:
            one = len(flags) == 1
            raise SiclError(f"{', '.join(flags)} {'has' if one else 'have'} no effect: {asked} runs no calibration "
                            f"(sicl, sicl-grad); drop {'it' if one else 'them'} or add a calibration method")
    if args.no_reference and not (args.ablate or args.sweep_N or args.sweep_mu):
        raise SiclError("--no-reference has no effect without --ablate, --sweep-N or --sweep-mu (the variants run "
                        "instead of the reference calibration); drop it or add them")


def check_icleval_args(args, knobs: dict | None = None) -> None:
    """Everything `sicl-fast icleval` can check before a model is loaded and before a resume is checked: flags no
    method of the run reads (check_method_flags; `knobs`: the calibration knobs given), the baselines' settings,
    --out, the data folder, --tasks and --limit (the samples are selected once here), and the optional packages of
    the tables and plots. The --report folder is made after the resume's check (a refused resume makes none)."""
    from ..errors import require
    from .methods import check_records_out, select_samples

    check_method_flags(args, knobs or {})
    options_from_args(args)
    require("scipy")
    if args.report:
        require("matplotlib")
        check_out_dir(args.report, "--report", REPORT_FILES, make=False, files=REPORT_NAMES, inputs=[args.out])
    check_records_out(args.out, args.dir)
    select_samples(args.dir, args.tasks, args.limit)


def run_icleval_from_args(engine, config, args, file=None) -> int:
    """`sicl-fast icleval`: run the methods, print the report's tables, write the report when --report is given.
    engine: an Engine or Workers (sicl_fast.run.workers: a Ray pool with --ray)."""
    from ..run.workers import as_workers

    workers = as_workers(engine)
    variants = make_variants(config, workers.config(), ablate=args.ablate, sweep_N=args.sweep_N,
                             sweep_mu=args.sweep_mu, reference=not args.no_reference)
    records = run_methods(workers, args.dir, args.out, methods=args.method, config=config, tasks=args.tasks,
                          limit=args.limit, sicl_variants=variants, options=options_from_args(args),
                          progress=not args.quiet, pack=getattr(args, "pack", 1),
                          time_budget_s=getattr(args, "time_budget", None), answer_at=args.answer_at)
    return print_report(workers.model_name, records, args, file)


def finished_run(args, overrides: dict, early):
    """(model name, records) when every record the run asks for is already in --out (a resumed run with nothing
    left to do), found without loading the model: `early` is what the run's engine would plan
    (sicl_fast.run.planned.Planned; None: not known before the load, the run then loads it), and the records are
    checked as a resume checks them (resume_rule): a file of other settings is refused here. None when there is
    work."""
    from pathlib import Path

    from ..calibration.ascent import CalibrationConfig
    from ..formats.records import nothing_left, read_records
    from .methods import build_variants, icleval_settings, record_key, resume_rule, select_samples, wanted_keys

    if early is None or not Path(args.out).is_file():
        return None
    preset = CalibrationConfig.preset(early.family, early.n_params)
    config = preset.with_overrides(**overrides)
    variants = build_variants(args.method, None, config, make_variants(
        config, preset, ablate=args.ablate, sweep_N=args.sweep_N, sweep_mu=args.sweep_mu,
        reference=not args.no_reference), options_from_args(args))
    keys = wanted_keys(select_samples(args.dir, args.tasks, args.limit), variants)
    budget = getattr(args, "time_budget", None)
    want = icleval_settings(early.settings, config, budget, args.answer_at)
    if not nothing_left(args.out, keys, key=record_key,
                        check=resume_rule(want, variants, args.out, budget, args.answer_at)):
        return None
    wanted = set(keys)
    return early.name, [r for r in read_records(args.out) if record_key(r) in wanted]


def print_report(model: str, records: list[dict], args, file=None) -> int:
    """Print the report's tables of `records` (one run of `model`); write the report when --report is given."""
    from .report import Run, build_report, drop_failed, render_markdown, write_report

    file = file or sys.stdout
    runs = [Run(name=model, records=drop_failed(records, str(args.out)), source=str(args.out))]
    if args.report:
        write_report(args.report, runs)
        print(f"report: {args.report}/report.md", file=sys.stderr)
    print(render_markdown(build_report(runs)), file=file)
    return 0


def add_report_command(subparsers, parents=()) -> argparse.ArgumentParser:
    r = subparsers.add_parser("report", help="the analysis (tables, tests, plots) of one or more results files",
                              parents=list(parents))
    r.add_argument("results", nargs="+", help="results JSONL files, one per run (model)")
    r.add_argument("--report", type=folder_arg, required=True, metavar="RUN_DIR",
                   help="folder for report.md, report.json, plots/")
    r.add_argument("--names", nargs="+", default=None, help="run names (default: the records' model, or file stem)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--summary-into", default=None, metavar="FILE.md",
                   help="also put the one-row-per-variant summary table into FILE.md, between the lines "
                        "<!-- sicl-report:NAME:begin --> and <!-- sicl-report:NAME:end --> (as docs/usage.md "
                        "and docs/gpu.md hold them)")
    r.add_argument("--summary-name", default=None, metavar="NAME",
                   help="the markers' NAME (default: icleval; with --summary-into only)")
    return r


def report_from_args(args, file=None) -> int:
    from ..errors import require
    from .report import check_summary_target, load_runs, write_report, write_summary_into

    from ..errors import SiclError

    if args.summary_name is not None and not args.summary_into:
        raise SiclError(f"--summary-name {args.summary_name} has no effect without --summary-into FILE.md (it names "
                        "the markers in that file); give both or neither")
    if args.summary_name is not None and not args.summary_name.strip():
        raise SiclError("--summary-name: an empty name; give the NAME of the markers (default icleval)")
    if args.summary_name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.summary_name):
        # it goes inside an HTML comment on one line: "-->" would end the comment, a newline split the marker
        raise SiclError(f"--summary-name {args.summary_name!r}: use letters, digits, '_', '.' and '-' (the name goes "
                        "inside the markers <!-- sicl-report:NAME:begin -->)")
    name = args.summary_name or "icleval"
    if args.summary_into:  # refused before any work: the file, its markers, whether it can be rewritten
        check_summary_target(args.summary_into, name)
    require("scipy")
    if not args.no_plots:
        require("matplotlib")
    # the folder before the records (a flag before the work), made once they read: a refused report makes none
    check_out_dir(args.report, "--report", REPORT_FILES, make=False, files=REPORT_NAMES, inputs=args.results)
    runs = load_runs(args.results, args.names)
    check_out_dir(args.report, "--report", REPORT_FILES)
    rep = write_report(args.report, runs, plots=not args.no_plots)
    if args.summary_into:
        write_summary_into(args.summary_into, name, rep, source=", ".join(map(str, args.results)))
    with open(f"{args.report}/report.md", encoding="utf-8") as fh:
        print(fh.read(), file=file or sys.stdout)
    return 0


__all__ = ["add_icleval_eval_args", "check_icleval_args", "check_method_flags", "METHOD_FLAGS",
           "run_icleval_from_args", "finished_run", "print_report", "add_report_command", "report_from_args",
           "options_from_args"]
