"""The precision study: which paths calibrate as float32 does. For ICLEval samples and each precision path, the
gain of a seeded calibration by its own proxy and by the float32 proxy of the X it returns (the measure that
counts: a low-precision proxy can climb its own rounding), and the greedy answer decoded from that X.

    python bench/precision_fidelity.py ICLEval/data/tasks_data --models smollm2 --per-file 3 --steps 20 \\
        --out bench/precision_fidelity/records.jsonl --report bench/precision_fidelity/report.md

(add --shard 0/2 and --shard 1/2 to run two processes side by side on one --out file)

The paths (each an Engine configuration; `fp32` is the reference):
    fp32         float32 model, every product in float32 (backend fast-fp32)
    fp32-rows    float32 model, the difference form (diff_matmul bf16: float32 activations, every projection one bf16
                 product of the rows' changes: rows 1.. from row 0, the value rows from their float32 reference)
    fp32-rows-rounded   the same without the value rows' reference (their values rounded to bf16 as they are):
                 what the reference buys
    bf16-rows    bf16 model, the difference form
    bf16-plain   bf16 model, plain bf16 rows (diff_matmul off): the ascent the difference form replaces
    fp32-fp8     float32 model, the difference form with FP8 e4m3 differences (emulated without FP8 hardware)
    bf16-rows-split     bf16-rows with the reference's products of the bf16 weights as on CUDA: the float32 rows in
                 3 bf16 pieces, bf16 products accumulated in float32 (sicl_fast.models.reference; emulated here)
    bf16-rows-split2    the same with 2 pieces (16 of float32's 24 bits)
    bf16-rows-split-tc  bf16-rows-split with the tensor cores' float32 accumulation modelled (truncating, each group of
                 16 products: sicl_fast.models.tensor_cores.tc_accumulate; reference.ACCUMULATION 'tensor-cores')
    fp32-rows-math      fp32-rows with the math path's attention (IEEE float32: the side the next path is compared
                 with, the same attention code)
    fp32-rows-tf32x3    fp32-rows with the attention's float32 products rounded as the Triton kernel's tf32x3 rounds
                 them on the tensor cores (3 TF32 products; emulated here in torch on the math path,
                 sicl_fast.models.tensor_cores: the operands' rounding exactly, the accumulation in float32)
    bf16-rows-math, bf16-rows-tf32x3    the same two on the bf16 model's difference form
    fp32-tf32x3         fp32 with the emulated tf32x3 attention (the float32 model's plain forward on a GPU)

Every run: tau 0 and patience 0 (the full --steps, no gate), the preset's other settings (N 8 below 1B
parameters), the same seed on every path. Records are appended one per (model, path, sample, steps) and a rerun
skips what is done (resumable); the report is made from every record in the file, one table per model and step
count. The float32 gain of a run is f32(X_best) - f32(X0'), both read by the fp32 path's engine, where X0' is the
path's own start: the prompt's embeddings as its model makes them (on a bf16 model, bf16 values). f32(X0') - f32(X0)
is the start's offset, the same for every run of that model dtype on the sample and not the ascent's doing (on
Gemma 3 270M as large as a calibration's gain); `--fill-starts` adds X0' to records made before it was recorded.

A ratio without a denominator (a float32 gain of 0, as plain bf16 gives on Gemma 3) is `n/a`. Bad input (a folder
without ICLEval task files, a missing model package, a records file that is not one) is one line and exit status 2,
before any model loads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

from sicl_fast.commands.cli import _Parser
from sicl_fast.errors import SiclError, SiclWarning
from sicl_fast.formats.inputs import json_value
from sicl_fast.run.knobs import arg_type

PROG = "precision_fidelity.py"

PATHS = {  # name -> (model dtype, Engine choices)
    "fp32": ("float32", dict(backend="fast-fp32")),
    "fp32-rows": ("float32", dict(backend="fast", diff_matmul="bf16")),
    "fp32-rows-rounded": ("float32", dict(backend="fast", diff_matmul="bf16")),  # StepForward.references off
    "bf16-rows": ("bfloat16", dict(backend="fast", diff_matmul="bf16")),
    "bf16-plain": ("bfloat16", dict(backend="fast", diff_matmul="off")),
    "fp32-fp8": ("float32", dict(backend="fast", diff_matmul="fp8")),
    "bf16-rows-split": ("bfloat16", dict(backend="fast", diff_matmul="bf16")),
    "bf16-rows-split2": ("bfloat16", dict(backend="fast", diff_matmul="bf16")),
    "bf16-rows-split-tc": ("bfloat16", dict(backend="fast", diff_matmul="bf16")),
    "fp32-rows-math": ("float32", dict(backend="fast", diff_matmul="bf16", attn="math")),
    "fp32-rows-tf32x3": ("float32", dict(backend="fast", diff_matmul="bf16", attn="math", attn_precision="tf32x3")),
    "bf16-rows-math": ("bfloat16", dict(backend="fast", diff_matmul="bf16", attn="math")),
    "bf16-rows-tf32x3": ("bfloat16", dict(backend="fast", diff_matmul="bf16", attn="math", attn_precision="tf32x3")),
    "fp32-tf32x3": ("float32", dict(backend="fast-fp32", attn="math", attn_precision="tf32x3")),
}
# the paths whose reference takes a bf16 weight's products in bf16 pieces: (reference.SPLIT, reference.PIECES,
# reference.ACCUMULATION)
SPLIT_PATHS = {"bf16-rows-split": ("on", 3, "float32"), "bf16-rows-split2": ("on", 2, "float32"),
               "bf16-rows-split-tc": ("on", 3, "tensor-cores")}
MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}  # name -> sicl_fast.models.load's model argument


def pick_samples(folder: str, per_file: int, max_tokens: int, tokenizer, max_context):
    """The first `per_file` samples of each ICLEval task file in `folder` whose prompt has at most max_tokens
    tokens (a CPU-sized study), the files taken in turn (each file's first, then each file's second, ...: a study
    stopped early still spans the files)."""
    from sicl_fast.icleval import load_dir, tokenize_sample

    per = []
    for name, samples in sorted(load_dir(folder).items()):
        short = (s for s in samples if tokenize_sample(s, tokenizer, max_context).length <= max_tokens)
        per.append([(name, s) for _, s in zip(range(per_file), short)])
    return [got[i] for i in range(per_file) for got in per if i < len(got)]


KEYS = ("model", "path", "sample", "max_steps", "f32_gain", "f32_best", "f32_initial", "own_gain", "seconds",
        "steps", "answer", "correct")  # what a record holds (run writes them; report and fill_starts read them)


def read_study(path: str) -> list[dict]:
    """The records of --out, each checked to be one of this study's (a SiclError names the line otherwise)."""
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            # sicl_fast's one reader of JSON lines: not UTF-8, nested too deep, a 5000-digit number are one line too
            r = json_value(line, f"{path}:{n}", what="JSON record (is this the study's records file?)")
            missing = [k for k in KEYS if not isinstance(r, dict) or k not in r]
            if missing:
                raise SiclError(f"{path}:{n}: not a record of this study (no {', '.join(missing)})")
            records.append(r)
    return records


def done_keys(path: str) -> set:
    if not os.path.exists(path):
        return set()
    return {(r["model"], r["path"], r["sample"], r["max_steps"]) for r in read_study(path)}


def make_engines(model: str, paths, threads):
    """(the float32 reference engine, {path: its Engine}) for one model, each model dtype loaded once."""
    from sicl_fast import Engine
    from sicl_fast.models import load

    lms = {"float32": load(MODELS[model], dtype="float32")}
    ref = Engine(lms["float32"], backend="fast-fp32", threads=threads)
    engines = {}
    for path in paths:
        dtype, choices = PATHS[path]
        if dtype not in lms:
            lms[dtype] = load(MODELS[model], dtype=dtype)
        engines[path] = Engine(lms[dtype], threads=threads, **choices)
    return ref, engines


def f32_of_start(ref, eng, prompt) -> float:
    """f32(X0'): the float32 proxy of the path's own start, the prompt's embeddings as its model makes them."""
    return float(ref.proxy(prompt, embeds=eng.backend.embed(prompt)).f[0])


def fill_starts(args) -> None:
    """Records made before f32_start was recorded: add it (one proxy a sample and model dtype), set f32_gain from
    it, and rewrite --out (no run may be appending to it)."""
    from sicl_fast.evaluation.methods import sample_prompt
    from sicl_fast.icleval import load_dir

    records = read_study(args.out)
    todo = [r for r in records if "f32_start" not in r]
    by_key = {f"{name}:{s.uid}": s for name, samples in load_dir(args.icleval).items() for s in samples}
    for model in sorted({r["model"] for r in todo}):
        paths = sorted({r["path"] for r in todo if r["model"] == model})
        ref, engines = make_engines(model, paths, args.threads)
        starts = {}
        for r in (r for r in todo if r["model"] == model):
            dtype = PATHS[r["path"]][0]
            if (r["sample"], dtype) not in starts:
                prompt = sample_prompt(ref, by_key[r["sample"]])
                starts[r["sample"], dtype] = f32_of_start(ref, engines[r["path"]], prompt)
            r["f32_start"] = starts[r["sample"], dtype]
            r["f32_gain"] = r["f32_best"] - r["f32_start"]
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, args.out)
    print(f"{len(todo)} records given their start", flush=True)


def run(args) -> None:
    from sicl_fast.backends.step_forward import StepForward
    from sicl_fast.evaluation.methods import sample_prompt
    from sicl_fast.models import reference
    from sicl_fast.icleval import max_gen_len, score, should_stop

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = done_keys(args.out)
    for model in args.models:
        ref, engines = make_engines(model, args.paths, args.threads)
        samples = pick_samples(args.icleval, args.per_file, args.max_tokens, ref.lm.tokenizer, ref.lm.max_context)
        samples = samples[args.shard[0]::args.shard[1]]
        print(f"# {model}: {len(samples)} samples, paths {', '.join(args.paths)}", flush=True)
        for name, s in samples:
            key = f"{name}:{s.uid}"
            prompt = sample_prompt(ref, s)
            f32_0 = None
            for path in args.paths:
                if (model, path, key, args.steps) in done:
                    continue
                eng = engines[path]
                if f32_0 is None:
                    f32_0 = float(ref.proxy(prompt).f[0])
                f32_start = f32_of_start(ref, eng, prompt)
                t0 = time.perf_counter()
                StepForward.references = path != "fp32-rows-rounded"
                reference.SPLIT, reference.PIECES, reference.ACCUMULATION = SPLIT_PATHS.get(path,
                                                                                           ("auto", 3, "float32"))
                try:
                    res = eng.calibrate(prompt, max_steps=args.steps, tau=0.0, patience=0)
                finally:
                    StepForward.references = True
                    reference.SPLIT, reference.PIECES, reference.ACCUMULATION = "auto", 3, "float32"
                seconds = time.perf_counter() - t0
                f32_best = float(ref.proxy(prompt, embeds=res.embeddings.float()).f[0])
                stop = lambda text, s=s: should_stop(s, text)  # noqa: E731
                gen = eng.generate(prompt, res.embeddings.to(eng.lm.dtype), max_new_tokens=max_gen_len(s),
                                   stop_strings=(), stop_fn=stop)
                rec = {"model": model, "path": path, "sample": key, "L": prompt.length, "max_steps": args.steps,
                       "steps": res.steps, "seconds": round(seconds, 3), "own_initial": res.initial_proxy,
                       "own_best": res.best_proxy, "f32_initial": f32_0, "f32_start": f32_start, "f32_best": f32_best,
                       "own_gain": res.best_proxy - res.initial_proxy, "f32_gain": f32_best - f32_start,
                       "answer": gen.text, "correct": bool(score(s, gen.text)), "best_step": res.best_step}
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"{model} {path:10s} {key:34s} L {prompt.length:4d} f32 gain {rec['f32_gain']:+.3e} "
                      f"own {rec['own_gain']:+.3e} ({seconds:.0f} s)", flush=True)


def ratio(a: float, b: float) -> float | None:
    """a / b, None where there is no denominator (a float32 gain of 0 on every sample)."""
    return a / b if b else None


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def report(records: list[dict]) -> str:
    """The study's tables: per model and path, the float32 gain kept (sum over samples against fp32's, and the
    median of the per-sample ratios), the answers equal to fp32's, the own gain against the float32 one, the
    start's offset (mean |f32(X0') - f32(X0)|, the model dtype's doing, not the ascent's), the time."""
    lines = []
    for model, max_steps in sorted({(r["model"], r["max_steps"]) for r in records}):
        rs = [r for r in records if r["model"] == model and r["max_steps"] == max_steps]
        ref = {r["sample"]: r for r in rs if r["path"] == "fp32"}
        lines += [f"### {model}: {len(ref)} samples, {max_steps} steps", "",
                  "| path | float32 gain kept (sum) | median per sample | answers = fp32's | own gain / float32 gain "
                  "| start's offset | correct | s / step |", "|---|---|---|---|---|---|---|---|"]
        for path in [p for p in PATHS if any(r["path"] == p for r in rs)]:
            got = [r for r in rs if r["path"] == path and r["sample"] in ref]
            if not got:
                continue
            kept = ratio(sum(r["f32_gain"] for r in got), sum(ref[r["sample"]]["f32_gain"] for r in got))
            ratios = [r["f32_gain"] / ref[r["sample"]]["f32_gain"] for r in got if ref[r["sample"]]["f32_gain"] > 0]
            same = sum(r["answer"] == ref[r["sample"]]["answer"] for r in got)
            # the own gain against the float32 one: shown where it means a ratio (the float32 gain kept)
            own = ratio(sum(r["own_gain"] for r in got), sum(r["f32_gain"] for r in got))
            own = f"{own:.2f}" if kept is not None and kept > 0.05 and own is not None else "-"
            step = ratio(sum(r["seconds"] for r in got), sum(r["steps"] for r in got))
            offset = statistics.mean(abs(r.get("f32_start", r["f32_initial"]) - r["f32_initial"]) for r in got)
            lines.append(f"| {path} | {pct(kept)} | {pct(statistics.median(ratios) if ratios else None)} | "
                         f"{same} / {len(got)} | {own} | {offset:.1e} | {sum(r['correct'] for r in got)} / "
                         f"{len(got)} | {'n/a' if step is None else f'{step:.2f}'} |")
        lines.append("")
    return "\n".join(lines)


def shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    try:
        i, n = map(int, text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, e.g. 0/2") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: N, the number of shards, must be >= 1")
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be in 0..{n - 1}")
    return i, n


def check_inputs(args) -> None:
    """What the study reads and writes, before any model loads: --out's records for --report-only and
    --fill-starts; else a place for --out, the ICLEval folder (the task files it holds) and every model's files (a
    missing package said with how to install it)."""
    from sicl_fast.formats.records import check_output
    from sicl_fast.icleval import load_dir
    from sicl_fast.models.loading import resolve

    if args.report is not None:
        check_output(args.report, flag="--report")
    if args.report_only or args.fill_starts:
        if not os.path.isfile(args.out):
            flag = "--report-only" if args.report_only else "--fill-starts"
            raise SiclError(f"--out {args.out}: no records file there ({flag} reads it; run the study first)")
        if not read_study(args.out):
            raise SiclError(f"--out {args.out}: holds no records")
    else:
        check_output(args.out)
    if not args.report_only:
        load_dir(args.icleval)
        for model in args.models:
            resolve(MODELS[model])


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings in one line each (an ICLEval file that differs from the released data), as sicl-fast's."""
    if issubclass(category, SiclWarning):
        print(f"{PROG}: warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("icleval", help="ICLEval's data/tasks_data folder (the task files)")
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=sorted(MODELS))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--per-file", type=arg_type("limit"), default=3, help="samples taken from each task file")
    ap.add_argument("--max-tokens", type=arg_type("length"), default=400, help="longest prompt taken (tokens)")
    ap.add_argument("--steps", type=arg_type("max_steps"), default=20)
    ap.add_argument("--threads", type=arg_type("threads"), default=None)
    ap.add_argument("--shard", type=shard, default=(0, 1), metavar="I/N",
                    help="run the samples I, I + N, I + 2N, ... (processes side by side, one --out file)")
    ap.add_argument("--out", default="bench/precision_fidelity/records.jsonl")
    ap.add_argument("--report", default=None, help="write the tables (markdown) here")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--report-only", action="store_true", help="make the tables from --out, run nothing")
    only.add_argument("--fill-starts", action="store_true",
                      help="add f32_start to the records of --out made without it (then the report), run nothing "
                           "else")
    args = ap.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = warning_line
            study(args)
    except (SiclError, OSError) as exc:
        what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else exc
        print(f"{PROG}: error: {what}", file=sys.stderr)
        return 2
    return 0


def study(args) -> None:
    """The study (or its report) as the flags ask: check_inputs, run or fill_starts, the tables."""
    check_inputs(args)
    torch.manual_seed(0)
    if args.fill_starts:
        fill_starts(args)
    elif not args.report_only:
        run(args)
    text = report(read_study(args.out))
    print(text)
    if args.report:
        from sicl_fast.formats.records import write_text_atomic

        write_text_atomic(args.report, f"<!-- {' '.join(sys.argv)} -->\n\n" + text + "\n")


if __name__ == "__main__":
    sys.exit(main())
